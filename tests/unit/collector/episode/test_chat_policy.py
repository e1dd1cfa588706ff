"""Evaluation mode against an OpenAI-compatible chat API (mocked transport), through the
training episode loop (``run_episode`` with a ``ChatPolicy``)."""

from __future__ import annotations

import asyncio
import json

import httpx

from sandpiper.collector.episode.chat_policy import ChatEndpoint, ChatPolicy
from sandpiper.collector.episode.loop import run_episode, run_pooled_episode
from sandpiper.collector.tasks.model import Task
from sandpiper.config import SamplingLimits
from sandpiper.errors import TaskError
from sandpiper.store.records import Role, StopReason, ToolErrorKind
from sandpiper.testing import FAKE_TOOL_SCHEMAS, FakePool, FakeToolbox, scripted_sandbox

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


LIMITS = SamplingLimits(max_turns=4, max_tokens_per_turn=64, temperature=0.0)


def _run(replies: list[dict], *, task=TASK, sandbox=None, schemas=FAKE_TOOL_SCHEMAS):
    endpoint, seen = _endpoint(replies)
    sandbox = sandbox or scripted_sandbox()
    episode = asyncio.run(
        run_episode(
            episode_id="e", sample_index=0, task=task, policy=ChatPolicy(endpoint, schemas),
            sandbox=sandbox, toolbox=FakeToolbox(sandbox), limits=LIMITS,
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
    sandbox = scripted_sandbox()
    episode = asyncio.run(
        run_episode(
            episode_id="e", sample_index=0, task=TASK,
            policy=ChatPolicy(endpoint, FAKE_TOOL_SCHEMAS), sandbox=sandbox,
            toolbox=FakeToolbox(sandbox), limits=LIMITS,
        )
    )  # fmt: skip
    assert episode.stop_reason is StopReason.MODEL_ERROR and not episode.valid
    assert episode.reward is None and "503" in episode.error


def test_eval_reads_the_answer_file_as_training_does():
    task = Task(
        "f", "q", {"reward": "exact", "answer": "42", "answer_file": "/workspace/answer.txt"},
        "unit", "llm_in_sandbox",
    )  # fmt: skip
    sandbox = scripted_sandbox()
    sandbox.files["/workspace/answer.txt"] = b"42\n"
    episode, _ = _run(
        [{"role": "assistant", "content": "", "tool_calls": [_call("submit", "{}")]}],
        task=task, sandbox=sandbox,
    )  # fmt: skip
    assert episode.stop_reason is StopReason.SUBMITTED and episode.reward == 1.0


def test_eval_refuses_tools_that_were_not_offered():
    only_submit = [s for s in FAKE_TOOL_SCHEMAS if s["function"]["name"] == "submit"]
    episode, seen = _run(
        [
            {"role": "assistant", "content": "", "tool_calls": [_call("execute_bash", '{"command": "ls"}')]},
            {"role": "assistant", "content": "", "tool_calls": [_call("submit", '{"answer": "42"}')]},
        ],
        schemas=only_submit,
    )  # fmt: skip
    (bash,) = episode.turns[1].tool_calls
    assert bash.error_kind is ToolErrorKind.UNKNOWN_TOOL
    assert seen[1]["messages"][-1]["content"].startswith("Error: unknown tool")
    assert episode.reward == 1.0


def test_a_broken_task_is_one_invalid_episode_not_an_abort(tmp_path):
    """Missing image, failing setup.sh and a missing test script: each one invalid episode."""
    endpoint, _ = _endpoint([{"role": "assistant", "content": "done"}] * 3)
    policy = ChatPolicy(endpoint, FAKE_TOOL_SCHEMAS)

    def run(task, pool):
        return asyncio.run(
            run_pooled_episode(
                pool, episode_id="e", sample_index=0, task=task, policy=policy,
                make_toolbox=lambda box, t: FakeToolbox(box), limits=LIMITS,
            )
        )  # fmt: skip

    missing_image = run(TASK, FakePool(TaskError("the task's image 'x' does not exist")))
    assert missing_image.stop_reason is StopReason.TASK_ERROR and not missing_image.valid
    assert missing_image.reward is None and "image" in missing_image.error
    (tmp_path / "tests").mkdir()
    no_script = Task("n", "q", {"reward": "tests"}, "u", "folder", data_dir=tmp_path)
    pool = FakePool()
    episode = run(no_script, pool)
    assert episode.stop_reason is StopReason.TASK_ERROR and "tests/run.sh" in episode.error
    assert episode.reward is None and [broken for _, broken in pool.released] == [False]


def test_token_budget_and_context_limit_end_the_episode_as_in_training():
    bash = {
        "role": "assistant",
        "content": "",
        "tool_calls": [_call("execute_bash", '{"command": "ls"}')],
    }
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        reply = {"choices": [{"message": bash, "finish_reason": "tool_calls"}]}
        return httpx.Response(200, json={**reply, "usage": {"completion_tokens": 40}})

    endpoint = ChatEndpoint("http://x", "m", transport=httpx.MockTransport(handler))
    sandbox = scripted_sandbox()
    limits = SamplingLimits(max_turns=5, max_tokens_per_turn=64, max_episode_tokens=64)
    episode = asyncio.run(
        run_episode(
            episode_id="e", sample_index=0, task=TASK,
            policy=ChatPolicy(endpoint, FAKE_TOOL_SCHEMAS), sandbox=sandbox,
            toolbox=FakeToolbox(sandbox), limits=limits,
        )
    )  # fmt: skip
    assert episode.stop_reason is StopReason.MAX_TOKENS and episode.valid
    assert [body["max_tokens"] for body in seen] == [64, 24]

    def too_long(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, text="This model's maximum context length is 2048 tokens")

    endpoint = ChatEndpoint("http://x", "m", transport=httpx.MockTransport(too_long))
    episode = asyncio.run(
        run_episode(
            episode_id="e", sample_index=0, task=TASK,
            policy=ChatPolicy(endpoint, FAKE_TOOL_SCHEMAS), sandbox=sandbox,
            toolbox=FakeToolbox(sandbox), limits=LIMITS,
        )
    )  # fmt: skip
    assert episode.stop_reason is StopReason.CONTEXT_EXCEEDED and episode.valid
