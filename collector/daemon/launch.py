"""Wiring: build the collector's real parts from its settings (:class:`CollectorSettings`) and run it.

``await collect(config, stop=event)`` does, in order:

1. load the tasks (and their split), register the run and tasks in the store, and register
   this process as a collector (a unique id; ``docs/scaleout.md``);
2. open the store writer on this host's spool (``<spool base>/<host id>``), commit what a
   crashed predecessor left there and what dead collectors left in the other spools of that
   base, retire the predecessor (its slots are re-issued at once), then remove containers
   of collectors that are gone (``janitor.gc``: by the store's heartbeats);
3. start the local vLLM servers (unless ``inference.server_urls`` is given) and a supervisor
   that restarts a dead one, and a :class:`VLLMPolicyClient` over them;
4. start the sandbox pool (containers labelled with this collector's and the store's id);
5. run :class:`sandpiper.collector.daemon.core.Collector` until ``stop`` is set, then close everything.

A stop keeps to ``collector.drain_timeout_s`` whatever the store does
(:mod:`sandpiper.collector.daemon.shutdown`); the sandboxes and local servers are closed after it.
Every local server runs under a lifeline (:mod:`sandpiper.collector.inference.lifeline`): a collector
killed with SIGKILL leaves no server behind.

Heavy imports (transformers, vLLM client, podman pool, store backends) happen inside.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from sandpiper.collector.daemon.shutdown import (
    close_writer,
    flush_until_stopped,
    run_process,
    unless_stopped,
)
from sandpiper.collector.daemon.status import CollectorMetrics
from sandpiper.collector.daemon.store_role import CollectorHostStore, CollectorStore
from sandpiper.collector.run_setup import open_store, served_model, start_run_servers
from sandpiper.config import CollectorSettings
from sandpiper.errors import ConfigError
from sandpiper.store.slots import default_host

log = logging.getLogger(__name__)


class _RecordingClient:
    """Forwards to the policy client and records reloads on the local servers, so that a
    server restarted by its supervisor comes back with the current weights."""

    def __init__(self, inner: Any, servers: list[Any]) -> None:
        self.inner, self.servers = inner, servers

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def generate(self, prompt_ids, params):
        return await self.inner.generate(prompt_ids, params)

    async def reload(self, checkpoint_dir: str, version: int) -> None:
        await self.inner.reload(checkpoint_dir, version)
        for server in self.servers:
            server.record_weights(checkpoint_dir, version)


async def collect(
    config: CollectorSettings,
    *,
    stop: asyncio.Event,
    live_status: bool | None = None,
    client: Any | None = None,
) -> CollectorMetrics:
    """Run the collector of ``config`` until ``stop`` is set (see the module docstring).

    ``client`` replaces the vLLM servers with another :class:`PolicyClient` that also has
    ``async reload(checkpoint_dir, version)`` (the demo's scripted demonstrator uses it);
    everything else — sandboxes, tools, rewards, the store — is the real thing."""
    from transformers import AutoTokenizer

    from sandpiper.collector.daemon.core import Collector, retire_predecessor
    from sandpiper.collector.daemon.status import StatusReporter
    from sandpiper.collector.episode.loop import default_toolbox_factory
    from sandpiper.collector.episode.render import renderer_for
    from sandpiper.collector.inference.vllm_client import VLLMPolicyClient
    from sandpiper.collector.sandbox import janitor
    from sandpiper.collector.sandbox.images import ImagePools
    from sandpiper.collector.tasks.loading import load_tasks

    cc, run_dir = config.collector, config.run_dir
    tasks = load_tasks(
        cc.tasks, validation_fraction=cc.validation_fraction, split_seed=cc.split_seed,
        reward_function=cc.reward_function,
    )  # fmt: skip
    store: CollectorHostStore = await asyncio.to_thread(open_store, config)
    await asyncio.to_thread(check_checkpoints_readable, store, config.name)
    await asyncio.to_thread(store.upsert_tasks, [t.to_record() for t in tasks])
    host = cc.host_id or default_host()
    collector_id = await asyncio.to_thread(store.slots.register, run_id=config.name, host=host)
    log.info("registered as collector %s", collector_id)
    # keep the registration live through the start-up (servers may take minutes); the
    # daemon heartbeats itself once it runs
    startup_beat = asyncio.create_task(_beat(store, collector_id, cc.heartbeat_s))
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    renderer = renderer_for(tokenizer, config)
    reporter = StatusReporter(
        cc.metrics_file or run_dir / "collector_metrics.jsonl", live=live_status
    )

    async with contextlib.AsyncExitStack() as stack:
        stack.callback(reporter.close)
        stack.callback(startup_beat.cancel)
        writer = store.writer(
            flush_interval_s=config.store.flush_interval_s,
            flush_max_episodes=config.store.flush_max_episodes,
            spool_dir=str(Path(config.store.spool_dir or store.default_spool_dir()) / host),
        )
        stack.callback(close_writer, writer)  # never waits on a store that is down
        # commit what a killed predecessor on this spool (and dead ones on sibling spools)
        # acknowledged, retire the predecessor, and only then judge containers: its
        # sandboxes go at once instead of after the heartbeat TTL
        if not await flush_until_stopped(writer, stop):
            return CollectorMetrics()
        await asyncio.to_thread(adopt_orphan_spools, store, writer.spool)
        await asyncio.to_thread(retire_predecessor, store, writer.spool, collector_id)
        removed = await janitor.gc(
            store, ttl_s=cc.heartbeat_ttl_s, state_dir=config.sandbox.host_state_dir
        )
        if removed:
            log.info("removed %d containers left by dead collectors", len(removed))
        servers: list = []
        if client is not None:
            inner = client
        else:
            started, local = await unless_stopped(start_run_servers(config, stack), stop)
            if not started or local is None:
                log.info("stopped while the inference servers started")
                return CollectorMetrics()
            servers = local
            urls = config.inference.server_urls or [s.url for s in servers]
            inner = VLLMPolicyClient(
                urls,
                request_timeout_s=config.inference.request_timeout_s,
                max_retries=config.inference.max_retries,
            )
            stack.push_async_callback(inner.aclose)
            if config.inference.server_urls:
                # External servers may hold other weights (another run, an older version):
                # load this run's latest policy (version 0 = learner.model) before sampling.
                latest = await asyncio.to_thread(store.policy_versions.latest, config.name)
                weights = latest.checkpoint_uri if latest else served_model(config.model)
                version = latest.version if latest else 0
                # announced first: checkpoint retention keeps what a collector is loading
                await asyncio.to_thread(store.slots.heartbeat, collector_id, policy_version=version)
                await inner.reload(weights, version)
        labels = {
            "sandpiper.run": config.name,
            janitor.COLLECTOR_LABEL: collector_id,
            janitor.STORE_LABEL: await asyncio.to_thread(store.store_id),
        }
        pool = ImagePools(config.sandbox, labels=labels)
        stack.push_async_callback(pool.close)
        if not (await unless_stopped(pool.start(), stop))[0]:
            log.info("stopped while the sandbox pool started")
            return CollectorMetrics()
        collector = Collector(
            config,
            client=_RecordingClient(inner, servers),
            renderer=renderer,
            store=store,
            writer=writer,
            pool=pool,
            toolbox_factory=default_toolbox_factory(
                exec_timeout_s=config.sandbox.exec_timeout_s, test_timeout_s=cc.test_timeout_s
            ),
            tasks=tasks,
            collector_id=collector_id,
            report=reporter.report,
        )
        startup_beat.cancel()
        return await collector.run(stop)


def run_collector_process(config: CollectorSettings) -> CollectorMetrics:
    """``sandpiper collect``: run the collector in this process until SIGTERM or SIGINT.
    Returns its metrics once stopped; store calls still blocked then are not waited for
    (call :func:`sandpiper.collector.daemon.shutdown.exit_now_if_stuck` after reporting)."""

    async def main(stop: asyncio.Event) -> CollectorMetrics:
        return await collect(config, stop=stop)

    return run_process(main)


def check_checkpoints_readable(store: CollectorStore, run_id: str) -> None:
    """Refuse to start when this host cannot read the folder the latest policy names."""
    latest = store.policy_versions.latest(run_id)
    if latest is None:
        return
    folder = Path(latest.checkpoint_uri)
    if not (folder.is_dir() and os.access(folder, os.R_OK | os.X_OK)):
        raise ConfigError(
            f"policy version {latest.version} of run {run_id} is the folder {folder}, which "
            "this host cannot read. The learner writes every version under "
            "learner.checkpoint_dir and the collector (and its vLLM servers) load them by "
            "that path: put learner.checkpoint_dir on a shared filesystem (NFS or similar) "
            "that every learner, collector and server host mounts at the same path."
        )


async def _beat(store: CollectorStore, collector_id: str, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.to_thread(store.slots.heartbeat, collector_id)
        except Exception as e:  # a store hiccup: the next beat retries
            log.warning("heartbeat failed: %s", e)


def adopt_orphan_spools(store: CollectorHostStore, own: Path) -> int:
    """Commit the groups left in sibling spools of ``own`` that no live writer holds.

    A compose replica that is replaced comes back under another host name, so its old spool
    would otherwise wait forever; the groups keep their producer's slot lease, so a group
    whose slot was re-issued meanwhile is refused (superseded), never stored twice. Also
    drains a spool of the old single-folder layout (``*.group`` files in the base itself).
    Returns how many groups were newly stored."""
    from sandpiper.errors import StoreError

    base = own.parent
    stored = 0
    for spool in [base, *sorted(p for p in base.iterdir() if p.is_dir())]:
        if spool == own or not any(spool.glob("*.group")):
            continue
        try:
            orphan = store.writer(spool_dir=str(spool), flush_interval_s=0.1)
        except StoreError:
            continue  # a live collector owns it
        with orphan:
            orphan.flush()
        stored += orphan.committed_groups
        log.info(
            "committed %d groups left in %s (%d already stored, %d refused)",
            orphan.committed_groups, spool, orphan.replayed_groups, orphan.rejected_groups,
        )  # fmt: skip
    return stored
