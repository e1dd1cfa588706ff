"""kill -9 a writer process at random points; nothing acknowledged is lost or duplicated.

``ROUNDS`` writers are killed one after another (6 in ``make test``, 24 in ``make
test-long``), each 1-3 s into its run."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import pytest
import sqlalchemy as sa

from sandpiper.store import Store
from tests.conftest import REPO, volume

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROUNDS = volume(6, 24)

WRITER = """
import sys
from sandpiper.store import Store
from sandpiper.testing import make_group
url, spool, prefix = sys.argv[1:4]
store = Store(url, lock_timeout_s=30)
with store.writer(spool_dir=spool, flush_interval_s=0.05, flush_max_episodes=40) as w:
    print("ready", flush=True)
    for i in range(100_000):
        gid = f"{prefix}-{i}"
        w.put(make_group(gid, n_episodes=4, n_turns=3, tokens_per_turn=20))
        print("ack", gid, flush=True)
"""

RECOVER = """
import sys, time
from sandpiper.errors import StoreError
from sandpiper.store import Store
store = Store(sys.argv[1], lock_timeout_s=30)
started = time.monotonic()
w = store.writer(spool_dir=sys.argv[2])
print("pending", w.pending(), flush=True)
try:
    w.flush(timeout_s=90)  # a commit that keeps failing says why, instead of retrying on
except StoreError as e:
    w.abandon()
    sys.exit(f"recovery failed after {time.monotonic() - started:.0f} s: {e}")
w.close()
print(f"recovered in {time.monotonic() - started:.1f} s", flush=True)
"""


def _run_and_kill(url: str, spool: str, prefix: str, delay_s: float) -> list[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, url, spool, prefix],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    acked: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("ack "):
                acked.append(line.split()[1])
            elif line.startswith("ready"):
                ready.set()

    reader = threading.Thread(target=read)
    reader.start()
    # the kill comes delay_s into the writing, not into the interpreter's start-up (imports
    # take from 0.5 to several seconds on a loaded 2-core machine)
    ready.wait(timeout=120)
    time.sleep(delay_s)
    proc.kill()  # SIGKILL
    proc.wait()
    reader.join()
    return acked


@pytest.mark.volume
def test_kill_9_writer_loses_nothing_acknowledged(tmp_path):
    url = f"duckdb:///{tmp_path / 's.duckdb'}"
    Store(url).init()
    spool = str(tmp_path / "spool")
    rng = random.Random(1234)
    acked: list[str] = []
    for round_ in range(ROUNDS):
        acked += _run_and_kill(url, spool, f"r{round_}", rng.uniform(1.0, 3.0))
    assert len(acked) > ROUNDS, "writers never acknowledged anything; the test proves nothing"
    out = subprocess.run(
        [sys.executable, "-c", RECOVER, url, spool], cwd=REPO, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]

    store = Store(url)
    with store.connect_readonly() as conn:
        q = lambda sql: conn.execute(sa.text(sql)).all()  # noqa: E731
        stored = {r[0]: r[1] for r in q("SELECT group_id, count(*) FROM groups GROUP BY 1")}
        assert all(n == 1 for n in stored.values())
        missing = [g for g in acked if g not in stored]
        assert not missing, f"acknowledged but lost: {missing[:5]}"
        partial = q(
            "SELECT g.group_id FROM groups g LEFT JOIN episodes e USING (group_id) "
            "GROUP BY g.group_id, g.n_episodes HAVING count(e.episode_id) != g.n_episodes"
        )
        assert not partial
        assert not q("SELECT episode_id FROM episodes GROUP BY 1 HAVING count(*) != 1")
        turns_per_ep = q("SELECT count(*) FROM turns GROUP BY episode_id")
        assert {r[0] for r in turns_per_ep} == {3}
        n_eps = q("SELECT count(*) FROM episodes")[0][0]
        assert len(turns_per_ep) == n_eps
        orphans = {
            "episodes": "SELECT count(*) FROM episodes WHERE group_id NOT IN "
            "(SELECT group_id FROM groups)",
            "turns": "SELECT count(*) FROM turns WHERE episode_id NOT IN "
            "(SELECT episode_id FROM episodes)",
            "tool_calls": "SELECT count(*) FROM tool_calls WHERE episode_id NOT IN "
            "(SELECT episode_id FROM episodes)",
            "group_states": "SELECT count(*) FROM group_states WHERE group_id NOT IN "
            "(SELECT group_id FROM groups)",
            "groups": "SELECT count(*) FROM groups WHERE group_id NOT IN "
            "(SELECT group_id FROM group_states)",
        }
        for table, sql in orphans.items():
            assert q(sql)[0][0] == 0, f"orphan rows in {table}"
    store.close()


HOLD_LOCK = """
import sys, time
from sandpiper.store.locking import DuckDBFileLock
with DuckDBFileLock(sys.argv[1], timeout_s=30).hold(write=True):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_put_is_acknowledged_while_another_process_holds_the_lock(tmp_path):
    from sandpiper.testing import make_group

    db = tmp_path / "s.duckdb"
    store = Store(f"duckdb:///{db}", lock_timeout_s=30)
    store.init()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(db), "3"], stdout=subprocess.PIPE, text=True,
        cwd=REPO,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with store.writer(spool_dir=str(tmp_path / "spool"), flush_interval_s=0.05) as w:
            start = time.monotonic()
            for i in range(3):
                w.put(make_group(f"g{i}"))
            assert time.monotonic() - start < 1.5  # acknowledged without the store lock
            assert w.pending() == 3
            assert len(list((tmp_path / "spool").glob("*.group"))) == 3
            w.flush(timeout_s=60)
        assert store.stats()["rows"]["groups"] == 3
        assert not list((tmp_path / "spool").glob("*.group"))
    finally:
        holder.kill()
        holder.wait()
    store.close()
