"""Two collector PROCESSES on one run (own host ids and spools), one store, DuckDB and
PostgreSQL: exact counts, 0 duplicated, 0 lost — also across a kill -9 and restart.

The processes run the real daemon, store, writer and spool with a scripted policy and fake
sandboxes (``tests/fixtures/_collector_proc.py``): slots, ids and crash safety do not
depend on vLLM or podman. Cost: ~15-30 s per test and backend on a quiet 2-core machine
(mostly Python start-up and DuckDB file-lock turns); several times that under heavy load.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa

from sandpiper.store import Store
from tests.conftest import REPO
from tests.integration.store.test_store import store_url  # noqa: F401  (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GROUP_SIZE = 2
TTL_S = 60.0
"""Long: on a loaded machine a DuckDB heartbeat may wait seconds for the file lock."""


@dataclass
class Proc:
    """A running collector process and what it printed."""

    popen: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    thread: threading.Thread | None = None

    def ids(self, kind: str) -> list[str]:
        return [ln.split()[1] for ln in self.lines if ln.startswith(kind + " ")]

    @property
    def collector_id(self) -> str:
        return self.ids("registered")[0]

    def final(self) -> tuple[int, int]:
        [line] = [ln for ln in self.lines if ln.startswith("final ")]
        stored, rejected = line.split()[1:]
        return int(stored), int(rejected)

    def wait_for(self, kind: str, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.ids(kind)) < n:
            assert self.popen.poll() is None, f"collector exited early: {self.lines[-5:]}"
            assert time.monotonic() < deadline, f"no {n} '{kind}' lines in {timeout_s} s"
            time.sleep(0.05)


_STARTED: list[subprocess.Popen] = []
"""Every collector process a test started, killed after the test whatever its outcome."""


@pytest.fixture(autouse=True)
def _kill_leftovers():
    """A failed assertion must not leave a collector running (one outlived CI for hours)."""
    yield
    while _STARTED:
        popen = _STARTED.pop()
        if popen.poll() is None:
            popen.kill()
            popen.wait(timeout=30)


def _start(url: str, tmp_path: Path, host: str, **opts) -> Proc:
    argv = [sys.executable, "-m", "tests.fixtures._collector_proc", "--url", url, "--run", "run",
            "--host", host, "--spool", str(tmp_path / f"spool-{host}"), "--ttl-s", str(TTL_S), "--heartbeat-s", "1.0"]  # fmt: skip
    for key, value in opts.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    # its fake sandboxes' folders: a process killed with SIGKILL cannot remove them
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path / "tmp")}
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    _STARTED.append(popen)
    proc = Proc(popen)

    def read() -> None:
        for line in popen.stdout:
            proc.lines.append(line.strip())

    proc.thread = threading.Thread(target=read, daemon=True)
    proc.thread.start()
    return proc


def _stop(proc: Proc, sig: int = signal.SIGTERM) -> None:
    if proc.popen.poll() is None:
        proc.popen.send_signal(sig)
    assert proc.popen.wait(timeout=90) in (0, -signal.SIGKILL), proc.lines[-5:]
    proc.thread.join(timeout=10)


def _stored(url: str) -> tuple[dict[str, str], dict[str, int]]:
    """group_id -> collector_id, and group_id -> number of episode rows."""
    store = Store(url)
    with store.connect_readonly() as conn:
        owners = dict(conn.execute(sa.text("SELECT group_id, collector_id FROM groups")).all())
        n_eps = dict(
            conn.execute(sa.text("SELECT group_id, count(*) FROM episodes GROUP BY group_id")).all()
        )
        slots = conn.execute(sa.text("SELECT task_id, seq, status FROM task_slots")).all()
    store.close()
    done = {f"run/{t}/{q}" for t, q, s in slots if s == "done"}
    assert done == set(owners), "a stored group without a done slot, or the reverse"
    for task in {t for t, _, _ in slots}:  # seqs per task are contiguous: no skipped slot
        seqs = sorted(q for t, q, _ in slots if t == task)
        assert seqs == list(range(len(seqs))), (task, seqs)
    return owners, n_eps


def _check_clean(proc: Proc, owners: dict[str, str]) -> None:
    """A collector stopped cleanly: what it acknowledged = what it stored = its store rows."""
    acked, stored = proc.ids("ack"), proc.ids("stored")
    mine = sorted(g for g, c in owners.items() if c == proc.collector_id)
    assert proc.final() == (len(stored), 0)
    assert sorted(acked) == sorted(stored) == mine
    assert len(set(acked)) == len(acked)


@pytest.fixture
def url(store_url):  # noqa: F811
    store = Store(store_url)
    store.init()
    store.close()
    return store_url


def test_two_collectors_share_one_run_exactly(url, tmp_path):
    a = _start(url, tmp_path, "host-a", max_groups=6)
    b = _start(url, tmp_path, "host-b", max_groups=6)
    for p in (a, b):
        p.popen.wait(timeout=240)
        _stop(p)
    owners, n_eps = _stored(url)
    assert len(owners) == 12 and set(n_eps.values()) == {GROUP_SIZE}
    for p in (a, b):
        _check_clean(p, owners)
    assert a.collector_id.startswith("host-a:") and b.collector_id.startswith("host-b:")
    # 12 slots over 3 tasks, issued least-sampled first: 4 of each task, no gap
    assert sorted(owners) == sorted(f"run/t{i}/{s}" for i in range(3) for s in range(4))


def test_kill_9_and_restart_loses_and_duplicates_nothing(url, tmp_path):
    a = _start(url, tmp_path, "host-a")
    b = _start(url, tmp_path, "host-b")
    a.wait_for("ack", 5, timeout_s=180)
    b.wait_for("stored", 2, timeout_s=180)
    _stop(a, signal.SIGKILL)  # mid-run: groups in flight, some acknowledged but uncommitted
    a2 = _start(url, tmp_path, "host-a")  # same host id and spool, a new process id
    a2.wait_for("ack", 3, timeout_s=180)
    for p in (a2, b):
        _stop(p)
    owners, n_eps = _stored(url)
    assert set(n_eps.values()) == {GROUP_SIZE}, "a group with missing or extra episodes"
    acked = [g for p in (a, a2, b) for g in p.ids("ack")]
    assert set(acked) <= set(owners), f"lost: {sorted(set(acked) - set(owners))}"
    # every stored group was reported stored by exactly one process; only the killed one may
    # have committed a batch and died before printing it
    reported = [g for p in (a, a2, b) for g in p.ids("stored")]
    assert len(reported) == len(set(reported)), "a group reported stored twice"
    silent = set(owners) - set(reported)
    assert silent <= set(a.ids("ack")), silent
    _check_clean(b, owners)
    # the restart refuses only spooled groups of the killed process whose slots were
    # re-issued meanwhile (its heartbeat lapsed before the restart replayed them: a loaded
    # machine), and those slots were filled by their next holder (checked above: not lost)
    refused = [ln.split() for ln in a2.lines if ln.startswith("refused ")]
    assert all(kind == "superseded" and gid in a.ids("ack") for _, gid, kind in refused)
    assert a2.final()[1] == len(refused)
    # the restart retired the killed process at once (no TTL wait): nothing stays leased
    store = Store(url)
    assert store.slots.counts("run")["leased"] == 0
    rows = {r.collector_id: r for r in store.slots.collectors("run")}
    assert all(r.stopped_at is not None for r in rows.values()) and len(rows) == 3
    store.close()
