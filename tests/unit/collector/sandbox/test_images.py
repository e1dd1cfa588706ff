"""Tasks that name their own image get sandboxes from a pool of that image."""

from __future__ import annotations

import asyncio

from sandpiper.collector.sandbox.images import ImagePools
from sandpiper.config import SandboxConfig
from sandpiper.testing import FakePool


def _pools() -> tuple[ImagePools, list[FakePool]]:
    made: list[FakePool] = []

    def factory(config: SandboxConfig, *, labels: dict[str, str]) -> FakePool:
        pool = FakePool()
        pool.config = config
        made.append(pool)
        return pool

    config = SandboxConfig(image="localhost/base:1", pool_size=4)
    return ImagePools(config, labels={"sandpiper.run": "r"}, pool_factory=factory), made


def test_default_and_task_images_get_their_own_pools() -> None:
    async def scenario() -> None:
        pools, made = _pools()
        await pools.start()
        assert len(made) == 1 and made[0].started
        a = await pools.acquire(episode_id="e1", task_id="t1")
        b = await pools.acquire(episode_id="e2", task_id="t2", image="localhost/task:7")
        c = await pools.acquire(episode_id="e3", task_id="t2", image="localhost/task:7")
        assert pools.images == ["localhost/base:1", "localhost/task:7"]
        base, task = made
        assert base.acquired == 1 and task.acquired == 2 and task.started
        # the task pool keeps every limit of the sandbox config, with its own image and size
        assert task.config.image == "localhost/task:7" and task.config.pool_size == 1
        assert task.config.memory_mb == base.config.memory_mb
        await pools.release(b, broken=True)
        await pools.release(a)
        await pools.release(c)
        assert task.released == [(b.id, True), (c.id, False)]
        assert base.released == [(a.id, False)]
        await pools.close()
        assert base.closed and task.closed

    asyncio.run(scenario())


def test_concurrent_first_use_starts_one_pool() -> None:
    async def scenario() -> None:
        pools, made = _pools()
        await asyncio.gather(
            *(pools.acquire(episode_id=f"e{i}", task_id="t", image="x:1") for i in range(5))
        )
        assert len(made) == 2 and made[1].acquired == 5

    asyncio.run(scenario())


def test_sessions_go_to_the_pool_of_their_image() -> None:
    async def scenario() -> None:
        pools, made = _pools()
        async with pools.session(episode_id="e1", task_id="t", image="x:1") as box:
            assert box.id == "box-1"
        async with pools.session(episode_id="e2", task_id="t") as box:
            pass
        base, task = made
        assert task.released == [("box-1", False)] and base.released == [("box-1", False)]
        try:
            async with pools.session(episode_id="e3", task_id="t", image="x:1"):
                raise RuntimeError("the episode failed")
        except RuntimeError:
            pass
        assert task.released[-1] == ("box-2", True)  # an exception marks the sandbox broken

    asyncio.run(scenario())


def test_a_missing_task_image_is_a_task_error_and_starts_no_pool() -> None:
    import pytest

    from sandpiper.errors import TaskError

    async def exists(image: str) -> bool:
        return image == "localhost/base:1"

    async def scenario() -> None:
        made: list[FakePool] = []
        pools = ImagePools(
            SandboxConfig(image="localhost/base:1"), labels={}, image_exists=exists,
            pool_factory=lambda config, *, labels: made.append(FakePool()) or made[-1],
        )  # fmt: skip
        await pools.start()
        with pytest.raises(TaskError, match="image 'localhost/gone:1' does not exist"):
            await pools.acquire(episode_id="e", task_id="t", image="localhost/gone:1")
        assert len(made) == 1 and pools.images == ["localhost/base:1"]

    asyncio.run(scenario())
