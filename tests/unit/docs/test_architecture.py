"""docs/architecture.md stays true: every file or folder it names exists, and every
``module.py:function`` it names is defined there (a move or a rename fails this test)."""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO

DOC = REPO / "docs" / "architecture.md"
PATH = re.compile(
    r"`((?:collector|store|trainer|analysis|sandpiper|bench|tests)/[\w/.]*)(?::[\w.]+)?`"
)
FUNC = re.compile(r"`((?:collector|store|trainer|analysis|sandpiper)/[\w/]+\.py):(\w+(?:\.\w+)?)`")


def _defined(path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    scope: list[ast.stmt] = tree.body
    for part in name.split("."):
        found = next(
            (n for n in scope if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef |
             ast.ClassDef) and n.name == part),
            None,
        )  # fmt: skip
        if found is None:
            return False
        scope = found.body
    return True


def test_every_path_named_exists():
    text = DOC.read_text()
    named = set(PATH.findall(text))
    assert len(named) > 30, "the map names the folders and the modules of one episode and step"
    missing = sorted(p for p in named if not (REPO / p.rstrip("/")).exists())
    assert not missing, missing


def test_every_function_named_is_defined_where_it_says():
    named = set(FUNC.findall(re.sub(r"\s+", " ", DOC.read_text())))
    assert len(named) >= 10
    wrong = sorted(f"{p}:{n}" for p, n in named if not _defined(REPO / p, n))
    assert not wrong, wrong
