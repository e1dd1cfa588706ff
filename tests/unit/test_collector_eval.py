"""Evaluation mode against an OpenAI-compatible chat API (mocked transport)."""

from __future__ import annotations

import asyncio
import json

import httpx

from collector.eval import ChatEndpoint, run_eval_episode
from collector.tasks import Task
from store.records import Role, StopReason, ToolErrorKind
from tests.fixtures.collector import FAKE_TOOL_SCHEMAS, FakeSandbox, FakeToolbox

TASK = Task("t", "6*7?", {"reward": "math", "answer": "42"}, "unit", "jsonl_math")


def _endpoint(replies: list[dict]) -> tuple[ChatEndpoint, list[dict]]:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        message = replies[len(seen) - 1]
        return httpx.Response(
            200, json={"choices": [{"message": message, "finish_reason": "stop"}]}
        )

    transport = httpx.MockTransport(handler)
    return ChatEndpoint("http://x/v1", "m", transport=transport), seen


def _call(name: str, arguments: str, call_id: str = "c1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _run(replies: list[dict]):
    endpoint, seen = _endpoint(replies)
    sandbox = FakeSandbox()
    episode = asyncio.run(
        run_eval_episode(
            episode_id="e", sample_index=0, task=TASK, endpoint=endpoint, sandbox=sandbox,
            toolbox=FakeToolbox(sandbox), tool_schemas=FAKE_TOOL_SCHEMAS, max_turns=4,
            max_tokens_per_turn=64, temperature=0.0,
        )
    )  # fmt: skip
    return episode, seen


def test_api_tool_calls_run_and_episode_is_untrainable():
    episode, seen = _run(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [_call("execute_bash", '{"command": "ls"}')],
            },
            {"role": "assistant", "content": "", "tool_calls": [_call("execute_bash", "{bad")]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [_call("submit", '{"answer": "42"}')],
            },
        ]
    )
    assert episode.stop_reason is StopReason.SUBMITTED and episode.reward == 1.0
    assert not episode.trainable and episode.valid
    assert all(len(t.token_ids_T) == 0 and not t.trainable for t in episode.turns)
    kinds = [t.tool_calls[0].error_kind for t in episode.turns if t.role is Role.ASSISTANT]
    assert kinds == [ToolErrorKind.NONE, ToolErrorKind.BAD_JSON, ToolErrorKind.NONE]
    assert seen[0]["tools"] == FAKE_TOOL_SCHEMAS and seen[0]["model"] == "m"
    # the tool result went back with the call id, as the chat API expects
    assert seen[1]["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "ran: ls\n"}


def test_content_tool_calls_are_parsed_when_the_server_has_no_tool_parser():
    text = '<tool_call>{"name": "submit", "arguments": {"answer": "41"}}</tool_call>'
    episode, _ = _run([{"role": "assistant", "content": text}])
    assert episode.stop_reason is StopReason.SUBMITTED and episode.reward == 0.0


def test_endpoint_failure_is_invalid():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, text="overloaded")

    endpoint = ChatEndpoint("http://x", "m", transport=httpx.MockTransport(handler))
    sandbox = FakeSandbox()
    episode = asyncio.run(
        run_eval_episode(
            episode_id="e", sample_index=0, task=TASK, endpoint=endpoint, sandbox=sandbox,
            toolbox=FakeToolbox(sandbox), tool_schemas=FAKE_TOOL_SCHEMAS, max_turns=2,
            max_tokens_per_turn=8, temperature=0.0,
        )
    )  # fmt: skip
    assert episode.stop_reason is StopReason.MODEL_ERROR and not episode.valid
    assert episode.reward is None and "503" in episode.error
