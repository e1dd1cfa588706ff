"""``sandpiper sandbox mcp``, on stdio and on streamable HTTP, driven by the ``mcp`` SDK's own
clients: the tools act in a real podman sandbox, ``submit`` earns the task's reward, the host is
out of reach, and the container is gone once the client hangs up (stdio) or the server is
stopped (HTTP, SIGTERM)."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]
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


def test_mcp_http_acts_in_the_sandbox_and_pays(sandbox_image: str, tmp_path: Path) -> None:
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    run = f"pytest-mcp-http-{uuid.uuid4().hex[:8]}"
    log_path = tmp_path / "server.log"
    argv = [sys.executable, "-m", "sandpiper.cli", "sandbox", "mcp", str(TASK), "--name", run,
            "--sandbox.image", sandbox_image, "--http", "127.0.0.1:0"]  # fmt: skip
    with log_path.open("wb") as log:
        server = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=REPO)
    try:
        url = _served_url(server, log_path)  # port 0: the server picks one and logs it

        async def session() -> tuple[list[str], str, str, str, list[str]]:
            async with (
                streamable_http_client(url) as (read, write),
                ClientSession(read, write) as client,
            ):
                await client.initialize()
                names = [t.name for t in (await client.list_tools()).tools]
                live = _containers(run)
                uid = await client.call_tool("execute_bash", {"command": "id -u"})
                wrote = await client.call_tool(
                    "execute_bash",
                    {"command": "echo hello > /workspace/hello.txt && cat hello.txt"},
                )
                submitted = await client.call_tool("submit", {})
                return names, _text(uid), _text(wrote), _text(submitted), live

        names, uid, wrote, submitted, live = asyncio.run(session())
        assert names == ["execute_bash", "str_replace_editor", "submit"]
        assert len(live) == 1, live  # the sandbox ran while the client was connected
        assert uid.strip() != "0", uid  # the agent's uid, never root
        assert wrote.strip() == "hello", wrote
        assert submitted == "Submitted. Reward: 1", submitted
        assert _containers(run) == live  # the client's hang-up does not end an HTTP server
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, _tail(log_path)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert "task write-hello: submitted, reward 1" in log_path.read_text(), _tail(log_path)
    assert _containers(run) == []  # removed on SIGTERM


def _served_url(server: subprocess.Popen, log_path: Path, timeout_s: float = 120.0) -> str:
    """The URL the ``--http`` server logs once it listens (after its sandbox is ready)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"MCP server at (http://\S+/mcp)", log_path.read_text(errors="replace"))
        if found:
            return found.group(1)
        if server.poll() is not None:
            pytest.fail(
                f"the server exited ({server.returncode}) before serving:\n{_tail(log_path)}"
            )
        time.sleep(0.1)
    pytest.fail(f"the server logged no URL within {timeout_s:.0f} s:\n{_tail(log_path)}")


def _tail(log_path: Path, lines: int = 30) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


def _text(result) -> str:
    return "".join(c.text for c in result.content if c.type == "text")
