"""README.md, CHANGELOG.md and docs/*.md point only at files inside the repository that exist,
and keep no run history (no numbered sessions or rounds)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
"""Markdown links ``[text](target)``."""
PATH = re.compile(r"`((?:\.\./)+[\w./-]*\.[a-z]+|(?:docs|bench|configs)/[\w./-]+)`")
"""Paths in code spans that name a file of the repository (``docs/x.md``, ``bench/y.py``) or a
file outside it (``../shared/DESIGN.md``; a bare ``../../etc`` is an example, not a file)."""
CODE_PATH = re.compile(
    r"`((?:collector|store|trainer|analysis|sandpiper|scripts|tasks|tests/(?:unit|integration|e2e"
    r"|fixtures))/[\w./-]+)"
)
"""Paths of code in code spans (``collector/daemon/core.py``, ``store/slots.py:claim_slots``),
checked in the user docs (not in CHANGELOG.md, which names files as they were): code moves, and
a newcomer who follows a stale path finds nothing. (A task's own ``tests/run.sh`` is no path of
the repository.)"""


def _targets(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # not http:, mailto:


def _heading_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {
        _heading_anchor(line.lstrip("#"))
        for line in path.read_text().splitlines()
        if line.startswith("#")
    }


def _problems(doc: Path) -> list[str]:
    text = doc.read_text()
    found = []
    for target in _targets(text):
        file_part, _, anchor = target.partition("#")
        resolved = (doc.parent / file_part).resolve() if file_part else doc
        if ROOT not in (resolved, *resolved.parents):
            found.append(f"{target}: outside the repository")
        elif not resolved.exists():
            found.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            found.append(f"{target}: no heading #{anchor} in {resolved.name}")
    for path in PATH.findall(text):
        if path.startswith("../"):
            found.append(f"`{path}`: outside the repository")
        elif not (ROOT / path.rstrip("/")).exists():
            found.append(f"`{path}`: no such file")
    if doc.name != "CHANGELOG.md":
        for path in CODE_PATH.findall(text):
            if not (ROOT / path.rstrip("/.")).exists():
                found.append(f"`{path}`: no such file")
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_points_only_at_files_in_the_repository(doc: Path) -> None:
    assert doc.exists(), f"{doc.relative_to(ROOT)} is missing"
    assert _problems(doc) == []


HISTORY = re.compile(r"\b(session \d+|round \d+|\d{1,2}:\d{2} UTC|20\d\d-\d\d-\d\d)", re.IGNORECASE)
"""Numbered work sessions and rounds, timed or dated runs."""


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "CHANGELOG.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))  # fmt: skip
def test_doc_keeps_no_run_history(doc: Path) -> None:
    """History lives in CHANGELOG.md and bench/results/, not in the user docs."""
    assert HISTORY.findall(doc.read_text()) == []


def test_the_checks_can_fail(tmp_path: Path, monkeypatch) -> None:
    doc = ROOT / "docs" / "__probe__.md"
    try:
        doc.write_text(
            "[design](../../shared/DESIGN.md) [gone](missing.md) [anchor](tasks.md#nowhere)\n"
            "See `../shared/PLATFORM.md` and `bench/nothing_here.py`; session 12 measured it.\n"
            "The daemon was `collector/daemon.py` (`collector/daemon/core.py` now).\n"
        )
        problems = _problems(doc)
        assert len(problems) == 6, problems
        assert HISTORY.findall(doc.read_text())
    finally:
        doc.unlink()
