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
- Torch and OpenMP get the worker's share of the cores (``OMP_NUM_THREADS`` = cores /
  xdist workers, unless set): two workers with two threads each on two cores spent their time
  switching and spinning (a learner-heavy set of tests: 161 s -> 124 s with one thread each).
  Children (learners, TRL) inherit it; vLLM binds its own threads.
- ``volume(short, long)``: the size of a test that repeats one behaviour many times (fuzz
  turns, kill -9 rounds), marked ``volume``. ``make test`` runs the short size;
  ``make test-long`` (in CI too) runs the marked tests again at the long one
  (``SANDPIPER_TEST_LONG=1``).
- A failing test's report is rendered with the garbage collector paused (see
  ``pytest_runtest_makereport``).
- Tiers are marked by rule, never by a hand list (``pytest_collection_modifyitems``, and
  docs/testing.md): a test's folder gives its tier marker (``unit``, ``integration``,
  ``e2e``); a test that asks for the shared ``vllm_server`` is marked ``vllm``; ``smoke``
  is set by the test itself. Under pytest-xdist (``make test``) every test is placed in a
  group that one worker runs in order: its module (so module fixtures, such as a sandbox
  pool kept for a module, start once), except that every user of the shared vLLM server
  joins one group, so one worker starts one server for all of them.
"""

from __future__ import annotations

import atexit
import gc
import os
import pkgutil
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_OMP_SET_HERE = "SANDPIPER_TEST_OMP_NUM_THREADS"
"""The ``OMP_NUM_THREADS`` this file set. xdist workers inherit the controller's environment,
where this file ran first with one "worker" (all the cores): a worker that kept that value,
as ``setdefault`` did, ran torch with every core's thread while its neighbours did the same
(an in-process 30-step learner: 10 s alone, 114-141 s in three full runs). An equal value is ours
to replace; any other came from the user and wins."""
if os.environ.get("OMP_NUM_THREADS") in (None, os.environ.get(_OMP_SET_HERE)):
    os.environ["OMP_NUM_THREADS"] = os.environ[_OMP_SET_HERE] = str(
        max(1, (os.cpu_count() or 1) // _WORKERS)
    )
REPO = Path(__file__).resolve().parent.parent

pytest_plugins = [
    "tests.summary",  # the tiers' times and the slowest tests at the end; a failure's part
    *(
        f"tests.fixtures.{m.name}"
        for m in pkgutil.iter_modules([str(Path(__file__).parent / "fixtures")])
        if not m.name.startswith("_")
    ),
]


LONG = os.environ.get("SANDPIPER_TEST_LONG", "") == "1"


def volume(short: int, long: int) -> int:
    """How many times a ``volume`` test repeats its behaviour: ``long`` under
    ``make test-long`` (``SANDPIPER_TEST_LONG=1``), else ``short``."""
    return long if LONG else short


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


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A temp folder with a short path (under /tmp, removed after the test): a Unix socket's
    path must fit in 107 bytes, and pytest's ``tmp_path`` is long."""
    path = Path(tempfile.mkdtemp(prefix="sp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_environment_leaks():
    """A test leaves ``os.environ`` as it found it, whatever it or a library it called set.

    DeepSpeed, started in-process, sets RANK / MASTER_PORT; left behind, a later test's child
    learner inherited a rendezvous port another process held and failed with EADDRINUSE
    (the likely cause of the race bench's learner failing in one CI run)."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


TIER_DIRS = ("unit", "integration", "e2e")
"""``tests/<dir>/`` -> the tier marker of every test in it."""
SHARED_SERVER_FIXTURES = {"vllm_server": "vllm"}
"""Session fixtures that start a server too costly to start once per xdist worker (vLLM:
45-130 s and ~2.5 GB on 2 cores) -> the marker and xdist group of every test that uses one."""


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests_dir = Path(__file__).resolve().parent
    for item in items:
        path = Path(str(item.path)).resolve()
        parts = path.relative_to(tests_dir).parts if path.is_relative_to(tests_dir) else ()
        if parts and parts[0] in TIER_DIRS:
            item.add_marker(parts[0])
        group = parts and "/".join(parts)
        for fixture, marker in SHARED_SERVER_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)
                group = f"shared-{marker}"
        if group and not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_configure(config: pytest.Config) -> None:
    """The same refusal with a readable message, before any worker starts: pytest-xdist 3.8
    appends a test's group by assigning ``item._nodeid``, which pytest 9.2 no longer reads
    (a worker's refusal below only shows as an INTERNALERROR of the controller)."""
    from _pytest.nodes import Node

    grouped = config.getoption("dist", None) == "loadgroup"
    if grouped and "_nodeid" not in getattr(Node, "__slots__", ("_nodeid",)):
        raise pytest.UsageError(XDIST_GROUPS_LOST.format(f"pytest {pytest.__version__}"))


XDIST_GROUPS_LOST = (
    "pytest-xdist cannot group tests ({}): this pytest and pytest-xdist do "
    "not work together (a module's tests and the shared vLLM server's would be scattered over "
    "the workers); install the versions in constraints.txt"
)


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")  # after xdist's own
def pytest_refuse_lost_xdist_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` a worker sends the scheduler each test's id with its group
    after an ``@``; a pytest that pytest-xdist cannot append it for (9.2 with xdist 3.8)
    made every group void: a module's tests, and the shared vLLM server's, were scattered
    over the workers (a second server started, module fixtures once per worker). Refuse."""
    if not getattr(config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in items if any(i.iter_markers("xdist_group"))
            and "@" not in i.nodeid]  # fmt: skip
    if lost:
        raise pytest.UsageError(
            XDIST_GROUPS_LOST.format(f"{len(lost)} lost their group, e.g. {lost[0]}")
        )


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
