"""The editor in a real podman sandbox: reads are bounded in the container before anything
reaches the host (what crosses the shell's pipe is counted), FIFOs are refused without
blocking, a huge folder listing and a lone surrogate are answers, not crashes.
Cost: one container, a 10 MB file on its tmpfs, ~10 s."""

from __future__ import annotations

import asyncio
import time

import pytest

from sandpiper.collector.episode.tools.editor import (
    TRUNCATED_MESSAGE,
    VIEW_READ_BYTES,
    Editor,
    EditorError,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_editor_reads_are_bounded_in_the_container(sandbox_pool):
    async def go():
        async with (
            sandbox_pool(pool_size=1) as pool,
            pool.session(episode_id="e", task_id="t") as box,
        ):
            crossed = []
            call = box._call

            async def counting(req, payload=b"", **kwargs):
                header, data = await call(req, payload, **kwargs)
                crossed.append(len(data))
                return header, data

            box._call = counting
            editor = Editor(box)
            setup = await box.exec(
                "yes 'a line of some text' | head -c 10000000 > /workspace/big.txt;"
                ' mkfifo /workspace/pipe; mkdir /workspace/many && python3 -c "import os;'
                " [os.mkdir('/workspace/many/%d-%s' % (i, 'n' * 200)) for i in range(3000)]\"",
                timeout_s=120,
            )
            assert setup.ok, setup.stderr
            crossed.clear()
            view = await editor(command="view", path="/workspace/big.txt")
            assert TRUNCATED_MESSAGE in view and sum(crossed) <= VIEW_READ_BYTES
            crossed.clear()
            tail = await editor(
                command="view", path="/workspace/big.txt", view_range=["500000", "-1"]
            )
            assert tail.endswith(":\n500000\ta line of some text\n500001\t\n")
            assert sum(crossed) < 1000  # 10 MB streamed in the container, 21 bytes sent
            started = time.monotonic()
            with pytest.raises(EditorError, match="is a fifo"):
                await editor(command="view", path="/workspace/pipe")
            with pytest.raises(OSError, match="not a regular file"):
                await box.read_file("/workspace/pipe", limit=10)
            assert time.monotonic() - started < 5
            listing = await editor(command="view", path="/workspace/many")
            assert TRUNCATED_MESSAGE in listing
            with pytest.raises(EditorError, match="not valid UTF-8"):
                await editor(command="view", path="/workspace/\ud800")
            assert (await box.exec("echo alive")).stdout == "alive\n"

    asyncio.run(go())
