"""Collector identity, slot order, orphan spools and the janitor's verdicts (no services;
the slot tests use an embedded DuckDB file)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import pickle

import pytest

from sandpiper.collector.daemon.launch import adopt_orphan_spools
from sandpiper.collector.sandbox.janitor import ContainerInfo, Verdict, judge
from sandpiper.store import Store
from sandpiper.store.records import RunRecord, Split
from sandpiper.store.slots import new_collector_id, task_rank
from sandpiper.testing import make_group


def _ids(n: int) -> list[str]:
    return [new_collector_id("same-host") for _ in range(n)]


def test_collector_ids_are_unique_within_and_across_processes() -> None:
    ids = _ids(1000)
    with mp.get_context("spawn").Pool(2) as pool:
        others = [i for chunk in pool.map(_ids, [200, 200]) for i in chunk]
    assert len(set(ids + others)) == 1400
    host, pid, start, rand = ids[0].split(":")
    assert host == "same-host" and pid.isdigit() and len(start) == 15 and len(rand) == 12


@pytest.fixture
def store(tmp_path):
    s = Store(f"duckdb:///{tmp_path / 'store.duckdb'}")
    s.init()
    s.ensure_run(RunRecord("run", "{}", "test"))
    yield s
    s.close()


def test_slots_follow_least_sampled_then_rank_order(store) -> None:
    tasks = [(f"t{i}", task_rank(f"t{i}", seed=7)) for i in range(4)]
    cid = store.slots.register(run_id="run", host="h")
    got = [x.group_id for x in store.slots.claim(run_id="run", collector_id=cid, tasks=tasks,
                                                  ttl_s=60, n=10)]  # fmt: skip
    by_rank = [t for t, _ in sorted(tasks, key=lambda t: t[1])]
    want = [f"run/{t}/{seq}" for seq in range(3) for t in by_rank][:10]
    assert got == want
    # a validation claim only takes the named task, in its own split
    val = store.slots.claim(run_id="run", collector_id=cid, tasks=[("v", "r")], ttl_s=60,
                            split=Split.VALIDATION, only=["v"])  # fmt: skip
    assert [x.group_id for x in val] == ["run/v/0"]


def test_orphan_spools_are_committed_and_live_ones_left_alone(store, tmp_path) -> None:
    base = tmp_path / "spool"
    dead, live, mine = base / "dead-host", base / "live-host", base / "me"
    for folder in (dead, live, mine):
        folder.mkdir(parents=True)
    for gid, folder in (("g-dead", dead), ("g-live", live)):
        name = hashlib.sha1(gid.encode()).hexdigest()
        (folder / f"{name}.group").write_bytes(pickle.dumps(make_group(gid)))
    holder = store.writer(spool_dir=str(live), flush_interval_s=3600)  # a live collector
    own = store.writer(spool_dir=str(mine))
    assert adopt_orphan_spools(store, own.spool) == 1
    own.close()
    assert store.claims.group_ids("run") == ["g-dead"]
    assert not list(dead.glob("*.group"))
    holder.close()  # its own writer commits its group on close
    assert store.claims.group_ids("run") == ["g-dead", "g-live"]


def _box(collector: str, *, store: str | None = "S", age_s: float = 10.0) -> ContainerInfo:
    labels = {"sandpiper.collector": collector}
    if store is not None:
        labels["sandpiper.store"] = store
    return ContainerInfo("box", "running", "", labels, created_s=1000.0 - age_s)


@pytest.mark.parametrize(
    ("box", "verdict"),
    [
        (_box("live"), Verdict.LIVE),
        (_box("dead"), Verdict.DEAD),
        (_box("dead", store="OTHER"), Verdict.OTHER_STORE),
        (_box("host:123"), Verdict.UNKNOWN_YOUNG),
        (_box("host:123", store=None, age_s=7200), Verdict.UNKNOWN_OLD),
        (_box("dead", store=None), Verdict.DEAD),
    ],
)
def test_janitor_judges_by_heartbeats_not_pids(box, verdict) -> None:
    live = {"live": True, "dead": False}
    assert judge(box, store_id="S", live=live, grace_s=3600, now_s=1000.0) is verdict
    assert verdict.orphan == (verdict in (Verdict.DEAD, Verdict.UNKNOWN_OLD))


@pytest.mark.timeout(60)  # a group that cannot commit keeps the writer retrying
def test_a_group_spooled_by_the_previous_release_commits_after_the_upgrade(store, tmp_path):
    """Before GroupSampling, ``sampling_params`` was a dict in the pickled spool files: an
    acknowledged group must still commit (issue 18: upgrades must not strand the spool)."""
    import dataclasses

    old = dataclasses.replace(make_group("g-old"), sampling_params={"temperature": 0.5,
                              "limits": {"max_turns": 3}, "max_tokens": 16})  # fmt: skip
    spool = tmp_path / "spool"
    spool.mkdir()
    name = hashlib.sha1(b"g-old").hexdigest()
    (spool / f"{name}.group").write_bytes(pickle.dumps(old))
    writer = store.writer(spool_dir=str(spool))
    writer.flush(timeout_s=20)
    writer.close()
    assert store.claims.group_ids("run") == ["g-old"]
    with store.connect_readonly() as conn:
        import sqlalchemy as sa

        stored = conn.execute(sa.text("SELECT sampling_params FROM groups")).scalar_one()
    got = json.loads(stored) if isinstance(stored, str) else stored
    assert got == {"temperature": 0.5, "top_p": 1.0, "max_tokens_per_turn": 16, "max_turns": 3}
