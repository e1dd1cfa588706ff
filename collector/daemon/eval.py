"""Evaluation mode: agents served by any OpenAI-compatible chat endpoint (no token ids).

``sandpiper collect --eval --endpoint URL --model NAME`` runs every task once as a group of
``collector.validation_group_size`` samples. Each episode goes through the training episode
code (:func:`sandpiper.collector.episode.loop.run_pooled_episode`) with a text-mode
:class:`sandpiper.collector.episode.chat_policy.ChatPolicy` instead of the token-in/token-out policy: the same
prompt, offered tools, answer file, error handling and rewards. Episodes are stored with
``trainable=False`` (no token ids, no logprobs) and ``split=validation``, so no learner ever
trains on them. A broken task or a missing image is one invalid episode, never an abort.
"""

from __future__ import annotations

import asyncio
import uuid

from sandpiper.collector.daemon.store_role import CollectorHostStore
from sandpiper.collector.episode.chat_policy import ChatEndpoint, ChatPolicy
from sandpiper.collector.tasks.model import Task
from sandpiper.config import CollectorSettings
from sandpiper.store.records import EpisodeRecord

__all__ = ["ChatEndpoint", "evaluate"]


async def evaluate(
    config: CollectorSettings, *, endpoint_url: str, model: str, api_key: str | None
) -> int:
    """Run every task once (see the module docstring); returns the number of groups stored."""
    from sandpiper.collector.daemon.journal import SeqJournal
    from sandpiper.collector.episode.loop import default_toolbox_factory, run_pooled_episode
    from sandpiper.collector.episode.tools import offered_schemas
    from sandpiper.collector.run_setup import open_store
    from sandpiper.collector.sandbox.containers import STORE_LABEL
    from sandpiper.collector.sandbox.images import ImagePools
    from sandpiper.collector.tasks.loading import load_tasks
    from sandpiper.store.records import GroupRecord, GroupSampling, Split

    cc, limits = config.collector, config.sampling
    tasks = load_tasks(
        cc.tasks, validation_fraction=cc.validation_fraction, split_seed=cc.split_seed,
        reward_function=cc.reward_function,
    )  # fmt: skip
    store: CollectorHostStore = await asyncio.to_thread(open_store, config)
    await asyncio.to_thread(store.upsert_tasks, [t.to_record() for t in tasks])
    journal = SeqJournal(config.run_dir / "collector_journal.json")
    make_toolbox = default_toolbox_factory(
        exec_timeout_s=config.sandbox.exec_timeout_s, test_timeout_s=cc.test_timeout_s
    )
    chat = ChatEndpoint(endpoint_url, model, api_key=api_key)
    policy = ChatPolicy(chat, offered_schemas(cc.tools, cc.tool_descriptions))
    # the store's id, as a collector's pools have it: `sandpiper sandbox gc` on this store
    # judges what a killed evaluation left
    store_id = await asyncio.to_thread(store.store_id)
    pool = ImagePools(config.sandbox, labels={"sandpiper.run": config.name, STORE_LABEL: store_id})
    await pool.start()
    slots = asyncio.Semaphore(cc.max_concurrent_episodes)
    writer = store.writer(spool_dir=config.store.spool_dir)

    async def episode(task: Task, index: int) -> EpisodeRecord:
        async with slots:
            return await run_pooled_episode(
                pool, episode_id=uuid.uuid4().hex, sample_index=index, task=task,
                policy=policy, make_toolbox=make_toolbox, limits=limits,
            )  # fmt: skip

    async def group(task: Task) -> None:
        _, group_id = journal.start(task.task_id, lambda s: f"{config.name}/{task.task_id}/{s}")
        episodes = await asyncio.gather(
            *(episode(task, i) for i in range(cc.validation_group_size))
        )
        record = GroupRecord(
            group_id=group_id, run_id=config.name, task_id=task.task_id, split=Split.VALIDATION,
            sampling_params=GroupSampling(temperature=limits.temperature, top_p=limits.top_p, endpoint=endpoint_url, model=model),
            episodes=tuple(episodes),
        )  # fmt: skip
        await asyncio.to_thread(writer.put, record)
        journal.done(group_id)

    try:
        await asyncio.gather(*(group(t) for t in tasks))
    finally:
        await asyncio.to_thread(writer.close)
        await pool.close()
        await chat.aclose()
    return len(tasks)
