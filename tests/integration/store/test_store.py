"""The Store API on real DuckDB files and a real PostgreSQL server (same tests, both)."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
import sqlalchemy as sa

from sandpiper.errors import PolicyConflictError, SchemaVersionError, StoreError
from sandpiper.store import Store, migrations
from sandpiper.store.records import GroupStatus, PolicyRecord, RunRecord, TaskRecord
from sandpiper.testing import expected_tokens, make_group

pytestmark = pytest.mark.integration


def _fresh_pg_db(server_url: str) -> str:
    import psycopg

    url = sa.make_url(server_url)
    name = f"t_{uuid.uuid4().hex[:10]}"
    admin = f"host={url.host} port={url.port} user={url.username} dbname=postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return url.set(database=name).render_as_string(hide_password=False)


@pytest.fixture(params=["duckdb", "postgres"])
def store_url(request, tmp_path) -> str:
    if request.param == "duckdb":
        return f"duckdb:///{tmp_path / 'store.duckdb'}"
    return _fresh_pg_db(request.getfixturevalue("postgres_url"))


@pytest.fixture
def store(store_url, tmp_path):
    s = Store(store_url, lock_timeout_s=10)
    s.init()
    s.ensure_run(RunRecord("run", '{"a": 1}', "test"))
    s.policy_versions.register(PolicyRecord("run", 0, "ckpt/0", None, None))
    yield s
    s.close()


def _write(store, groups, tmp_path):
    with store.writer(
        spool_dir=str(tmp_path / f"spool-{uuid.uuid4().hex}"), flush_interval_s=0.1
    ) as w:
        for g in groups:
            w.put(g)


def test_init_is_idempotent_and_records_version(store):
    store.init()
    store.ensure_run(RunRecord("run", "{}", "test"))
    with pytest.raises(PolicyConflictError, match="latest registered version is 0"):
        store.policy_versions.register(PolicyRecord("run", 0, "ckpt/0", None, None))
    assert store.schema_version() == migrations.latest_version()
    assert store.policy_versions.latest("run").version == 0


def test_written_groups_come_back_exactly_once(store, tmp_path):
    groups = [make_group(f"g{i}", tokens_per_turn=30) for i in range(5)]
    _write(store, groups, tmp_path)
    _write(store, groups[:2], tmp_path)  # re-sent: stored once
    assert store.write_groups(groups) == 0
    stats = store.stats()
    assert stats["rows"]["groups"] == 5
    assert stats["rows"]["episodes"] == 20
    assert stats["rows"]["turns"] == 60
    assert store.claims.group_counts("run")[GroupStatus.READY] == 5


def test_claim_returns_numpy_arrays_and_consumes_on_register(store, tmp_path):
    _write(store, [make_group(f"g{i}", tokens_per_turn=11) for i in range(4)], tmp_path)
    batch = store.claims.claim(run_id="run", learner_id="L1", n_groups=3, max_lag=1)
    assert batch is not None and batch.group_ids == ("g0", "g1", "g2")
    ep = batch.groups[1].episodes[2]
    assert isinstance(ep.token_ids_T, np.ndarray) and ep.token_ids_T.dtype == np.int32
    want = np.concatenate([expected_tokens("g1", 2, t, 11) for t in range(3)])
    np.testing.assert_array_equal(ep.token_ids_T, want)
    np.testing.assert_array_equal(ep.loss_mask_T, np.repeat([False, True, False], 11))
    assert ep.behaviour_logprobs_T.dtype == np.float32
    assert store.claims.claim(run_id="run", learner_id="L2", n_groups=3, max_lag=1) is None

    store.policy_versions.register(
        PolicyRecord("run", 1, "ckpt/1", 0, 0), claim_id=batch.claim_id, metrics={"loss": 0.5}
    )
    counts = store.claims.group_counts("run")
    assert counts[GroupStatus.CONSUMED] == 3 and counts[GroupStatus.READY] == 1
    assert store.policy_versions.latest("run").version == 1
    with store.connect_readonly() as conn:
        row = conn.execute(sa.text("SELECT n_groups, policy_version FROM learner_steps")).one()
    assert tuple(row) == (3, 1)


def test_register_rolls_back_when_claim_was_lost(store, tmp_path):
    _write(store, [make_group("g0")], tmp_path)
    batch = store.claims.claim(run_id="run", learner_id="L1", n_groups=1, max_lag=1)
    store.claims.release(batch.claim_id)
    with pytest.raises(StoreError, match="holds no groups"):
        store.policy_versions.register(
            PolicyRecord("run", 1, "ckpt/1", 0, 0), claim_id=batch.claim_id
        )
    assert store.policy_versions.latest("run").version == 0  # nothing of the failed step remains
    assert store.claims.group_counts("run")[GroupStatus.READY] == 1


def test_stale_groups_are_dropped_and_counted(store, tmp_path):
    for v in (1, 2, 3):
        store.policy_versions.register(PolicyRecord("run", v, f"ckpt/{v}", v - 1, v - 1))
    old = [make_group(f"old{i}", policy_version=0) for i in range(2)]
    fresh = [make_group(f"new{i}", policy_version=2) for i in range(2)]
    _write(store, old + fresh, tmp_path)
    batch = store.claims.claim(run_id="run", learner_id="L", n_groups=2, max_lag=1)
    assert batch.dropped_stale == 2 and batch.current_version == 3
    assert set(batch.group_ids) == {"new0", "new1"}
    assert store.claims.group_counts("run")[GroupStatus.DROPPED_STALE] == 2


def test_restarted_learner_retakes_its_own_claim(store, tmp_path):
    _write(store, [make_group(f"g{i}") for i in range(4)], tmp_path)
    first = store.claims.claim(run_id="run", learner_id="L1", n_groups=2, max_lag=1)
    other = store.claims.claim(run_id="run", learner_id="L2", n_groups=2, max_lag=1)
    assert set(first.group_ids).isdisjoint(other.group_ids)
    again = store.claims.claim(run_id="run", learner_id="L1", n_groups=2, max_lag=1)
    assert set(again.group_ids) == set(first.group_ids)


def test_expired_lease_can_be_taken_by_another_learner(store, tmp_path):
    _write(store, [make_group("g0")], tmp_path)
    store.claims.claim(run_id="run", learner_id="L1", n_groups=1, max_lag=1, lease_s=-1)
    taken = store.claims.claim(run_id="run", learner_id="L2", n_groups=1, max_lag=1)
    assert taken is not None and taken.group_ids == ("g0",)


def test_concurrent_learners_never_share_a_group(store_url, store, tmp_path):
    _write(store, [make_group(f"g{i:02d}", tokens_per_turn=5) for i in range(40)], tmp_path)
    claimed: dict[str, list[str]] = {}

    def learner(name: str) -> None:
        own = Store(store_url, lock_timeout_s=30)
        ids: list[str] = []
        # a new learner_id per claim: a learner re-claiming under its own id re-takes its claim
        while (
            b := own.claims.claim(
                run_id="run", learner_id=f"{name}-{len(ids)}", n_groups=2, max_lag=5
            )
        ) is not None:
            ids.extend(b.group_ids)
        claimed[name] = ids
        own.close()

    threads = [threading.Thread(target=learner, args=(f"L{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    all_ids = [g for ids in claimed.values() for g in ids]
    assert len(claimed) == 4
    assert len(all_ids) == len(set(all_ids)), "a group was claimed twice"
    assert len(all_ids) >= 36  # SKIP LOCKED may leave a partial tail unclaimed at the end


def test_sft_episodes_filters_by_reward(store, tmp_path):
    _write(store, [make_group(f"g{i}", n_invalid=1) for i in range(3)], tmp_path)
    eps = store.claims.sft_episodes(run_id="run", min_reward=1.0)
    assert len(eps) == 3 * 2  # odd sample indexes have reward 1; index 0 is invalid
    assert all(e.reward >= 1.0 and e.valid for e in eps)
    assert all(isinstance(e.token_ids_T, np.ndarray) for e in eps)
    assert len(store.claims.sft_episodes(run_id=None, min_reward=0.0, limit=4)) == 4


def test_tasks_upsert_replaces(store):
    store.upsert_tasks([TaskRecord("t1", "f.jsonl", "jsonl_math", "1+1?", {"answer": "2"}, None)])
    store.upsert_tasks([TaskRecord("t1", "f.jsonl", "jsonl_math", "1+2?", {"answer": "3"}, None)])
    with store.connect_readonly() as conn:
        rows = conn.execute(sa.text("SELECT instruction FROM tasks")).all()
    assert [r[0] for r in rows] == ["1+2?"]


def test_migrate_applies_a_registered_migration(store, monkeypatch):
    def add_note(conn):
        conn.execute(sa.text("ALTER TABLE runs ADD COLUMN note VARCHAR"))

    new = migrations.latest_version() + 1
    monkeypatch.setitem(migrations.MIGRATIONS, new, add_note)
    stale = Store(store.url)
    with pytest.raises(SchemaVersionError, match="store migrate"):
        stale.policy_versions.latest("run")
    assert stale.migrate() == [new]
    assert stale.schema_version() == new
    assert stale.policy_versions.latest("run").version == 0
    stale.close()


def test_readonly_connection_cannot_write(store):
    with pytest.raises(Exception), store.connect_readonly() as conn:  # noqa: B017
        conn.execute(sa.text("DELETE FROM runs"))
    assert store.stats()["rows"]["runs"] == 1
