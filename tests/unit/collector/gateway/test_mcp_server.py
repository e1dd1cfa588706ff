"""The MCP server of one episode's tools (``collector/gateway/mcp_server.py``) over the ``mcp``
SDK's in-process client, with the fake sandbox: the native schemas are listed, calls reach the
native toolbox, ``submit`` is scored by the task's reward and ends the episode; and the
``sandpiper sandbox mcp`` command's argument errors."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from sandpiper.collector.episode.loop import default_toolbox_factory
from sandpiper.collector.episode.tools.schemas import TOOL_SCHEMAS
from sandpiper.collector.gateway.mcp_server import EpisodeTools, _until, build_server
from sandpiper.collector.tasks.loading import load_tasks
from sandpiper.testing import FakeSandbox

REPO = Path(__file__).resolve().parents[4]
DEMO = REPO / "tasks" / "demo.jsonl"


def _task(task_id: str = "add-2-2"):
    return next(t for t in load_tasks(DEMO) if t.task_id == task_id)


async def _session(
    calls: list[tuple[str, dict[str, Any]]], **offer: Any
) -> tuple[list, list, EpisodeTools]:
    from mcp import Client

    task, box = _task(), FakeSandbox(scripted=True)
    toolbox = default_toolbox_factory(exec_timeout_s=5.0, test_timeout_s=5.0)(box, task)
    tools = EpisodeTools(task, box, toolbox, **offer)
    async with Client(build_server(tools)) as client:
        listed = (await client.list_tools()).tools
        results = [await client.call_tool(name, args) for name, args in calls]
    await box.close()
    return listed, results, tools


def _text(result) -> str:
    return "".join(c.text for c in result.content if c.type == "text")


def test_lists_the_native_tool_schemas() -> None:
    listed, _, _ = asyncio.run(_session([]))
    assert [(t.name, t.description, t.input_schema) for t in listed] == [
        (s["function"]["name"], s["function"]["description"], s["function"]["parameters"])
        for s in TOOL_SCHEMAS
    ]


def test_only_the_offered_tools_are_listed_and_callable() -> None:
    """``collector.tools`` / ``tool_descriptions``, as a native episode offers them."""
    listed, results, _ = asyncio.run(
        _session([("execute_bash", {"command": "ls"})], offered=["submit"], descriptions="brief")
    )
    assert [(t.name, t.input_schema["properties"]) for t in listed] == [("submit", {})]
    assert results[0].is_error and "unknown tool 'execute_bash'" in _text(results[0])


def test_calls_reach_the_toolbox_and_errors_are_flagged() -> None:
    _, results, _ = asyncio.run(
        _session([
            ("execute_bash", {"command": "ls /workspace"}),
            ("no_such_tool", {}),
            ("execute_bash", {"command": 3}),
            ("execute_bash", {"command": "x" * 70_000}),
        ])
    )  # fmt: skip
    ran, unknown, bad, huge = results
    assert (_text(ran), ran.is_error) == ("ran: ls /workspace", False)
    assert unknown.is_error and "unknown tool 'no_such_tool'" in _text(unknown)
    assert bad.is_error and "must be a string" in _text(bad)
    assert huge.is_error and "65536" in _text(huge)  # collector.max_argument_bytes, as native


@pytest.mark.parametrize(("answer", "reward"), [("4", 1.0), ("5", 0.0)])
def test_submit_is_scored_by_the_task_reward_and_ends_the_episode(answer: str, reward) -> None:
    _, results, tools = asyncio.run(
        _session([("submit", {"answer": answer}), ("execute_bash", {"command": "ls"})])
    )
    submitted, after = results
    assert (_text(submitted), submitted.is_error) == (f"Submitted. Reward: {reward:g}", False)
    assert after.is_error and "already submitted" in _text(after)
    assert tools.submission is not None
    assert (tools.submission.answer, tools.submission.reward) == (answer, reward)


def test_until_cancels_on_stop_and_returns_the_result_otherwise() -> None:
    async def scenario() -> tuple:
        stop = asyncio.Event()
        finished = await _until(stop, asyncio.sleep(0, result="done"))
        waiting = asyncio.ensure_future(_until(stop, asyncio.sleep(60)))
        await asyncio.sleep(0.01)
        stop.set()
        return finished, await waiting, await _until(stop, asyncio.sleep(0))

    assert asyncio.run(scenario()) == ((True, "done"), (False, None), (False, None))


def test_command_argument_errors() -> None:
    from sandpiper.commands.sandbox import _host_port, _one_task
    from sandpiper.errors import SetupError

    assert _host_port("127.0.0.1:8765") == ("127.0.0.1", 8765)
    assert _host_port("[::1]:0") == ("::1", 0)
    for bad in ("localhost", ":80", "h:x", "h:70000"):
        with pytest.raises(SetupError, match="HOST:PORT"):
            _host_port(bad)
    assert _one_task(str(DEMO), "add-2-2").task_id == "add-2-2"
    with pytest.raises(SetupError, match="pick one with --task-id"):
        _one_task(str(DEMO), None)
    with pytest.raises(SetupError, match="no such task"):
        _one_task(str(DEMO), "nope")
    only = REPO / "tasks" / "folders" / "write-hello"
    assert _one_task(str(only), None).task_id == "write-hello"


def test_the_guard_runs_its_command_once_its_owner_dies_and_never_when_killed(
    tmp_path: Path,
) -> None:
    """The container's removal outlives a ``kill -9`` of the server (the pipe's end), and a
    normal exit (the guard killed) runs nothing."""
    from sandpiper.collector.gateway.mcp_server import start_guard

    async def scenario() -> None:
        died = await start_guard(["touch", str(tmp_path / "removed")])
        assert died.stdin is not None
        died.stdin.close()  # what the kernel does when the server dies
        await asyncio.wait_for(died.wait(), 30)
        kept = await start_guard(["touch", str(tmp_path / "kept")])
        kept.kill()
        await kept.wait()

    asyncio.run(scenario())
    assert (tmp_path / "removed").exists()
    assert not (tmp_path / "kept").exists()
