"""Evaluation mode: agents served by any OpenAI-compatible chat endpoint (no token ids).

``sandpiper collect --eval --endpoint URL --model NAME`` runs every task once as a group of
``collector.validation_group_size`` samples through ``POST {URL}/v1/chat/completions`` with
the tool schemas, runs the tool calls in podman sandboxes exactly as training episodes do,
scores the episodes with the same rewards and stores them for analysis with
``trainable=False`` (no token ids, no logprobs) and ``split=validation``, so no learner ever
trains on them. Tool calls come from the API's ``tool_calls``; when the server has no tool
parser enabled, ``<tool_call>`` blocks in the content are parsed as in training.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import httpx
import numpy as np

from collector.agent import SYSTEM_PROMPT, ToolRunner, prepare_sandbox, tool_record
from collector.parsers import ParsedToolCall, parse_tool_calls
from collector.rewards import compute_reward
from collector.tasks import Task
from collector.tools.base import ToolResult
from sandpiper.errors import InferenceError, SandboxError
from store.records import (
    INFRA_STOPS,
    EpisodeRecord,
    Role,
    StopReason,
    ToolErrorKind,
    TurnRecord,
    utcnow,
)

_EMPTY_IDS = np.zeros(0, dtype=np.int32)


class ChatEndpoint:
    """A minimal OpenAI-compatible chat client (``/v1/chat/completions``)."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 300,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        base = url.rstrip("/").removesuffix("/v1")
        self._http = httpx.AsyncClient(
            base_url=base, headers=headers, timeout=timeout_s, transport=transport
        )
        self.model = model

    async def chat(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        body = {"model": self.model, "messages": messages, **params}
        try:
            response = await self._http.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as e:
            raise InferenceError(f"chat endpoint: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise InferenceError(
                f"chat endpoint: HTTP {response.status_code}: {response.text[:300]}"
            )
        return response.json()["choices"][0]

    async def aclose(self) -> None:
        await self._http.aclose()


def _calls_from_message(
    message: dict[str, Any], fmt: str
) -> tuple[str, list[tuple[str, ParsedToolCall]]]:
    """(content, [(tool_call_id, call)]) from an API message."""
    content = message.get("content") or ""
    api_calls = message.get("tool_calls") or []
    if not api_calls:
        parsed = parse_tool_calls(content, fmt)  # type: ignore[arg-type]
        return parsed.content, [(f"call_{i}", c) for i, c in enumerate(parsed.tool_calls)]
    calls = []
    for i, raw in enumerate(api_calls):
        fn = raw.get("function", {})
        text = f'<tool_call>{{"name": {json.dumps(fn.get("name", ""))}, "arguments": {fn.get("arguments") or "{}"}}}</tool_call>'
        (call,) = parse_tool_calls(text).tool_calls
        calls.append((raw.get("id") or f"call_{i}", call))
    return content, calls


async def run_eval_episode(
    *,
    episode_id: str,
    sample_index: int,
    task: Task,
    endpoint: ChatEndpoint,
    sandbox: Any,
    toolbox: ToolRunner,
    tool_schemas: list[dict[str, Any]],
    max_turns: int,
    max_tokens_per_turn: int,
    temperature: float,
    tool_format: str = "hermes",
) -> EpisodeRecord:
    """One chat-API episode; stored untrainable (text only, no token ids)."""
    started_at, t0 = utcnow(), time.perf_counter()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.instruction},
    ]
    turns = [_text_turn(0, Role.USER, task.instruction)]
    stop, error, answer, test_reward, details, written = None, None, None, None, {}, []
    try:
        await prepare_sandbox(sandbox, task)
        for _ in range(max_turns):
            choice = await endpoint.chat(
                messages,
                tools=tool_schemas,
                max_tokens=max_tokens_per_turn,
                temperature=temperature,
            )
            message = choice.get("message", {})
            content, calls = _calls_from_message(message, tool_format)
            written.append(json.dumps(message))
            messages.append(
                {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}
            )
            records = []
            for index, (call_id, call) in enumerate(calls):
                result = await _run_call(toolbox, call)
                records.append(tool_record(index, call, result))
                messages.append({"role": "tool", "tool_call_id": call_id, "content": result.output})
                if result.error_kind is ToolErrorKind.SANDBOX_DIED:
                    raise SandboxError(result.output)
                if result.submitted:
                    stop, answer, test_reward = (
                        StopReason.SUBMITTED,
                        result.answer,
                        result.test_reward,
                    )
                    details = dict(result.test_details)
                    break
            turns.append(_text_turn(len(turns), Role.ASSISTANT, written[-1], tuple(records)))
            if stop is not None:
                break
            if not calls:
                stop, answer = StopReason.NO_TOOL_CALL, content
                break
            if choice.get("finish_reason") == "length":
                stop = StopReason.MAX_TOKENS
                break
            tool_text = "\n".join(r.output for r in records)
            turns.append(_text_turn(len(turns), Role.TOOL, tool_text))
        stop = stop or StopReason.MAX_TURNS
    except SandboxError as e:
        stop, error = StopReason.SANDBOX_DIED, f"sandbox: {e}"
    except InferenceError as e:
        stop, error = StopReason.MODEL_ERROR, str(e)
    valid = stop not in INFRA_STOPS
    reward, breakdown = None, {}
    if valid:
        outcome = compute_reward(
            task.reference, answer=answer, test_reward=test_reward, test_details=details,
            model_text="".join(written),
        )  # fmt: skip
        reward, breakdown = outcome.reward, outcome.breakdown
    return EpisodeRecord(
        episode_id=episode_id,
        sample_index=sample_index,
        stop_reason=stop,
        valid=valid,
        trainable=False,
        reward=reward,
        reward_breakdown=breakdown,
        turns=tuple(turns),
        started_at=started_at,
        duration_ms=(time.perf_counter() - t0) * 1000,
        sandbox_id=getattr(sandbox, "id", None),
        error=error,
    )


