"""The daemon with fakes: slot-based group ids, counting, backpressure, hot reload, drain,
restart, validation."""

from __future__ import annotations

import asyncio

import pytest

from sandpiper.collector.daemon.core import Collector
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.tasks.model import Task
from sandpiper.config import RunConfig
from sandpiper.errors import StoreError
from sandpiper.store.records import GroupStatus, PolicyRecord, Split, WriteOutcome
from sandpiper.store.slots import task_rank
from sandpiper.testing import (
    FAKE_TOOL_SCHEMAS,
    FakePool,
    FakeStore,
    FakeToolbox,
    FakeWriter,
    ReloadablePolicy,
)

SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {"answer": "4"}}\n</tool_call>'
TASKS = [
    Task(f"t{i}", f"what is {i}?", {"reward": "math", "answer": "4"}, "unit", "jsonl_math")
    for i in range(3)
]


def _config(max_lag: int = 2, **collector) -> RunConfig:
    base = {"group_size": 2, "max_concurrent_episodes": 4, "policy_poll_s": 0.05}
    base.update(status_interval_s=60.0, max_unconsumed_groups=1000)
    base.update(collector)
    # processed logprobs: GRPO at a temperature other than 1 needs them (config/checks.py)
    inference = {"logprobs_mode": "processed_logprobs"}
    return RunConfig.model_validate(
        {"name": "run", "collector": base, "learner": {"max_lag": max_lag}, "inference": inference}
    )


def _collector(tokenizer, tmp_path, config, *, tasks=TASKS, store=None, delay_s=0.0, cid="c1"):
    store = store or FakeStore()
    writer = FakeWriter(store)
    policy = ReloadablePolicy(tokenizer, [SUBMIT], cycle=True, delay_s=delay_s)
    collector = Collector(
        config.for_collector(),
        client=policy,
        renderer=ChatRenderer(tokenizer, FAKE_TOOL_SCHEMAS),
        store=store,
        writer=writer,
        pool=FakePool(),
        toolbox_factory=lambda box, task: FakeToolbox(box),
        tasks=list(tasks),
        collector_id=cid,
    )
    return collector, store, writer, policy


async def _until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Wait for ``condition()``: the tests step on what the collector did, not on how long
    it took (a loaded machine starts the daemon in seconds, not milliseconds)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _run(collector, *, stop_after_s: float | None = None):
    stop = asyncio.Event()
    if stop_after_s is not None:
        asyncio.get_running_loop().call_later(stop_after_s, stop.set)
    return await collector.run(stop)


def test_groups_have_deterministic_ids_and_balanced_tasks(tiny_tokenizer, tmp_path):
    collector, _, writer, _ = _collector(tiny_tokenizer, tmp_path, _config(max_groups=6))
    metrics = asyncio.run(_run(collector))
    ids = sorted(g.group_id for g in writer.groups)
    assert ids == sorted(f"run/t{i}/{s}" for i in range(3) for s in range(2))
    for group in writer.groups:
        assert len(group.episodes) == 2 and group.split is Split.TRAIN
        assert [e.sample_index for e in group.episodes] == [0, 1]
        assert all(e.valid and e.reward == 1.0 for e in group.episodes)
        assert group.run_id == "run" and group.sampling_params.temperature == 1.0
    assert metrics.episodes_total == 12 and metrics.groups_total == 6
    assert {s["status"] for s in collector.store.slots.table.values()} == {"done"}
    assert collector.store.stopped == ["c1"]


def _leased_then_freed(store) -> list[str]:
    return sorted(
        f"run/{t}/{q}"
        for (t, q), s in store.slots.table.items()
        if s["status"] == "free" and s["lease"]
    )


def test_only_groups_the_store_reports_stored_count_as_done(tiny_tokenizer, tmp_path):
    collector, _, writer, _ = _collector(tiny_tokenizer, tmp_path, _config(max_groups=3))
    real_put = writer.put
    verdicts = iter([WriteOutcome.STORED, WriteOutcome.DUPLICATE, WriteOutcome.REPLAYED])

    def put(group):
        outcome = next(verdicts)
        if outcome is WriteOutcome.STORED:
            return real_put(group)
        writer.on_outcome(group, outcome)

    writer.put = put
    metrics = asyncio.run(_run(collector))
    assert metrics.groups_total == 1 and metrics.groups_rejected == 1
    assert metrics.snapshot()["groups_rejected"] == 1


def test_a_group_the_store_cannot_take_is_logged_and_counted_not_a_crash(
    tiny_tokenizer, tmp_path, caplog
):
    """``put`` refuses a group the store could never ingest (a collector bug: a trainable turn
    without logprobs); the daemon logs it, counts it and goes on collecting."""
    collector, _, writer, _ = _collector(tiny_tokenizer, tmp_path, _config(max_groups=3))
    real_put, calls = writer.put, []

    def put(group):
        calls.append(group.group_id)
        if len(calls) == 1:
            raise StoreError(f"{group.group_id}/e turn 1: trainable without logprobs_T")
        return real_put(group)

    writer.put = put
    with caplog.at_level("ERROR", logger="sandpiper.collector.daemon.core"):
        metrics = asyncio.run(_run(collector))
    assert metrics.groups_rejected == 1 and metrics.groups_total >= 2
    assert f"group {calls[0]} NOT stored" in caplog.text


