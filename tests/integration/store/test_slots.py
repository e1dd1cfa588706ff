"""Collector registry, task slots and loud duplicates on real DuckDB and PostgreSQL.

Cost: ~1-2 s per backend (in-process; the PostgreSQL server is the shared session fixture).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import sqlalchemy as sa

from sandpiper.errors import DuplicateGroupError, StoreError
from sandpiper.store import Store, migrations
from sandpiper.store.records import RunRecord, SlotLease, WriteOutcome
from sandpiper.store.slots import task_rank
from sandpiper.testing import make_group
from tests.integration.store.test_store import store_url  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

TASKS = [(f"t{i}", task_rank(f"t{i}", 0)) for i in range(3)]
ORDER = sorted(TASKS, key=lambda t: t[1])  # rank order of a round


@pytest.fixture
def store(store_url):  # noqa: F811
    s = Store(store_url, lock_timeout_s=20)
    s.init()
    s.ensure_run(RunRecord("run", "{}", "test"))
    yield s
    s.close()


def _group(lease: SlotLease, *, tag: str = ""):
    g = make_group(lease.group_id, task_id=lease.task_id, n_episodes=2, n_turns=1)
    episodes = tuple(replace(e, episode_id=e.episode_id + tag) for e in g.episodes)
    return replace(g, episodes=episodes, collector_id=lease.collector_id, slot_lease=lease.lease)


def _claim(store, cid, **kw):
    return store.slots.claim_one(run_id="run", collector_id=cid, tasks=TASKS, ttl_s=60, **kw)


def test_collector_ids_are_unique_and_registered(store):
    ids = [store.slots.register(run_id="run", host="same-host") for _ in range(20)]
    assert len(set(ids)) == 20
    rows = store.slots.collectors("run")
    assert [r.collector_id for r in rows] == ids
    assert all(r.host == "same-host" and r.stopped_at is None for r in rows)
    assert store.slots.heartbeat(ids[0])
    store.slots.stop(ids[0])
    assert not store.slots.heartbeat(ids[0])
    assert store.slots.liveness(ttl_s=60) == {i: i != ids[0] for i in ids}


def test_slots_go_round_robin_in_rank_order_across_collectors(store):
    a = store.slots.register(run_id="run", host="a")
    b = store.slots.register(run_id="run", host="b")
    leases = [_claim(store, cid) for cid in (a, b) * 3]
    want = [f"run/{t}/{seq}" for seq in (0, 1) for t, _ in ORDER]
    assert [x.group_id for x in leases] == want
    assert all(x.lease == 1 for x in leases)
    assert store.slots.counts("run") == {"free": 0, "leased": 6, "done": 0}


def test_released_and_dead_collectors_slots_are_reissued_first(store):
    a = store.slots.register(run_id="run", host="a")
    b = store.slots.register(run_id="run", host="b")
    first = [_claim(store, a) for _ in range(3)]
    assert store.slots.release(first[1])
    again = _claim(store, b)
    assert again.group_id == first[1].group_id and again.lease == 2
    assert not store.slots.release(first[1])  # re-issued: the old lease cannot free it
    # a's heartbeat lapses (b's is renewed): a's two remaining slots go to b
    time.sleep(1.2)
    assert store.slots.heartbeat(b)
    reissued = [
        store.slots.claim_one(run_id="run", collector_id=b, tasks=TASKS, ttl_s=1.0)
        for _ in range(2)
    ]
    assert {x.group_id for x in reissued} == {first[0].group_id, first[2].group_id}
    # a's late groups are refused; b's are stored, each exactly once
    late = store.write_groups_report([_group(first[0], tag="a")])
    assert late.outcomes == {first[0].group_id: WriteOutcome.SUPERSEDED}
    fresh = store.write_groups_report([_group(x) for x in [again, *reissued]])
    assert fresh.n_stored == 3
    counts = store.slots.counts("run")
    assert counts["leased"] == 0 and counts["done"] == 3  # (free: rounds added ahead)


def test_duplicate_group_id_is_a_loud_error_and_a_resend_is_not(store):
    a = store.slots.register(run_id="run", host="a")
    lease = _claim(store, a)
    group = _group(lease)
    assert store.write_groups([group]) == 1
    assert store.write_groups_report([group]).outcomes == {group.group_id: WriteOutcome.REPLAYED}
    other = _group(lease, tag="other")  # same id, other episodes: another producer
    with pytest.raises(DuplicateGroupError, match="duplicate"):
        store.write_groups([other])
    with store.connect_readonly() as conn:
        n = conn.execute(sa.text("SELECT count(*) FROM episodes")).scalar_one()
        owner = conn.execute(sa.text("SELECT collector_id FROM groups")).scalar_one()
    assert n == 2 and owner == a


def test_stopping_frees_leases_and_a_late_group_of_a_free_slot_is_still_stored(store):
    a = store.slots.register(run_id="run", host="a")
    lease = _claim(store, a)
    assert store.slots.stop(a) == 1
    # nobody took the slot yet: the last holder's group (e.g. replayed from its spool) fills it
    assert store.write_groups([_group(lease)]) == 1
    assert store.slots.counts("run")["done"] == 1
    # a claim that a stop left running (the collector stopped while the store was slow)
    # leases nothing: its slots would stay leased, by nobody, until the heartbeat TTL
    with pytest.raises(StoreError, match="is stopped"):
        _claim(store, a)
    assert store.slots.counts("run")["leased"] == 0


def test_concurrent_claims_never_share_a_slot(store_url, store):  # noqa: F811
    got: dict[int, list[str]] = {}

    def collector(i: int) -> None:
        own = Store(store_url, lock_timeout_s=30)
        cid = own.slots.register(run_id="run", host=f"h{i}")
        got[i] = [_claim(own, cid).group_id for _ in range(15)]
        own.close()

    threads = [threading.Thread(target=collector, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    ids = [g for v in got.values() for g in v]
    assert len(ids) == 60 and len(set(ids)) == 60
    # no gaps: 60 slots over 3 tasks are exactly seqs 0..19 of each
    assert set(ids) == {f"run/{t}/{s}" for t, _ in TASKS for s in range(20)}


def test_collectors_starting_at_once_register_the_run_and_tasks_without_a_conflict(
    store_url,  # noqa: F811
):
    """Every collector (and learner) starting on a run creates the schema if there is none,
    registers the run and upserts the tasks. Two starting at the same moment on PostgreSQL
    once raced a check-then-insert and a delete-then-insert: one died with UniqueViolation
    on ``runs_pkey`` (seen in CI); on a fresh database both ran the CREATE TABLEs."""
    from sandpiper.store.records import Split, TaskRecord

    tasks = [TaskRecord(f"t{i}", "src", "jsonl_math", f"q{i}", {"answer": str(i)}, None,
                        Split.TRAIN) for i in range(50)]  # fmt: skip
    errors: list[BaseException] = []
    for round_ in range(3):
        start = threading.Barrier(6)

        def collector(run_id: str = f"run-{round_}", start: threading.Barrier = start) -> None:
            own = Store(store_url, lock_timeout_s=60)
            try:
                start.wait(timeout=60)
                own.init()  # the first round on a database without a schema
                own.ensure_run(RunRecord(run_id, "{}", "test"))
                own.upsert_tasks(tasks)
            except BaseException as e:  # reported below
                errors.append(e)
            finally:
                own.close()

        threads = [threading.Thread(target=collector) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    check = Store(store_url)
    with check.connect_readonly() as conn:
        runs = conn.execute(sa.text("SELECT count(*) FROM runs")).scalar()
        stored = conn.execute(sa.text("SELECT count(*) FROM tasks")).scalar()
    check.close()
    assert (runs, stored) == (3, 50)


def test_a_version_1_store_migrates(store):
    # groups of the journal era: their seqs must not be issued again
    store.write_groups([make_group(f"run/t0/{i}", task_id="t0") for i in range(2)])
    with store.backend.write() as conn:
        conn.execute(sa.text("DROP TABLE collectors"))
        conn.execute(sa.text("DROP TABLE task_slots"))
        conn.execute(sa.text("ALTER TABLE groups DROP COLUMN collector_id"))
        conn.execute(sa.text("DELETE FROM schema_meta WHERE key = 'store_id'"))
        conn.execute(sa.text("UPDATE schema_meta SET value = '1' WHERE key = 'schema_version'"))
    stale = Store(store.url)
    assert stale.migrate() == list(range(2, migrations.latest_version() + 1))
    cid = stale.slots.register(run_id="run")
    lease = stale.slots.claim_one(run_id="run", collector_id=cid, tasks=TASKS[:1], ttl_s=60)
    assert lease.group_id == "run/t0/2"
    assert stale.write_groups([_group(lease)]) == 1
    assert stale.store_id()
    stale.close()


def test_a_version_4_store_gains_the_collectors_policy_version(store):
    cid = store.slots.register(run_id="run", host="a")
    with store.backend.write() as conn:
        conn.execute(sa.text("ALTER TABLE collectors DROP COLUMN policy_version"))
        conn.execute(sa.text("UPDATE schema_meta SET value = '4' WHERE key = 'schema_version'"))
    stale = Store(store.url)
    assert stale.migrate() == list(range(5, migrations.latest_version() + 1))
    assert [r.policy_version for r in stale.slots.collectors("run")] == [None]
    assert stale.slots.heartbeat(cid, policy_version=2)
    assert stale.slots.referenced_versions(run_id="run", within_s=60) == {2}
    stale.close()


def test_text_with_copy_escapes_and_nan_round_trips(store):
    """PostgreSQL ingest formats COPY text itself: tabs, newlines, backslashes, a literal
    ``\\N``, NULLs and NaN must come back exactly."""
    import math

    import numpy as np

    hostile = "tab\there\nnew line\\back slash \\N not null\r\n{1,2}"
    g = make_group("esc", n_episodes=2, n_turns=2, tokens_per_turn=3)
    turn = replace(g.episodes[0].turns[1], text=hostile,
                   logprobs_T=np.array([np.nan, -0.1, -1e-7], np.float32))  # fmt: skip
    first = replace(g.episodes[0], error=hostile, turns=(g.episodes[0].turns[0], turn))
    store.write_groups([replace(g, episodes=(first, *g.episodes[1:]))])
    with store.connect_readonly() as conn:
        errors = conn.execute(sa.text("SELECT error FROM episodes ORDER BY sample_index")).all()
        text, logprobs = conn.execute(
            sa.text("SELECT text, logprobs FROM turns WHERE episode_id = :e AND turn_index = 1"),
            {"e": first.episode_id},
        ).one()
    # the NaN logprob makes the episode invalid at ingest (store.validation), which keeps the
    # original error text after its own
    assert errors[0][0].startswith("bad sampler output") and errors[0][0].endswith(
        f"(earlier error: {hostile})"
    )
    assert errors[1][0] is None
    assert text == hostile
    logprobs = np.frombuffer(bytes(logprobs), "<f4")  # packed float32 (store/schema.py)
    assert math.isnan(logprobs[0]) and list(np.float32(logprobs[1:])) == [
        np.float32(-0.1),
        np.float32(-1e-7),
    ]


def test_heartbeats_announce_the_policy_version_that_retention_keeps(store):
    a = store.slots.register(run_id="run", host="a")
    b = store.slots.register(run_id="run", host="b")
    c = store.slots.register(run_id="run", host="c")
    other_run = store.slots.register(run_id="other", host="d")
    assert store.slots.referenced_versions(run_id="run", within_s=60) == set()  # none announced
    assert store.slots.heartbeat(a, policy_version=3)
    assert store.slots.heartbeat(b, policy_version=5)
    assert store.slots.heartbeat(c, policy_version=4)
    assert store.slots.heartbeat(other_run, policy_version=9)
    assert store.slots.heartbeat(a)  # a plain heartbeat keeps the announced version
    store.slots.stop(c)
    assert [r.policy_version for r in store.slots.collectors("run")] == [3, 5, 4]
    assert store.slots.referenced_versions(run_id="run", within_s=60) == {3, 5}
    with store.transaction() as conn:  # b fell silent 2 minutes ago (store clock)
        conn.execute(
            sa.text("UPDATE collectors SET heartbeat_at = heartbeat_at - INTERVAL '2 minutes' "
                    "WHERE collector_id = :b"),
            {"b": b},
        )  # fmt: skip
    assert store.slots.referenced_versions(run_id="run", within_s=60) == {3}
    assert store.slots.referenced_versions(run_id="run", within_s=600) == {3, 5}
