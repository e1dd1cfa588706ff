"""The gateway's per-episode MCP route (``collector/gateway/mcp_route.py``), over real HTTP on
loopback with the ``mcp`` SDK's own streamable-HTTP client and the fake sandbox: an episode's
tools are served at its own URL, ``submit`` keeps its result for the episode's grading (not
scored here), the route closes with the episode, an episode without tools has none, and a
foreign ``Host`` header is refused (DNS rebinding)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from sandpiper.collector.episode.loop import default_toolbox_factory
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.gateway.mcp_server import EpisodeTools
from sandpiper.collector.gateway.server import Gateway, GatewaySettings
from sandpiper.collector.tasks.loading import load_tasks
from sandpiper.config import SamplingLimits
from sandpiper.testing import FAKE_TOOL_SCHEMAS, FakeSandbox, ScriptedPolicy

REPO = Path(__file__).resolve().parents[4]
DEMO = REPO / "tasks" / "demo.jsonl"


def _tools() -> tuple[EpisodeTools, FakeSandbox]:
    task = next(t for t in load_tasks(DEMO) if t.task_id == "add-2-2")
    box = FakeSandbox(scripted=True)
    toolbox = default_toolbox_factory(exec_timeout_s=5.0, test_timeout_s=5.0)(box, task)
    return EpisodeTools(task, box, toolbox, score_on_submit=False), box


def _text(result) -> str:
    return "".join(c.text for c in result.content if c.type == "text")


async def _gateway(tokenizer) -> Gateway:
    gw = Gateway(
        client=ScriptedPolicy(tokenizer, []),
        renderer=ChatRenderer(tokenizer, FAKE_TOOL_SCHEMAS),
        settings=GatewaySettings(model_names=("policy",), sampling=SamplingLimits()),
    )
    await gw.serve()
    return gw


def test_an_episodes_tools_at_its_own_url_and_submit_kept_for_grading(tiny_tokenizer) -> None:
    from mcp import Client

    async def main():
        gw = await _gateway(tiny_tokenizer)
        (tools_a, box_a), (tools_b, box_b) = _tools(), _tools()
        gw.open_episode("a", tools=tools_a)
        gw.open_episode("b", tools=tools_b)
        try:
            async with Client(gw.mcp_url("a")) as client:
                names = [t.name for t in (await client.list_tools()).tools]
                ran = await client.call_tool("execute_bash", {"command": "echo hi"})
                submitted = await client.call_tool("submit", {"answer": "4"})
                after = await client.call_tool("execute_bash", {"command": "ls"})
        finally:
            gw.close_episode("a")
            await gw.tools_closed("a")
            gw.close_episode("b")
            await gw.aclose()
            await box_a.close()
            await box_b.close()
        return names, ran, submitted, after, tools_a, tools_b

    names, ran, submitted, after, tools_a, tools_b = asyncio.run(main())
    assert names == ["execute_bash", "str_replace_editor", "submit"]
    assert (_text(ran), ran.is_error) == ("ran: echo hi", False)
    # submit's own result is kept; the episode's finishing code grades it (external.py)
    assert _text(submitted) == "Submitted: the episode is over." and not submitted.is_error
    assert tools_a.submitted is not None and tools_a.submitted.answer == "4"
    assert tools_a.submission is None  # not scored here
    assert after.is_error and "already submitted" in _text(after)
    assert tools_b.submitted is None  # another episode's tools are its own


def test_the_route_closes_with_the_episode_and_needs_tools(tiny_tokenizer) -> None:
    async def main():
        gw = await _gateway(tiny_tokenizer)
        tools, box = _tools()
        gw.open_episode("with", tools=tools)
        gw.open_episode("without")
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                           "clientInfo": {"name": "t", "version": "0"}}}  # fmt: skip
        headers = {"accept": "application/json, text/event-stream"}
        try:
            async with httpx.AsyncClient() as http:
                open_ = await http.post(gw.mcp_url("with"), json=init, headers=headers)
                foreign = await http.post(gw.mcp_url("with"), json=init,
                                          headers={**headers, "host": "evil.example:80"})  # fmt: skip
                no_tools = await http.post(gw.mcp_url("without"), json=init, headers=headers)
                gw.close_episode("with")
                await gw.tools_closed("with")
                closed = await http.post(gw.mcp_url("with"), json=init, headers=headers)
        finally:
            gw.close_episode("without")
            await gw.aclose()
            await box.close()
        return open_, foreign, no_tools, closed

    open_, foreign, no_tools, closed = asyncio.run(main())
    assert open_.status_code == 200
    assert foreign.status_code in (403, 421)  # the SDK's DNS-rebinding check
    assert no_tools.status_code == 404 and no_tools.json()["error"]["code"] == "episode_not_found"
    assert closed.status_code == 404
