"""Learner leadership in the store (DuckDB file and PostgreSQL): one leader per run, terms
that fence claims and registrations, atomic version registration that fails loudly.

Cost: a few seconds per backend (no model, no learner process).
"""

from __future__ import annotations

import threading
import time

import pytest

from sandpiper.errors import NotLeaderError, PolicyConflictError
from sandpiper.store import Store
from sandpiper.store.records import Fence, GroupStatus, PolicyRecord, RunRecord
from sandpiper.testing import make_group
from tests.integration.store.test_store import _fresh_pg_db, _write

pytestmark = pytest.mark.integration


@pytest.fixture(params=["duckdb", "postgres"])
def store(request, tmp_path):
    if request.param == "duckdb":
        url = f"duckdb:///{tmp_path / 'store.duckdb'}"
    else:
        url = _fresh_pg_db(request.getfixturevalue("postgres_url"))
    s = Store(url, lock_timeout_s=10)
    s.init()
    s.ensure_run(RunRecord("run", "{}", "test"))
    yield s
    s.close()


def _fence(lease) -> Fence:
    assert lease.held
    return Fence(lease.run_id, lease.learner_id, lease.term)


def test_second_learner_waits_then_takes_over_with_a_new_term(store, tmp_path):
    a = store.leases.acquire(run_id="run", learner_id="A", lease_s=0.5)
    assert a.held and a.term == 1
    b = store.leases.acquire(run_id="run", learner_id="B", lease_s=0.5)
    assert not b.held and b.learner_id == "A" and b.term == 1
    assert store.leases.acquire(run_id="run", learner_id="A", lease_s=0.5).term == 1  # renewal
    fa = _fence(a)
    store.policy_versions.register(PolicyRecord("run", 0, "ckpt/0", None, None), fence=fa)
    _write(store, [make_group(f"g{i}") for i in range(3)], tmp_path)
    claim = store.claims.claim(run_id="run", learner_id="A", n_groups=2, max_lag=5, fence=fa)
    assert claim is not None

    time.sleep(0.7)  # A stops renewing: its lease lapses
    b = store.leases.acquire(run_id="run", learner_id="B", lease_s=30)
    assert b.held and b.term == 2
    # A's claim went back to READY with the takeover; A's late writes are refused.
    assert store.claims.group_counts("run")[GroupStatus.READY] == 3
    with pytest.raises(NotLeaderError, match="term 1 was superseded"):
        store.policy_versions.register(PolicyRecord("run", 1, "ckpt/1", 0, 0), claim_id=claim.claim_id,
                              fence=fa)  # fmt: skip
    with pytest.raises(NotLeaderError):
        store.claims.claim(run_id="run", learner_id="A", n_groups=1, max_lag=5, fence=fa)
    with pytest.raises(NotLeaderError):
        store.leases.renew(fa, lease_s=30)
    with pytest.raises(NotLeaderError):
        store.claims.release(claim.claim_id, fence=fa)
    assert store.policy_versions.latest("run").version == 0

    fb = _fence(b)
    mine = store.claims.claim(run_id="run", learner_id="B", n_groups=2, max_lag=5, fence=fb)
    assert mine.group_ids == claim.group_ids  # the same oldest groups, re-claimed
    store.policy_versions.register(
        PolicyRecord("run", 1, "ckpt/1", 0, 1), claim_id=mine.claim_id, fence=fb
    )
    assert store.claims.group_counts("run")[GroupStatus.CONSUMED] == 2
    store.leases.release(fb)  # a clean stop: the next learner need not wait
    c = store.leases.acquire(run_id="run", learner_id="C", lease_s=30)
    assert c.held and c.term == 3


def test_registration_is_one_insert_that_fails_loudly(store):
    store.policy_versions.register(PolicyRecord("run", 0, "ckpt/0", None, None))
    store.policy_versions.register(PolicyRecord("run", 1, "ckpt/1", 0, 1))
    with pytest.raises(PolicyConflictError, match="latest registered version is 1"):
        store.policy_versions.register(
            PolicyRecord("run", 1, "ckpt/1b", 0, 1)
        )  # a second learner's v1
    with pytest.raises(PolicyConflictError, match="latest registered version is 1"):
        store.policy_versions.register(PolicyRecord("run", 3, "ckpt/3", 2, 3))  # a gap
    assert [p.checkpoint_uri for p in store.policy_versions.all("run")] == ["ckpt/0", "ckpt/1"]


def test_concurrent_first_learners_get_exactly_one_leader(store):
    results, barrier = [], threading.Barrier(4)

    def take(name: str) -> None:
        barrier.wait()
        results.append(store.leases.acquire(run_id="run", learner_id=name, lease_s=30))

    threads = [threading.Thread(target=take, args=(f"L{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.held for r in results) == 1
    assert {(r.learner_id, r.term) for r in results} == {
        (next(r.learner_id for r in results if r.held), 1)
    }


def test_migration_3_upgrades_a_store_written_before_leases(store):
    import sqlalchemy as sa

    from sandpiper.store import migrations

    with store.backend.write() as conn:  # what a store of schema version 1 looks like
        conn.execute(sa.text("DROP TABLE learner_leases"))
        conn.execute(sa.text("UPDATE schema_meta SET value = '1' WHERE key = 'schema_version'"))
    old = Store(store.url)
    assert old.migrate() == list(range(2, migrations.latest_version() + 1))
    assert old.leases.acquire(run_id="run", learner_id="A", lease_s=5).held
    old.close()
