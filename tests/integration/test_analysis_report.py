"""The HTML report in a real browser (headless Chromium) and its MLflow artifact."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sandpiper.analysis.report import build_report

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


@pytest.fixture(scope="module")
def report_dir(analysis_duckdb_url: str, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    build_report(analysis_duckdb_url, out, run_id="synthetic")
    return out


def _rendered_status(page: Path, profile: Path) -> str:
    """What the page's load script wrote into ``data-report-status`` (ok:N / broken:N)."""
    dom = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = re.search(r'data-report-status="([^"]*)"', dom.stdout)
    assert found, "the page's load script did not run"
    return found.group(1)


def test_report_shows_in_headless_chromium(report_dir: Path, tmp_path: Path) -> None:
    require_chromium()
    n_images = len(list(report_dir.glob("*.png")))
    assert _rendered_status(report_dir / "index.html", tmp_path / "profile") == f"ok:{n_images}"


def test_a_broken_plot_is_detected(report_dir: Path, tmp_path: Path) -> None:
    """The check above can fail: corrupt one embedded PNG and the page reports it."""
    require_chromium()
    html = (report_dir / "index.html").read_text()
    broken = re.sub(
        r"data:image/png;base64,[A-Za-z0-9+/]{40}", "data:image/png;base64,AAAA", html, count=1
    )
    page = tmp_path / "broken.html"
    page.write_text(broken)
    assert _rendered_status(page, tmp_path / "profile") == "broken:1"


def require_chromium() -> None:
    from tests.conftest import require

    require("chromium", Path(CHROMIUM).exists(), "apt-get install chromium")


@pytest.mark.slow
def test_report_is_logged_to_mlflow(report_dir: Path, tmp_path: Path, monkeypatch) -> None:
    import mlflow

    monkeypatch.chdir(tmp_path)  # anything MLflow would drop into the cwd stays in tmp

    from sandpiper.analysis.report import ReportResult, log_to_mlflow
    from sandpiper.config import TrackingConfig

    tracking = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="t")
    result = ReportResult(report_dir / "index.html", {})
    run_id = log_to_mlflow(result, tracking, runs_dir=str(tmp_path), run_id="synthetic")
    client = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri)
    names = {Path(a.path).name for a in client.list_artifacts(run_id, "report")}
    assert "index.html" in names and "staleness.png" in names
    assert client.get_run(run_id).data.tags["sandpiper.run_id"] == "synthetic"
