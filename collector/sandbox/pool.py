"""A warm pool of podman sandboxes: acquire one per episode, release it back.

- The pool holds at most ``config.pool_size`` containers in total and starts them ahead of
  demand (at most ``config.max_concurrent_starts`` starting at once); ``acquire`` waits for
  an idle one.
- ``release`` resets the sandbox in the background (every process but init killed, the
  workspace, /tmp and /dev/shm wiped, the shell state reset) and puts it back; a broken or
  dead sandbox, or one whose reset fails, is removed and replaced.
- Containers carry the labels given to the pool (e.g. ``sandpiper.run``, and from a
  collector ``sandpiper.collector=<registered id>`` and ``sandpiper.store``; otherwise
  ``sandpiper.collector=<hostname:pid>``) and ``sandpiper.pool=<id>``; the current episode and task of each container are
  kept in a small host-side registry file (podman labels are immutable), which
  ``sandpiper sandbox ls`` shows. ``sandpiper sandbox gc`` removes containers whose
  collector's store heartbeat lapsed (``collector.sandbox.janitor``).

Usage::

    pool = SandboxPool(config, labels={"sandpiper.run": run_id})
    await pool.start()
    async with pool.session(episode_id=e, task_id=t) as box:
        await box.exec("ls")
    await pool.close()

One pool serves one image (``config.image``); a task image built with
:func:`sandpiper.collector.sandbox.image_build.extend_image` gets its own pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Mapping

from sandpiper.collector.sandbox.client import PodmanSandbox
from sandpiper.collector.sandbox.containers import (  # noqa: F401 (REGISTRY_DIR, read_registry: API)
    REGISTRY_DIR,
    collector_id,
    read_registry,
    remove_containers,
    sweep_stale_host_state,
    write_registry,
)
from sandpiper.collector.sandbox.uids import UidSlots
from sandpiper.config import SandboxConfig
from sandpiper.errors import SandboxError

log = logging.getLogger(__name__)

START_RETRIES = 3


class SandboxPool:
    """Warm containers for episodes. Not thread-safe; use from one event loop."""

    def __init__(self, config: SandboxConfig, *, labels: Mapping[str, str]) -> None:
        self.config = config
        self.labels = {
            # a collector labels its pools with its registered id (what the janitor judges)
            "sandpiper.collector": collector_id(),
            **labels,
            "sandpiper.pool": uuid.uuid4().hex[:12],
        }
        self._idle: asyncio.Queue[PodmanSandbox | BaseException] = asyncio.Queue()
        self._total = 0
        self._starts = asyncio.Semaphore(config.max_concurrent_starts)
        self._tasks: set[asyncio.Task] = set()
        self._in_use: dict[str, PodmanSandbox] = {}
        self._recycling: set[PodmanSandbox] = set()
        """Released boxes whose reset or removal has not finished: in neither queue."""
        self._uids: UidSlots | None = None
        self._closed = False

    async def start(self) -> None:
        """Check the host enforces the limits (cached), then start warming containers."""
        from sandpiper.collector.sandbox.check import ensure_limits_enforced

        self._uids = UidSlots.for_host(self.config)
        await ensure_limits_enforced(self.config)
        await sweep_stale_host_state(self.config.host_state_dir)
        REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
        for _ in range(self.config.pool_size):
            self._spawn_start()

    def _spawn_start(self) -> None:
        self._total += 1
        self._background(self._start_one())

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start_one(self) -> None:
        error: BaseException | None = None
        for attempt in range(START_RETRIES):
            if self._closed:
                break
            try:
                async with self._starts:
                    box = await self._create()
                self._idle.put_nowait(box)
                return
            except SandboxError as e:
                error = e
                log.warning("sandbox start failed (attempt %d): %s", attempt + 1, e)
                await asyncio.sleep(0.5 * 2**attempt)
        self._total -= 1
        self._idle.put_nowait(error or SandboxError("the pool is closed"))

    async def _create(self) -> PodmanSandbox:
        assert self._uids is not None, "call start() first"
        slot = self._uids.acquire()
        try:
            box = await PodmanSandbox.create(
                self.config, labels=self.labels, uid_base=self._uids.base(slot)
            )
        except BaseException:
            self._uids.release(slot)
            raise
        box.uid_slot = slot
        return box

    async def acquire(self, *, episode_id: str, task_id: str) -> PodmanSandbox:
        """A clean, started sandbox for one episode (waits while all are in use)."""
        if self._closed:
            raise SandboxError("the sandbox pool is closed")
        if self._idle.empty() and self._total < self.config.pool_size:
            self._spawn_start()
        item = await self._idle.get()
        if isinstance(item, BaseException):
            raise SandboxError(f"could not start a sandbox: {item}") from item
        self._in_use[item.id] = item
        write_registry(item.id, episode_id=episode_id, task_id=task_id)
        return item

    async def release(self, sandbox: PodmanSandbox, *, broken: bool = False) -> None:
        """Give a sandbox back: reset and reuse it, or replace it when broken or dead."""
        self._in_use.pop(sandbox.id, None)
        write_registry(sandbox.id, episode_id=None, task_id=None)
        self._recycling.add(sandbox)
        self._background(self._recycle(sandbox, broken=broken))

    async def _recycle(self, box: PodmanSandbox, *, broken: bool) -> None:
        if not broken and box.alive and not self._closed:
            try:
                await box.reset()
                if box.alive:
                    self._recycling.discard(box)
                    self._idle.put_nowait(box)
                    return
            except (SandboxError, OSError) as e:  # OSError: the reset op itself failed
                log.warning("reset of %s failed, replacing it: %s", box.id, e)
            except Exception:  # a bug: replace the box rather than lose a pool slot
                log.exception("reset of %s raised; replacing it", box.id)
        await self._discard(box)
        self._recycling.discard(box)
        self._total -= 1
        if not self._closed:
            self._spawn_start()

    async def _discard(self, box: PodmanSandbox) -> None:
        await box.close()  # its registry entry goes with the container
        if self._uids is not None and box.uid_slot is not None:
            self._uids.release(box.uid_slot)

    @contextlib.asynccontextmanager
    async def session(self, *, episode_id: str, task_id: str) -> AsyncIterator[PodmanSandbox]:
        """``acquire`` … ``release``; an exception inside marks the sandbox broken."""
        box = await self.acquire(episode_id=episode_id, task_id=task_id)
        try:
            yield box
        except BaseException:
            await self.release(box, broken=True)
            raise
        await self.release(box, broken=not box.alive)

    @property
    def idle_count(self) -> int:
        return self._idle.qsize()

    async def wait_warm(self, timeout_s: float = 120.0) -> None:
        """Wait until ``pool_size`` containers are idle (tests and benchmarks)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._idle.qsize() < self.config.pool_size:
            if asyncio.get_running_loop().time() > deadline:
                raise SandboxError(f"only {self._idle.qsize()} sandboxes warm after {timeout_s} s")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Remove every container of this pool (idle, in use and starting)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # a box whose recycling was cancelled (before or during its reset) is in neither
        # queue: close it too, or its shell's client and pipes outlive the event loop
        boxes = [*self._in_use.values(), *self._recycling]
        self._recycling.clear()
        while not self._idle.empty():
            item = self._idle.get_nowait()
            if isinstance(item, PodmanSandbox):
                boxes.append(item)
        self._in_use.clear()
        await asyncio.gather(*(self._discard(b) for b in boxes), return_exceptions=True)
        # a start or a reset cancelled mid-way may have left a container: remove by this
        # pool's label, and what the host kept for it
        await remove_containers(
            {"sandpiper.pool": self.labels["sandpiper.pool"]}, state_dir=self.config.host_state_dir
        )
