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


def _dom(page: Path, profile: Path) -> str:
    """The page's DOM after its load script ran, as headless Chromium serialises it."""
    dom = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout


def _rendered_status(page: Path, profile: Path) -> str:
    """What the page's load script wrote into ``data-report-status`` (ok:N / broken:N)."""
    found = re.search(r'data-report-status="([^"]*)"', _dom(page, profile))
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


LONG_VERSIONS = 200
LONG_STEPS = 40
"""Learner steps registered for the long report: enough to fold its table; each is two
store transactions, so all 199 would add ~20 s for nothing the unit tests do not cover."""


@pytest.fixture(scope="module")
def long_report(tmp_path_factory) -> Path:
    """The report of a run whose episodes span 200 policy versions (one group of 4 each,
    written in one batch), with :data:`LONG_STEPS` learner steps claimed and registered."""
    from sandpiper.store import Store
    from sandpiper.testing.synthetic import synthetic_run

    base = tmp_path_factory.mktemp("long-report")
    url = f"duckdb:///{base / 'store.duckdb'}"
    run = synthetic_run(num_versions=LONG_VERSIONS - 1, groups_per_version=1, groups_per_step=1)
    store = Store(url)
    store.init()
    store.ensure_run(run.run)
    store.upsert_tasks(run.tasks)
    store.policy_versions.register(run.initial_policy)
    store.write_groups(run.groups)
    for step in run.steps[:LONG_STEPS]:
        batch = store.claims.claim(run_id="synthetic", learner_id="l", n_groups=1, max_lag=10**6)
        assert batch is not None
        store.policy_versions.register(step.policy, claim_id=batch.claim_id, metrics=step.metrics)
    store.close()
    build_report(url, base / "out", run_id="synthetic")
    return base / "out"


def test_a_200_version_report_reads_in_the_browser(long_report: Path, tmp_path: Path) -> None:
    """Every plot decodes and is laid out with a visible size; every long table is folded
    (closed ``<details>``), so the page opens on plots, not on 200 table rows."""
    from sandpiper.analysis.report import FOLD_ROWS

    require_chromium()
    page = long_report / "index.html"
    n_images = len(list(long_report.glob("*.png")))
    dom = _dom(page, tmp_path / "profile")
    status = re.search(r'data-report-status="([^"]*)"', dom)
    assert status and status.group(1) == f"ok:{n_images}", status
    # reward_by_version has one row per version, importance_weights one per learner step
    folded = {int(n) for n in re.findall(r'<details data-rows="(\d+)">', dom)}
    assert {LONG_VERSIONS, LONG_STEPS} <= folded, folded
    assert "<details open" not in dom
    outside = re.sub(r"<details.*?</details>", "", dom, flags=re.S)
    for table in re.findall(r"<table>.*?</table>", outside, flags=re.S):
        assert table.count("<tr>") - 1 <= FOLD_ROWS  # shown tables are short ones


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
