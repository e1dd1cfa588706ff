"""Test-wide plumbing.

- ``require(service, available, why)``: integration tests call it when a real service
  (podman, vLLM, PostgreSQL, chromium) is missing. Locally the test is skipped; in CI
  (``CI=true``) it fails, so a broken install can never pass as "all skipped".
- Every module in ``tests/fixtures/`` is loaded as a pytest plugin: each part keeps its
  session fixtures (a vLLM server, a PostgreSQL database, a sandbox pool) there, and each
  fixture cleans up what it starts.
- The run ends with ``os._exit`` after pytest's summary (and its report files) when DuckDB
  is loaded: its nanobind bindings otherwise print ~100 "nanobind: leaked N instances"
  lines at interpreter teardown, which read as failures. ``SANDPIPER_TEST_CLEAN_EXIT=0``
  keeps the normal teardown.
- A failing test's report is rendered with the garbage collector paused (see
  ``pytest_runtest_makereport``).
"""

from __future__ import annotations

import atexit
import gc
import os
import pkgutil
import sys
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
REPO = Path(__file__).resolve().parent.parent

pytest_plugins = [
    f"tests.fixtures.{m.name}"
    for m in pkgutil.iter_modules([str(Path(__file__).parent / "fixtures")])
    if not m.name.startswith("_")
]


def require(service: str, available: bool, why: str = "") -> None:
    """Skip (locally) or fail (in CI) when ``service`` is not available."""
    if available:
        return
    message = f"{service} is not available{': ' + why if why else ''}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: a missing service is a failure)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Render a failure with the garbage collector paused.

    pytest parses the failing test's source with ``ast.parse`` to draw its traceback. On
    CPython 3.11 a collection inside that call can run a finaliser that raises (an asyncio
    transport collected after its loop closed), whose unraisable hook formats a traceback
    with a nested ``ast.parse``; the outer call then fails with "SystemError: AST
    constructor recursion depth mismatch" (python/cpython#106905) and the whole session
    stops with INTERNALERROR instead of reporting the one failure. Seen in CI."""
    if call.excinfo is None or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_exit_status: int | None = None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Skip the interpreter's module teardown (see the module docstring): everything pytest
    writes is written by now; exit handlers still run and output is flushed."""
    if _exit_status is None or "_duckdb" not in sys.modules:
        return
    if os.environ.get("SANDPIPER_TEST_CLEAN_EXIT", "1") == "0":
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
