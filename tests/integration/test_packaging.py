"""The installed package claims one top-level name, ``sandpiper`` (issue 18).

The parts keep their source folders at the repository's top (``collector/``, ``store/``,
``trainer/``, ``analysis/``) and install as ``sandpiper.<part>``. This builds the wheel from the
working tree, installs it into an empty folder and imports from there with the repository
off ``sys.path``: a generic top-level module name (``store``, ``trainer``, ...) in the wheel,
or a part missing from it, fails here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PARTS = ("collector", "store", "trainer", "analysis")

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: pip builds in the source tree, and a stale build/ there would add
    # files the working tree no longer has. The part symlinks are copied as links.
    source = out / "source"
    shutil.copytree(
        REPO, source, symlinks=True,
        ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info", "__pycache__",
                                      ".*_cache", "tests", "bench", "docs"),
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(source)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (path,) = out.glob("sandpiper-*.whl")
    return path


def test_the_wheel_has_one_top_level_name_and_every_part(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"sandpiper"}
    for part in PARTS:
        assert f"sandpiper/{part}/__init__.py" in names, part
    # Files the parts read at run time, not only modules.
    assert "sandpiper/collector/sandbox/supervisor/__main__.py" in names
    assert "sandpiper/analysis/templates/report.html.j2" in names
    assert "sandpiper/models/data/chat_template.jinja" in names


def test_the_installed_wheel_imports_as_sandpiper_parts_only(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    installed = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")}
    assert installed == {"sandpiper", "bin"}  # bin/: the `sandpiper` console script
    probe = (
        "import importlib, importlib.util, sys\n"
        f"sys.path.insert(0, {str(target)!r})\n"
        "import sandpiper.store.records, sandpiper.collector.sandbox.client, "
        "sandpiper.trainer.loss, sandpiper.analysis.views\n"
        f"assert sandpiper.store.records.__file__.startswith({str(target)!r})\n"
        f"print([p for p in {PARTS!r} if importlib.util.find_spec(p) is not None])\n"
    )
    # -I: no PYTHONPATH, no user site, no current folder: only the wheel and the venv's site
    # (whose editable install of this checkout maps only `sandpiper`).
    result = subprocess.run(
        [sys.executable, "-I", "-c", probe],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