def test_slots_freed_by_a_dead_collector_are_collected_first(tiny_tokenizer, tmp_path):
    store = FakeStore()
    ranked = [(t.task_id, task_rank(t.task_id, 0)) for t in TASKS]
    dead = store.slots.claim(run_id="run", collector_id="dead", tasks=ranked, ttl_s=60, n=4,
                             split=Split.TRAIN)  # fmt: skip
    store.slots.stop("dead")  # what reaping does once its heartbeat lapses
    collector, _, writer, _ = _collector(
        tiny_tokenizer, tmp_path, _config(max_groups=4), store=store
    )
    asyncio.run(_run(collector))
    # exactly the dead collector's four slots (in whatever order its groups finished: they
    # run concurrently), none of the slots a live collector would be issued next
    assert sorted(g.group_id for g in writer.groups) == sorted(x.group_id for x in dead)
    # re-issued under a new lease: the dead one's late groups would be refused (superseded)
    assert all(g.slot_lease == 2 and g.collector_id == "c1" for g in writer.groups)


def test_backpressure_stops_new_groups_until_the_learner_consumes(tiny_tokenizer, tmp_path):
    config = _config(max_unconsumed_groups=None, max_lag=1)  # learner.groups_per_step = 8
    collector, store, writer, _ = _collector(tiny_tokenizer, tmp_path, config)
    assert collector.max_unconsumed == 16
    store.counts[GroupStatus.READY] = 14  # the learner is behind

    async def scenario():
        stop = asyncio.Event()
        run = asyncio.create_task(collector.run(stop))
        await _until(lambda: len(writer.groups) >= 2, "two groups")
        await asyncio.sleep(0.5)  # time for more, were it not blocked
        written_while_blocked = len(writer.groups)
        store.counts[GroupStatus.READY] = 0  # the learner consumed everything
        store.counts[GroupStatus.CONSUMED] = 16
        await _until(lambda: len(writer.groups) > 2, "groups after the learner consumed")
        stop.set()
        await run
        return written_while_blocked

    blocked = asyncio.run(scenario())
    assert blocked == 2  # 14 ready + 2 new = 16 = (max_lag + 1) * groups_per_step
    assert len(writer.groups) > 2


def test_new_policy_is_hot_loaded_and_later_tokens_carry_it(tiny_tokenizer, tmp_path):
    collector, store, writer, policy = _collector(tiny_tokenizer, tmp_path, _config(), delay_s=0.01)
    announced_at_reload = []
    reload = policy.reload

    async def recording_reload(checkpoint_dir, version):
        announced_at_reload.append(list(store.announced))
        await reload(checkpoint_dir, version)

    policy.reload = recording_reload

    async def scenario():
        stop = asyncio.Event()
        run = asyncio.create_task(collector.run(stop))
        await _until(lambda: writer.groups, "a group of version 0")
        store.policy = PolicyRecord("run", 1, "/ckpt/v1", 0, 1)
        await _until(
            lambda: any(
                e.policy_version_range == (1, 1) for g in writer.groups for e in g.episodes
            ),
            "an episode of version 1",
        )
        stop.set()
        await run

    asyncio.run(scenario())
    assert policy.reloads == [("/ckpt/v1", 1)]
    # the version was announced in the heartbeat row before loading began (retention)
    assert announced_at_reload == [[(collector.collector_id, 1)]]
    versions = [e.policy_version_range for g in writer.groups for e in g.episodes]
    assert (0, 0) in versions and (1, 1) in versions
    assert collector.metrics.reloads == 1 and collector.metrics.policy_version == 1


def test_drain_cancels_slow_groups_and_restart_reruns_their_slots(tiny_tokenizer, tmp_path):
    config = _config(drain_timeout_s=0.05)
    collector, store, writer, _ = _collector(tiny_tokenizer, tmp_path, config, delay_s=0.3)

    async def scenario():
        stop = asyncio.Event()
        run = asyncio.create_task(collector.run(stop))
        # stop once groups run (their first turn takes 0.3 s; the drain waits 0.05 s)
        await _until(lambda: any(s["status"] == "leased" for s in store.slots.table.values()),
                     "a leased slot")  # fmt: skip
        stop.set()
        await run

    asyncio.run(scenario())
    assert writer.groups == []  # nothing finished
    abandoned = _leased_then_freed(store)  # the stop freed the cancelled groups' slots
    assert abandoned and all(g.startswith("run/t") for g in abandoned)
    # restart: the abandoned slots are collected first, nothing is skipped or duplicated
    collector2, _, writer2, _ = _collector(
        tiny_tokenizer, tmp_path, _config(max_groups=len(abandoned)), store=store, cid="c2"
    )
    asyncio.run(_run(collector2))
    assert sorted(g.group_id for g in writer2.groups) == abandoned


