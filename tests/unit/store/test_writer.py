"""The writer (store/writer.py): what ``put`` checks, when its thread commits, when it
sleeps, how it stops. The spool's format: tests/unit/store/test_spool.py."""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import pytest
import sqlalchemy as sa

from sandpiper.errors import StoreError
from sandpiper.store import Store
from sandpiper.store.records import GroupRecord, RunRecord, StopReason
from sandpiper.store.writer import GroupWriter
from sandpiper.testing import make_group

pytestmark = pytest.mark.timeout(120)  # a group that cannot commit keeps a writer retrying


@pytest.fixture
def store(tmp_path):
    s = Store(f"duckdb:///{tmp_path / 's.duckdb'}", lock_timeout_s=5)
    s.init()
    s.ensure_run(RunRecord("run", "{}", "test"))
    yield s
    s.close()


class Through:
    """``store`` as the writer sees it, with the commits it asks for recorded (``batches``,
    their sizes) and failing while ``down``."""

    def __init__(self, store: Store) -> None:
        self.store, self.batches, self.down = store, [], False

    def __getattr__(self, name):
        return getattr(self.store, name)

    def write_groups_report(self, groups):
        self.batches.append(len(groups))
        if self.down:
            raise sa.exc.OperationalError("COMMIT", {}, Exception("server down"))
        return self.store.write_groups_report(groups)

    def ping(self):
        if self.down:
            raise sa.exc.OperationalError("SELECT 1", {}, Exception("server down"))
        return self.store.ping()


def test_abandon_leaves_the_groups_spooled_and_releases_the_spool(store, tmp_path):
    """A stop whose deadline passed: nothing more is committed, the spool is free at once,
    and the next writer on it commits what was acknowledged."""
    down = Through(store)
    down.down = True
    spool_dir = str(tmp_path / "spool")
    w = GroupWriter(down, flush_interval_s=0.05, flush_max_episodes=1, spool_dir=spool_dir)
    w.put(make_group("g0"))
    with pytest.raises(StoreError, match="not committed"):
        w.flush(timeout_s=0.5)
    assert w.abandon() == 1 and w.dead_groups == 0
    with GroupWriter(store, flush_interval_s=0.05, flush_max_episodes=1,
                     spool_dir=spool_dir) as again:  # fmt: skip
        again.flush(timeout_s=30)
        assert again.committed_groups == 1
    assert store.claims.group_ids("run") == ["g0"] and down.batches


def test_an_idle_writer_sleeps_and_a_new_group_waits_for_its_batch(store, tmp_path):
    """With nothing to commit the writer thread sleeps until a group comes (a wait whose
    timeout had run out with nothing pending spun a core in every collector, ~1 CPU-second
    per second), and a group put into an idle writer is committed ``flush_interval_s`` later,
    in one batch with the groups that came meanwhile."""
    counting = Through(store)
    interval = 1.0
    spool_dir = str(tmp_path / "spool")
    with GroupWriter(counting, flush_interval_s=interval, flush_max_episodes=1000,
                     spool_dir=spool_dir) as w:  # fmt: skip
        w.put(make_group("g0"))
        w.flush(timeout_s=30)
        cpu = time.process_time()
        time.sleep(2 * interval)  # idle: nothing pending, the clock long past
        idle_cpu = time.process_time() - cpu
        assert idle_cpu < 0.3 * interval, f"an idle writer used {idle_cpu:.2f} CPU-s"

        put_at = time.monotonic()
        w.put(make_group("g1"))
        w.put(make_group("g2"))
        deadline = put_at + 30
        while w.committed_groups < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        waited = time.monotonic() - put_at
    assert w.committed_groups == 3 and counting.batches == [1, 2], counting.batches
    assert waited >= 0.9 * interval  # batched, not committed the moment it came


def test_put_checks_sampler_output_once_and_reports_the_checked_group(store, tmp_path, caplog):
    g = make_group("g-nan", n_episodes=2, n_turns=2, tokens_per_turn=4)
    t = g.episodes[0].turns[1]
    lp = t.logprobs_T.copy()
    lp[0] = np.nan
    ep = dataclasses.replace(
        g.episodes[0], turns=(g.episodes[0].turns[0], dataclasses.replace(t, logprobs_T=lp))
    )
    g = dataclasses.replace(g, episodes=(ep, g.episodes[1]))
    seen: list[GroupRecord] = []
    with (
        caplog.at_level(logging.WARNING, logger="sandpiper.store.validation"),
        store.writer(
            spool_dir=str(tmp_path / "spool"), on_outcome=lambda x, o: seen.append(x)
        ) as w,
    ):
        w.put(g)
        w.flush(timeout_s=30)
    (got,) = seen
    assert got.episodes[0].stop_reason is StopReason.BAD_SAMPLER_OUTPUT
    assert not got.episodes[0].valid and got.episodes[1].valid
    assert len([r for r in caplog.records if "bad sampler output" in r.getMessage()]) == 1
    with store.connect_readonly() as conn:
        ((n_valid, status),) = conn.execute(
            sa.text("SELECT n_valid, status FROM groups JOIN group_states USING (group_id)")
        ).all()
    assert (n_valid, status) == (1, "invalid")
