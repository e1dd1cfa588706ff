"""No poison pill, on DuckDB and PostgreSQL: a group the store fails on is set aside, the others
are committed within one flush interval, the store stays usable, and retry-dead re-submits it.

The failing group is made to fail in the database itself, not in Python: a row squats on
its first episode's id (``episodes`` has its primary key on both backends), so its insert
dies with a unique violation in the middle of the commit, as the NUL byte did on
PostgreSQL before text was escaped."""

from __future__ import annotations

import time
import uuid

import pytest
import sqlalchemy as sa

from sandpiper.errors import PolicyConflictError
from sandpiper.store import Store, schema
from sandpiper.store.records import GroupStatus, PolicyRecord, RunRecord, utcnow
from sandpiper.testing import make_group
from tests.integration.store.test_store import _fresh_pg_db

pytestmark = pytest.mark.integration

FLUSH_S = 2.0


@pytest.fixture(params=["duckdb", "postgres"])
def store(request, tmp_path):
    if request.param == "duckdb":
        url = f"duckdb:///{tmp_path / 'store.duckdb'}"
    else:
        url = _fresh_pg_db(request.getfixturevalue("postgres_url"))
    s = Store(url, lock_timeout_s=10)
    s.init()
    yield s
    s.close()


def _squat(store: Store, episode_id: str) -> None:
    """A row that makes any group with ``episode_id`` fail on commit."""
    with store.transaction() as conn:
        conn.execute(
            sa.insert(schema.episodes).values(
                episode_id=episode_id, group_id="squatter", run_id="run", task_id="t",
                sample_index=0, stop_reason="submitted", valid=True, trainable=True,
                reward=0.0, reward_breakdown={}, n_turns=0, completion_tokens=0,
                total_tokens=0, started_at=utcnow(), duration_ms=0.0,
            )
        )  # fmt: skip


def _unsquat(store: Store, episode_id: str) -> None:
    with store.transaction() as conn:
        conn.execute(sa.delete(schema.episodes).where(schema.episodes.c.episode_id == episode_id))


def _stored(store: Store) -> set[str]:
    return set(store.claims.group_ids("run"))


def test_a_group_that_fails_on_commit_is_set_aside_and_the_others_are_stored(store, tmp_path):
    _squat(store, "poison#0")
    good = [make_group(f"good{i}") for i in range(6)]
    spool = tmp_path / "spool"
    with store.writer(spool_dir=str(spool), flush_interval_s=FLUSH_S) as w:
        for g in good[:3]:
            w.put(g)
        w.put(make_group("poison"))
        for g in good[3:]:
            w.put(g)
        t0 = time.monotonic()
        want = {g.group_id for g in good}
        while not want <= _stored(store):
            assert time.monotonic() - t0 < 2 * FLUSH_S + 5, "good groups waited on the bad one"
            time.sleep(0.1)
        w.flush(timeout_s=30)  # returns: nothing is left pending
        assert w.dead_groups == 1 and w.committed_groups == 6
        # the next clean write succeeds on the same Store (no leftover of the failed ones)
        w.put(make_group("after"))
        w.flush(timeout_s=30)
    assert _stored(store) == want | {"after"}
    (dead,) = store.dead_letters.all()
    assert dead.group_id == "poison" and dead.source == "writer" and dead.attempts == 1
    assert "duplicate" in dead.error.lower()  # the database's own error, not a follow-up
    assert not list((spool / "dead").glob("*"))  # listed in the store, so no local copy left
    assert store.stats()["dead_groups"] == 1
    from sandpiper.analysis.report import _cards, load_frames

    store.ensure_run(RunRecord("run", "{}", "test"))
    assert ("DEAD groups (set aside)", "1") in _cards(load_frames(store, "run"))

    assert store.dead_letters.retry()["poison"].startswith("failed")  # not fixed yet: stays listed
    assert store.dead_letters.all()[0].attempts == 2
    _unsquat(store, "poison#0")
    assert store.dead_letters.retry() == {"poison": "stored"}
    assert store.dead_letters.all() == [] and "poison" in _stored(store)


def test_an_outage_sets_nothing_aside(store, tmp_path, monkeypatch):
    """While the store does not answer, every group stays spooled (none is a dead letter)."""
    calls = {"n": 0}
    real_write, real_ping = store.write_groups_report, store.ping

    def down(*a, **k):
        calls["n"] += 1
        raise sa.exc.OperationalError("SELECT 1", {}, Exception("server closed the connection"))

    monkeypatch.setattr(store, "write_groups_report", down)
    monkeypatch.setattr(store, "ping", down)
    with store.writer(spool_dir=str(tmp_path / "spool"), flush_interval_s=0.1) as w:
        for i in range(3):
            w.put(make_group(f"g{i}"))
        while calls["n"] < 4:
            time.sleep(0.05)
        assert w.dead_groups == 0 and w.pending() == 3
        monkeypatch.setattr(store, "write_groups_report", real_write)
        monkeypatch.setattr(store, "ping", real_ping)
        w.flush(timeout_s=60)
    assert _stored(store) == {"g0", "g1", "g2"} and store.dead_letters.all() == []


def test_a_failed_transaction_leaves_every_write_path_usable(store, tmp_path):
    _squat(store, "bad#0")
    with pytest.raises(Exception, match=r"(?i)duplicate"):  # the driver's own error class
        store.write_groups_report([make_group("bad")])
    assert store.write_groups([make_group("clean")]) == 1  # the bulk path after a failure
    store.ensure_run(RunRecord("run", "{}", "test"))
    with pytest.raises(PolicyConflictError):
        store.policy_versions.register(PolicyRecord("run", 5, "ckpt/5", 4, 4))
    store.policy_versions.register(PolicyRecord("run", 0, "ckpt/0", None, None))
    with pytest.raises(PolicyConflictError):  # a unique violation inside the transaction
        store.policy_versions.register(PolicyRecord("run", 0, "ckpt/0", None, None))
    assert store.write_groups([make_group("clean2")]) == 1
    batch = store.claims.claim(run_id="run", learner_id="L", n_groups=2, max_lag=1)
    assert batch is not None and set(batch.group_ids) == {"clean", "clean2"}


def test_the_learner_sets_aside_a_group_it_cannot_read(store, tmp_path):
    with store.writer(spool_dir=str(tmp_path / f"s{uuid.uuid4().hex}"), flush_interval_s=0.1) as w:
        for i in range(3):
            w.put(make_group(f"g{i}"))
    with store.transaction() as conn:  # a packed int32 array of 3 bytes: no dtype reads it
        conn.execute(
            sa.update(schema.turns).where(schema.turns.c.group_id == "g0")
            .values(token_ids=b"\x01\x02\x03")
        )  # fmt: skip
    batch = store.claims.claim(run_id="run", learner_id="L", n_groups=2, max_lag=1)
    assert batch is not None and set(batch.group_ids) == {"g1", "g2"}
    assert store.claims.group_counts("run")[GroupStatus.DEAD] == 1
    (dead,) = store.dead_letters.all()
    assert dead.group_id == "g0" and dead.source == "learner" and "ValueError" in dead.error
    assert store.dead_letters.retry() == {"g0": "ready"}
    assert (
        store.claims.group_counts("run")[GroupStatus.READY] == 1 and store.dead_letters.all() == []
    )
