"""The collector daemon: GRPO groups of episodes, backpressure, hot reload, drain on stop.

:class:`Collector` owns no infrastructure; it is handed a policy client, a chat renderer,
the store, its writer, a sandbox pool and a toolbox factory (``collector.daemon.launch`` builds the
real ones from a config; unit tests pass fakes). ``await Collector(...).run(stop)`` runs
until ``stop`` is set (or ``max_groups`` train groups are written):

- **Groups from store slots.** The store decides what to collect: each group fills one task
  slot that the store issued to this collector (``store.slots.claim``: least-sampled task
  first, ties in a fixed hashed order, slots freed by a dead or stopped collector first), and
  its id is the slot's ``{run_id}/{task_id}/{seq}``, so N collectors on one run never collide
  nor leave gaps (``docs/scaleout.md``). The collector heartbeats its registration every
  ``heartbeat_s``; on stop it frees the slots of cancelled groups (``store.slots.stop``). A
  SIGKILLed collector's slots are re-issued once its heartbeat lapses, or at once when a
  collector restarts on its spool (it commits the spooled groups, then retires it).
- **Counting.** A group counts as done (``metrics.groups_total``) only when the writer
  reports it newly stored; a group the store refuses (a duplicate id, a superseded slot)
  is logged as an error and counted in ``metrics.groups_rejected``.
- **Bounded concurrency.** Episodes (``max_concurrent_episodes``), sandboxes (the pool's
  size; ``acquire`` waits), tokens in flight (``max_tokens_in_flight``), and groups in
  flight (enough to keep every episode slot busy, no more).
- **Backpressure.** A train group starts only while the groups written or in flight but not
  consumed by the learner number fewer than ``max_unconsumed_groups`` (default
  ``learner.groups_per_step * (learner.max_lag + 1)``): with the learner consuming
  ``groups_per_step`` groups per version, no group starts more than ``max_lag`` versions
  ahead of what the learner has consumed.
- **Hot reload.** Every ``policy_poll_s`` the store's latest policy is compared with the
  served version; a newer one is reloaded in place (``client.reload``) while episodes
  continue (their later tokens carry the new version).
- **Validation.** Every ``validation_every_versions`` new versions, one group of
  ``validation_group_size`` samples per validation task, stored with ``split=validation``
  (the learner never trains on them).
- **Stop.** Setting ``stop`` (SIGTERM/SIGINT in the CLI) stops new groups; from then on the
  collector keeps to ``drain_timeout_s`` whatever the store does. Running groups may finish
  for the first :data:`GROUPS_SHARE` of it; the rest are cancelled (their ids are re-run
  after a restart). The final commit and the release of unfinished task slots get what is
  left: a store that is down, locked by another process or hung cannot hold the stop past
  the deadline. What is not committed by then stays in the spool (acknowledged, durable),
  said in one log line, and the next collector started on that spool commits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandpiper.collector.daemon.shutdown import final_commit, flush_until_stopped, unless_stopped
from sandpiper.collector.daemon.status import CollectorMetrics
from sandpiper.collector.daemon.store_role import CollectorStore
from sandpiper.collector.episode.loop import ToolboxFactory, run_pooled_episode
from sandpiper.collector.episode.policy import TokenPolicy
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.gateway.external import agent_command, run_external_episode
from sandpiper.collector.gateway.server import Gateway, GatewaySettings
from sandpiper.collector.inference.base import Generation, PolicyClient, SamplingParams
from sandpiper.collector.sandbox.base import SandboxSource
from sandpiper.collector.tasks.model import Task
from sandpiper.config import CollectorSettings
from sandpiper.errors import SandpiperError, StoreError, TaskError
from sandpiper.store.records import (
    EpisodeRecord,
    GroupRecord,
    GroupSampling,
    GroupStatus,
    PolicyRecord,
    SlotLease,
    Split,
    WriteOutcome,
)
from sandpiper.store.slots import task_rank

if TYPE_CHECKING:
    from sandpiper.store.writer import GroupSink

log = logging.getLogger(__name__)

GROUPS_SHARE = 0.75
"""Share of ``drain_timeout_s`` that running groups get to finish after a stop; the final
commit and the slot release get the rest."""


class TokenBudgetClient:
    """Wraps a PolicyClient so that prompt + max new tokens in flight stay under a bound."""

    def __init__(self, inner: PolicyClient, max_tokens_in_flight: int) -> None:
        self.inner = inner
        self.limit = max_tokens_in_flight
        self.in_flight_tokens = 0
        self._cond = asyncio.Condition()

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def reload(self, checkpoint_dir: str, version: int) -> None:
        await self.inner.reload(checkpoint_dir, version)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        need = min(len(prompt_ids) + params.max_tokens, self.limit)
        async with self._cond:
            await self._cond.wait_for(lambda: self.in_flight_tokens + need <= self.limit)
            self.in_flight_tokens += need
        try:
            return await self.inner.generate(prompt_ids, params)
        finally:
            async with self._cond:
                self.in_flight_tokens -= need
                self._cond.notify_all()


class Collector:
    """See the module docstring."""

    def __init__(
        self,
        config: CollectorSettings,
        *,
        client: PolicyClient,
        renderer: ChatRenderer,
        store: CollectorStore,
        writer: GroupSink,
        pool: SandboxSource,
        toolbox_factory: ToolboxFactory,
        tasks: list[Task],
        collector_id: str,
        report: Callable[[dict[str, Any]], None] | None = None,
        gateway: Gateway | None = None,
    ) -> None:
        cc = config.collector
        self.config, self.cc = config, cc
        self.run_id = config.name
        if cc.max_tokens_in_flight > 0:
            client = TokenBudgetClient(client, cc.max_tokens_in_flight)
        self.client, self.renderer = client, renderer
        self.store, self.writer, self.pool = store, writer, pool
        self.toolbox_factory, self.report = toolbox_factory, report
        self.gateway = gateway
        """Serves external-agent tasks (started by :meth:`run` when a task names an agent)."""
        self.collector_id = collector_id
        self.train_tasks = [t for t in tasks if t.split is Split.TRAIN]
        self.validation_tasks = [t for t in tasks if t.split is Split.VALIDATION]
        self._by_id = {t.task_id: t for t in tasks}
        self._ranked = {
            split: [
                (t.task_id, task_rank(t.task_id, config.seed)) for t in tasks if t.split is split
            ]
            for split in Split
        }
        self._leases: list[SlotLease] = []
        """Train slots issued to this collector and not started yet."""
        self._stop = asyncio.Event()
        """Set by a stop (the event :meth:`run` was given): store waits end at once."""
        writer.on_outcome = self._on_outcome
        self._loop: asyncio.AbstractEventLoop | None = None
        self.limits = config.sampling
        """The run's sampling, read once: every episode, the gateway and the groups' record."""
        self._group_sampling = GroupSampling.from_limits(self.limits)
        self.max_unconsumed = (
            cc.max_unconsumed_groups
            if cc.max_unconsumed_groups is not None
            else config.groups_per_step * (config.max_lag + 1)
        )
        self.max_groups_in_flight = math.ceil(cc.max_concurrent_episodes / cc.group_size) + 1
        self.metrics = CollectorMetrics(policy_version=client.policy_version)
        self._episode_slots = asyncio.Semaphore(cc.max_concurrent_episodes)
        self._groups: dict[str, tuple[asyncio.Task, Split]] = {}
        self._wake = asyncio.Event()
        self._train_groups_started = 0
        self._store_unconsumed = 0
        self._put_since_poll = 0
        self._failure: BaseException | None = None
        """The first unexpected exception of a group task (re-raised by the scheduler)."""
        self._validated_version: int | None = None
        self._validation_rewards: list[float] = []
        self._validation_left = 0

    # ---- the main loop ------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> CollectorMetrics:
        if not self.train_tasks:
            raise SandpiperError(
                "no train tasks to collect (all tasks are in the validation split)"
            )
        self._loop = asyncio.get_running_loop()
        self._stop = stop
        started, _ = await unless_stopped(self._start_up(stop), stop)
        if not started:
            log.info("stopped before collecting (the store did not answer in time)")
            return self.metrics
        if self.gateway is None and any(agent_command(t) for t in self.train_tasks):
            self.gateway = self._gateway()
        if self.gateway is not None and not self.gateway.url:
            await self.gateway.serve(port=self.cc.gateway_port)
        background = [
            asyncio.create_task(self._every(self.cc.policy_poll_s, self._poll_store)),
            asyncio.create_task(self._every(self.cc.status_interval_s, self._report)),
            asyncio.create_task(self._every(self.cc.heartbeat_s, self._heartbeat)),
        ]
        deadline = None
        try:
            await self._schedule(stop)
            drain_s = self.cc.drain_timeout_s
            if stop.is_set():  # a stop signal: everything by the deadline
                deadline = time.monotonic() + drain_s
                await self._drain(GROUPS_SHARE * drain_s)
            else:  # max_groups reached: the groups may take it all, the commit as long again
                await self._drain(drain_s)
                deadline = time.monotonic() + drain_s
        finally:
            if deadline is None:  # a failure: the same bounded stop
                deadline = time.monotonic() + self.cc.drain_timeout_s
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if self.gateway is not None:
                await self.gateway.aclose()
            try:
                await final_commit(self.writer, self.store, self.collector_id, deadline)
            finally:
                self._refresh_metrics()
                await self._report()
        return self.metrics

    async def _start_up(self, stop: asyncio.Event) -> None:
        await self._heartbeat()
        # commit what a crashed predecessor on this spool acknowledged, under its slot leases
        if not await flush_until_stopped(self.writer, stop):
            return
        await asyncio.to_thread(self._retire_predecessor)
        await self._poll_store()

    async def _schedule(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and not self._reached_max_groups():
            if self._failure is not None:
                raise self._failure
            await self._maybe_validate()
            room = self._room_for_train_groups()
            if room > 0:
                if not self._leases:
                    self._leases = await self._claim(room, Split.TRAIN)
                    if not self._leases:  # stopped while the store was slow to answer
                        continue
                lease = self._leases.pop(0)
                self._launch(lease, Split.TRAIN, self.cc.group_size)
                self._train_groups_started += 1
                continue
            await self._wait(stop, self.cc.policy_poll_s)

    def _reached_max_groups(self) -> bool:
        return 0 < self.cc.max_groups <= self._train_groups_started

    async def _wait(self, stop: asyncio.Event, timeout_s: float) -> None:
        self._wake.clear()
        waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(self._wake.wait())]
        try:
            await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    def unconsumed_groups(self) -> int:
        in_flight = sum(1 for _, split in self._groups.values() if split is Split.TRAIN)
        return self._store_unconsumed + self._put_since_poll + in_flight

    def _room_for_train_groups(self) -> int:
        """How many train groups may start now (in-flight bound, backpressure, max_groups)."""
        train_in_flight = sum(1 for _, split in self._groups.values() if split is Split.TRAIN)
        room = min(
            self.max_groups_in_flight - train_in_flight,
            self.max_unconsumed - self.unconsumed_groups(),
        )
        if self.cc.max_groups > 0:
            room = min(room, self.cc.max_groups - self._train_groups_started)
        return room

    async def _claim(self, n: int, split: Split, only: list[str] | None = None) -> list[SlotLease]:
        """Slots from the store, as many as may start now (so none sits leased but idle).

        A failed claim (the store restarting, a deadlock victim on PostgreSQL, a DuckDB lock
        timeout) is retried with backoff; a claim never half-succeeds (one transaction). A stop
        ends the wait at once with no slots (the call is abandoned: slots it may still lease
        are freed when the collector stops, or when its heartbeat lapses)."""
        for attempt, wait_s in enumerate((0.5, 1.0, 2.0, 5.0, 10.0, None)):
            try:
                done, leases = await unless_stopped(self._claim_once(n, split, only), self._stop)
                return leases if done and leases is not None else []
            except Exception as e:
                if wait_s is None or isinstance(e, TaskError):
                    raise
                log.warning("slot claim failed (attempt %d): %s; retrying", attempt + 1, e)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), wait_s)
        raise AssertionError("unreachable")

    async def _claim_once(self, n: int, split: Split, only: list[str] | None) -> list[SlotLease]:
        return await asyncio.to_thread(
            self.store.slots.claim,
            run_id=self.run_id,
            collector_id=self.collector_id,
            tasks=self._ranked[split],
            ttl_s=self.cc.heartbeat_ttl_s,
            n=n,
            split=split,
            only=only,
        )

    def _retire_predecessor(self) -> None:
        spool = self.writer.spool
        if spool is not None:
            retire_predecessor(self.store, Path(spool), self.collector_id)

    async def _heartbeat(self, policy_version: int | None = None) -> None:
        """Renew our registration; with ``policy_version``, name the version we are about to
        load (before loading it, so that checkpoint retention keeps that folder)."""
        if not await asyncio.to_thread(
            self.store.slots.heartbeat, self.collector_id, policy_version=policy_version
        ):
            # our slots were freed for others: every group we still finish would be refused
            self._failure = self._failure or StoreError(
                f"the store holds collector {self.collector_id} as stopped (retired by "
                "another process?); stopping so that its slots are not collected twice"
            )
            self._wake.set()

    def _on_outcome(self, group: GroupRecord, outcome: WriteOutcome) -> None:
        """Writer thread: a group was committed (or refused); count it on the event loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._count, group, outcome)
                return
            except RuntimeError:  # the loop closed in between
                pass
        self._count(group, outcome)

    def _count(self, group: GroupRecord, outcome: WriteOutcome) -> None:
        if outcome is WriteOutcome.STORED:
            self.metrics.add_group(group)
        elif outcome is WriteOutcome.DEAD:  # the writer logged why; the others go on
            self.metrics.groups_dead += 1
        elif outcome is not WriteOutcome.REPLAYED:
            self.metrics.groups_rejected += 1
            log.error("group %s was refused by the store (%s)", group.group_id, outcome)

    async def _drain(self, wait_s: float) -> None:
        """Let running groups finish for up to ``wait_s``, then cancel the rest."""
        tasks = [t for t, _ in self._groups.values()]
        if not tasks:
            return
        log.info("draining %d groups (up to %.0f s)", len(tasks), wait_s)
        _, pending = await asyncio.wait(tasks, timeout=wait_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _every(self, interval_s: float, fn: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await fn()
            except Exception as e:  # a failed poll must not stop collection
                log.warning("%s failed: %s", getattr(fn, "__name__", fn), e)

    # ---- groups and episodes ------------------------------------------------------------

    def _launch(self, lease: SlotLease, split: Split, size: int) -> None:
        task = self._by_id[lease.task_id]
        runner = asyncio.create_task(self._group(task, split, size, lease))
        self._groups[lease.group_id] = (runner, split)

        def finished(done: asyncio.Task) -> None:
            self._groups.pop(lease.group_id, None)
            if not done.cancelled() and done.exception() is not None and self._failure is None:
                # not a data failure (those become episode records): a bug or a broken store;
                # the scheduler re-raises it; the slot is freed when the collector stops
                self._failure = done.exception()
            self._wake.set()

        runner.add_done_callback(finished)

    async def _group(self, task: Task, split: Split, size: int, lease: SlotLease) -> None:
        try:
            episodes = await asyncio.gather(*(self._episode(task, i) for i in range(size)))
            group = GroupRecord(
                group_id=lease.group_id,
                run_id=self.run_id,
                task_id=task.task_id,
                split=split,
                sampling_params=self._group_sampling,
                episodes=tuple(episodes),
                collector_id=self.collector_id,
                slot_lease=lease.lease,
            )
            try:
                await asyncio.to_thread(self.writer.put, group)  # acknowledged: in the spool
            except StoreError as e:  # a group the store cannot take (a collector bug): logged
                log.error("group %s NOT stored: %s", group.group_id, e)  # and counted, no crash
                self.metrics.groups_rejected += 1
                if split is Split.VALIDATION:
                    self._validation_left -= 1
                return
        except BaseException:
            if split is Split.VALIDATION:
                self._validation_left -= 1
            raise
        if split is Split.TRAIN:
            self._put_since_poll += 1
        else:
            self._record_validation(group)

    async def _episode(self, task: Task, index: int) -> EpisodeRecord:
        async with self._episode_slots:
            self.metrics.episodes_in_flight += 1
            try:
                return await self._episode_in_sandbox(task, index)
            finally:
                self.metrics.episodes_in_flight -= 1

    def _gateway(self) -> Gateway:
        """The gateway external-agent tasks talk to: this collector's client, renderer and
        sampling, so its episodes are sampled exactly like native ones."""
        settings = GatewaySettings.for_run(self.limits, run_id=self.run_id)
        return Gateway(client=self.client, renderer=self.renderer, settings=settings)

    async def _episode_in_sandbox(self, task: Task, index: int) -> EpisodeRecord:
        run = None
        if agent_command(task) is not None and self.gateway is not None:
            run = functools.partial(run_external_episode, gateway=self.gateway)
        return await run_pooled_episode(
            self.pool,
            episode_id=uuid.uuid4().hex,
            sample_index=index,
            task=task,
            policy=TokenPolicy(self.client, self.renderer),
            make_toolbox=self.toolbox_factory,
            limits=self.limits,
            run=run,
        )

    # ---- store polling, hot reload, validation ----------------------------------------------

    async def _poll_store(self) -> None:
        counts, latest = await asyncio.to_thread(self._read_store)
        self._store_unconsumed = counts[GroupStatus.READY] + counts[GroupStatus.CLAIMED]
        self._store_unconsumed += counts[GroupStatus.COLLECTING] + self.writer.pending()
        self._put_since_poll = 0
        if latest is not None and latest.version > self.client.policy_version:
            # announce first, so that checkpoint retention keeps the folder while we read it
            await self._heartbeat(policy_version=latest.version)
            log.info("hot-loading policy v%d from %s", latest.version, latest.checkpoint_uri)
            await self.client.reload(latest.checkpoint_uri, latest.version)
            self.metrics.reloads += 1
        self._refresh_metrics()
        self._wake.set()

    def _read_store(self) -> tuple[dict[GroupStatus, int], PolicyRecord | None]:
        return (
            self.store.claims.group_counts(self.run_id),
            self.store.policy_versions.latest(self.run_id),
        )

    def _refresh_metrics(self) -> None:
        self.metrics.policy_version = self.client.policy_version
        self.metrics.unconsumed_groups = self.unconsumed_groups()

    async def _maybe_validate(self) -> None:
        every = self.cc.validation_every_versions
        if every <= 0 or not self.validation_tasks or self._validation_left:
            return
        version = self.client.policy_version
        if self._validated_version is not None and version < self._validated_version + every:
            return
        self._validated_version = version
        self._validation_rewards, self._validation_left = [], len(self.validation_tasks)
        for task in self.validation_tasks:
            leases = await self._claim(1, Split.VALIDATION, only=[task.task_id])
            if not leases:  # stopped
                self._validation_left = 0
                return
            (lease,) = leases
            self._launch(lease, Split.VALIDATION, self.cc.validation_group_size)

    def _record_validation(self, group: GroupRecord) -> None:
        self._validation_rewards += [e.reward for e in group.episodes if e.reward is not None]
        self._validation_left -= 1
        if self._validation_left == 0 and self._validation_rewards:
            rewards = self._validation_rewards
            self.metrics.validation_reward_mean = sum(rewards) / len(rewards)
            self.metrics.validation_version = self._validated_version

    async def _report(self) -> None:
        self._refresh_metrics()
        snap = {**self.metrics.snapshot(), "collector_id": self.collector_id}
        if self.report is not None:
            self.report(snap)


def retire_predecessor(store: CollectorStore, spool: Path, collector_id: str) -> int:
    """Free at once the slots of the collector that used ``spool`` before this one.

    Call it while holding the spool's writer, after committing what the spool held: the
    lock proves that collector's writer is gone (killed or stopped); the slots it still
    leased were in flight and died with it — free them now instead of after the heartbeat
    TTL, and mark it stopped so ``sandbox gc`` removes its containers at once.
    ``<spool>/collector.id`` names the spool's current owner. Returns the slots freed."""
    owner = spool / "collector.id"
    previous = owner.read_text().strip() if owner.exists() else ""
    tmp = owner.with_suffix(".tmp")
    tmp.write_text(collector_id)
    tmp.replace(owner)
    if not previous or previous == collector_id:
        return 0
    freed = store.slots.stop(previous)
    log.info("retired %s (this spool's previous collector): %d slots freed", previous, freed)
    return freed