def test_validation_groups_are_stored_as_validation(tiny_tokenizer, tmp_path):
    tasks = [
        *TASKS[:2],
        Task("v0", "val?", {"reward": "math", "answer": "4"}, "u", "m", Split.VALIDATION),
    ]
    config = _config(max_groups=2, validation_every_versions=1, validation_group_size=3)
    collector, _, writer, _ = _collector(tiny_tokenizer, tmp_path, config, tasks=tasks)
    metrics = asyncio.run(_run(collector))
    validation = [g for g in writer.groups if g.split is Split.VALIDATION]
    assert [g.group_id for g in validation] == ["run/v0/0"]
    assert len(validation[0].episodes) == 3
    assert all(g.task_id != "v0" for g in writer.groups if g.split is Split.TRAIN)
    assert metrics.validation_reward_mean == 1.0 and metrics.validation_version == 0


def test_token_budget_bounds_requests_in_flight(tiny_tokenizer, tmp_path):
    config = _config(max_groups=3, max_tokens_in_flight=1)
    collector, _, writer, policy = _collector(tiny_tokenizer, tmp_path, config, delay_s=0.01)
    peak = 0
    inner = policy.generate

    async def counting(prompt, params):
        nonlocal peak
        peak = max(peak, collector.client.in_flight_tokens)
        return await inner(prompt, params)

    policy.generate = counting
    asyncio.run(_run(collector))
    assert len(writer.groups) == 3 and peak == 1


def test_no_train_tasks_is_an_error(tiny_tokenizer, tmp_path):
    val = [Task("v0", "q", {"reward": "math", "answer": "1"}, "u", "m", Split.VALIDATION)]
    collector, *_ = _collector(tiny_tokenizer, tmp_path, _config(), tasks=val)
    with pytest.raises(Exception, match="no train tasks"):
        asyncio.run(_run(collector))


def test_episodes_run_in_the_image_their_task_names(tiny_tokenizer, tmp_path):
    from dataclasses import replace

    tasks = [TASKS[0], replace(TASKS[1], image="localhost/task-image:1")]
    collector, _, _, _ = _collector(tiny_tokenizer, tmp_path, _config(max_groups=2), tasks=tasks)
    asyncio.run(_run(collector))
    assert sorted(collector.pool.images, key=str) == [None, None] + ["localhost/task-image:1"] * 2


def test_a_group_that_raises_stops_the_collector_with_its_error(tiny_tokenizer, tmp_path):
    """Data failures become episode records; anything else (a bug, a broken store) must not
    vanish as an unretrieved task exception while the daemon keeps scheduling."""
    collector, _, writer, _ = _collector(tiny_tokenizer, tmp_path, _config(max_groups=100))

    async def broken_acquire(**_):
        raise TypeError("acquire() got an unexpected keyword argument")

    collector.pool.acquire = broken_acquire
    with pytest.raises(TypeError, match="unexpected keyword"):
        asyncio.run(_run(collector, stop_after_s=30.0))
    assert writer.groups == []
    assert collector._train_groups_started < 100
    # the failed groups' slots are freed: a restart (or another collector) reruns them
    assert _leased_then_freed(collector.store) == ["run/t0/0", "run/t1/0", "run/t2/0"]


def test_a_bug_inside_episodes_is_their_outcome_and_the_daemon_goes_on(tiny_tokenizer, tmp_path):
    """Unlike a broken pool (above), an exception inside one episode (here every other
    toolbox raises) is that episode's record; every group is still stored."""
    collector, _, writer, _ = _collector(tiny_tokenizer, tmp_path, _config(max_groups=4))
    made = []

    def toolbox(box, task):
        made.append(1)
        if len(made) % 2:
            raise ZeroDivisionError("a bug in the toolbox factory")
        return FakeToolbox(box)

    collector.toolbox_factory = toolbox
    metrics = asyncio.run(_run(collector))
    episodes = [e for g in writer.groups for e in g.episodes]
    assert metrics.groups_total == 4 and len(episodes) == 8
    bugs = [e for e in episodes if not e.valid]
    assert len(bugs) == 4 and all("collector bug: ZeroDivisionError" in e.error for e in bugs)
    assert all(e.valid and e.reward == 1.0 for e in episodes if e not in bugs)


def test_the_daemon_hands_its_one_sampling_object_down(tiny_tokenizer, tmp_path):
    """Episodes, the gateway and every group's record take the limits the daemon read once
    from its settings: no class copies them field by field."""
    from sandpiper.store.records import GroupSampling

    config = _config(max_groups=1, max_turns=3, temperature=0.5)
    collector, _, writer, _ = _collector(tiny_tokenizer, tmp_path, config)
    assert collector.limits == config.for_collector().sampling
    assert collector._gateway().settings.sampling is collector.limits
    asyncio.run(_run(collector))
    (group,) = writer.groups
    assert group.sampling_params == GroupSampling.from_limits(collector.limits)
    assert group.sampling_params.max_turns == 3 and group.sampling_params.temperature == 0.5