async def _run_call(toolbox: ToolRunner, call: ParsedToolCall) -> ToolResult:
    if not call.ok:
        return ToolResult(output=call.error or "Error", error_kind=call.error_kind)
    assert call.arguments is not None
    try:
        return await toolbox.call(call.name, call.arguments)
    except SandboxError as e:
        return ToolResult(output=str(e), error_kind=ToolErrorKind.SANDBOX_DIED)


def _text_turn(index: int, role: Role, text: str, calls: tuple = ()) -> TurnRecord:
    return TurnRecord(
        index=index,
        role=role,
        text=text,
        token_ids_T=_EMPTY_IDS,
        logprobs_T=None,
        policy_versions_T=None,
        trainable=False,
        tool_calls=calls,
    )


async def evaluate(config: Any, *, endpoint_url: str, model: str, api_key: str | None) -> int:
    """Run every task once (see the module docstring); returns the number of groups stored."""
    from collector.agent import default_toolbox_factory
    from collector.journal import SeqJournal
    from collector.launch import open_store
    from collector.sandbox.images import ImagePools
    from collector.tasks import load_tasks
    from collector.tools import offered_schemas
    from store.records import GroupRecord, Split

    cc = config.collector
    tool_schemas = offered_schemas(cc.tools, cc.tool_descriptions)
    tasks = load_tasks(
        cc.tasks, validation_fraction=cc.validation_fraction, split_seed=cc.split_seed
    )
    store = await asyncio.to_thread(open_store, config)
    await asyncio.to_thread(store.upsert_tasks, [t.to_record() for t in tasks])
    journal = SeqJournal(config.run_dir / "collector_journal.json")
    make_toolbox = default_toolbox_factory(
        exec_timeout_s=config.sandbox.exec_timeout_s, test_timeout_s=cc.test_timeout_s
    )
    chat = ChatEndpoint(endpoint_url, model, api_key=api_key)
    pool = ImagePools(config.sandbox, labels={"sandpiper.run": config.name})
    await pool.start()
    slots = asyncio.Semaphore(cc.max_concurrent_episodes)
    writer = store.writer(spool_dir=config.store.spool_dir)

    async def episode(task: Task, index: int) -> EpisodeRecord:
        episode_id = uuid.uuid4().hex
        session = pool.session(episode_id=episode_id, task_id=task.task_id, image=task.image)
        async with slots, session as box:
            return await run_eval_episode(
                episode_id=episode_id, sample_index=index, task=task, endpoint=chat,
                sandbox=box, toolbox=make_toolbox(box, task), tool_schemas=tool_schemas,
                max_turns=cc.max_turns, max_tokens_per_turn=cc.max_tokens_per_turn,
                temperature=cc.temperature, tool_format=cc.tool_parser,
            )  # fmt: skip

    async def group(task: Task) -> None:
        _, group_id = journal.start(task.task_id, lambda s: f"{config.name}/{task.task_id}/{s}")
        episodes = await asyncio.gather(
            *(episode(task, i) for i in range(cc.validation_group_size))
        )
        record = GroupRecord(
            group_id=group_id, run_id=config.name, task_id=task.task_id, split=Split.VALIDATION,
            sampling_params={"endpoint": endpoint_url, "model": model, "temperature": cc.temperature},
            episodes=tuple(episodes),
        )  # fmt: skip
        await asyncio.to_thread(writer.put, record)
        journal.done(group_id)

    try:
        await asyncio.gather(*(group(t) for t in tasks))
    finally:
        await asyncio.to_thread(writer.close)
        await pool.close()
        await chat.aclose()
    return len(tasks)
