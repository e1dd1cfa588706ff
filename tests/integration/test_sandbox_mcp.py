"""``sandpiper sandbox mcp`` on stdio, driven by the ``mcp`` SDK's own client: the tools act in
a real podman sandbox, ``submit`` earns the task's reward, the host is out of reach, and the
container is gone once the client hangs up."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
TASK = REPO / "tasks" / "folders" / "write-hello"


def _containers(run: str) -> list[str]:
    out = subprocess.run(
        ["podman", "ps", "-a", "--format", "{{.Names}}", "--filter", f"label=sandpiper.run={run}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return out.split()


def test_mcp_stdio_acts_in_the_sandbox_and_pays(sandbox_image: str, tmp_path: Path) -> None:
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    run = f"pytest-mcp-{uuid.uuid4().hex[:8]}"
    host_dir = tmp_path / "host"  # the collector host's temp folder
    host_file = host_dir / "escaped.txt"
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "sandpiper.cli", "sandbox", "mcp", str(TASK), "--name", run,
              "--sandbox.image", sandbox_image],
    )  # fmt: skip

    async def session() -> tuple[list[str], str, str, str, list[str]]:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            names = [t.name for t in (await client.list_tools()).tools]
            live = _containers(run)
            escape = await client.call_tool(
                "execute_bash", {"command": f"mkdir -p {host_dir}; echo x > {host_file}; id -u"}
            )
            wrote = await client.call_tool(
                "execute_bash", {"command": "echo hello > /workspace/hello.txt && cat hello.txt"}
            )
            submitted = await client.call_tool("submit", {})
            return names, _text(escape), _text(wrote), _text(submitted), live

    names, escape, wrote, submitted, live = asyncio.run(session())
    assert names == ["execute_bash", "str_replace_editor", "submit"]
    assert len(live) == 1, live  # the sandbox ran while the client was connected
    assert escape.strip().splitlines()[-1] != "0", escape  # the agent's uid, never root
    assert wrote.strip() == "hello", wrote
    assert submitted == "Submitted. Reward: 1", submitted
    assert not host_file.exists()  # the command aimed at the host wrote in the sandbox
    assert _containers(run) == []  # removed when stdin ended


def _text(result) -> str:
    return "".join(c.text for c in result.content if c.type == "text")
