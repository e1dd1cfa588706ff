"""One warm pool per sandbox image: tasks that bring their own image get their own pool.

The collector's default image (``sandbox.image``) has a pool of ``sandbox.pool_size``
containers started up front. A task whose folder names an image (``task.toml``:
``image = "localhost/my-task:1"``, built for example with
:func:`sandpiper.collector.sandbox.image_build.extend_image`) gets a pool for that image on first use, with
``task_pool_size`` containers, started — and limit-checked — once. Every pool keeps all the
isolation limits of ``sandbox``; only the image differs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from sandpiper.config import SandboxConfig
from sandpiper.errors import TaskError


async def podman_image_exists(image: str) -> bool:
    """``podman image exists IMAGE`` (exit 0 = present)."""
    proc = await asyncio.create_subprocess_exec(
        "podman", "image", "exists", image,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    return await proc.wait() == 0


class ImagePools:
    """Routes ``acquire`` to the pool of the task's image (None = the default image)."""

    def __init__(
        self,
        config: SandboxConfig,
        *,
        labels: Mapping[str, str],
        task_pool_size: int = 1,
        pool_factory: Callable[..., Any] | None = None,
        image_exists: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        if pool_factory is None:
            from sandpiper.collector.sandbox.pool import SandboxPool

            pool_factory = SandboxPool
            image_exists = image_exists or podman_image_exists
        self._image_exists = image_exists
        self.config, self.labels = config, dict(labels)
        self.task_pool_size = task_pool_size
        self._factory = pool_factory
        self._pools: dict[str, Any] = {config.image: pool_factory(config, labels=self.labels)}
        self._starting: dict[str, asyncio.Lock] = {}
        self._owner: dict[int, Any] = {}

    async def start(self) -> None:
        await self._pools[self.config.image].start()

    async def _pool(self, image: str | None) -> Any:
        image = image or self.config.image
        if image in self._pools:
            return self._pools[image]
        async with self._starting.setdefault(image, asyncio.Lock()):
            if image not in self._pools:
                if self._image_exists is not None and not await self._image_exists(image):
                    # The task names an image this host does not have: the task is broken
                    # (each of its episodes is invalid), the run goes on.
                    raise TaskError(f"the task's image {image!r} does not exist on this host")
                config = self.config.model_copy(
                    update={"image": image, "pool_size": self.task_pool_size}
                )
                pool = self._factory(config, labels=self.labels)
                await pool.start()
                self._pools[image] = pool
        return self._pools[image]

    async def acquire(self, *, episode_id: str, task_id: str, image: str | None = None) -> Any:
        pool = await self._pool(image)
        sandbox = await pool.acquire(episode_id=episode_id, task_id=task_id)
        self._owner[id(sandbox)] = pool
        return sandbox

    async def release(self, sandbox: Any, *, broken: bool = False) -> None:
        await self._owner.pop(id(sandbox)).release(sandbox, broken=broken)

    @contextlib.asynccontextmanager
    async def session(
        self, *, episode_id: str, task_id: str, image: str | None = None
    ) -> AsyncIterator[Any]:
        """The ``session`` of the pool of ``image`` (see ``SandboxPool.session``)."""
        pool = await self._pool(image)
        async with pool.session(episode_id=episode_id, task_id=task_id) as sandbox:
            yield sandbox

    async def wait_warm(self, timeout_s: float = 120.0) -> None:
        """Wait until the default image's pool is full (benchmarks)."""
        await self._pools[self.config.image].wait_warm(timeout_s)

    async def close(self) -> None:
        await asyncio.gather(*(pool.close() for pool in self._pools.values()))

    @property
    def images(self) -> list[str]:
        """Images with a pool so far (the default first)."""
        return list(self._pools)
