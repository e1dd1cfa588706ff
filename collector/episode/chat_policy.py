"""A policy behind any OpenAI-compatible chat endpoint (``/v1/chat/completions``): text mode.

Used by ``sandpiper collect --eval``. The episode runs through the same loop as training
(:func:`sandpiper.collector.episode.loop.run_episode`); only the policy differs: messages go out as text with
the offered tool schemas, replies come back as text (no token ids, no logprobs), so every
turn is stored untrainable. Tool calls come from the API's ``tool_calls``; when the server has
no tool parser enabled, tool-call blocks in the content are parsed as in training.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import httpx

from sandpiper.collector.episode.parsers import ParsedToolCall, parse_tool_calls
from sandpiper.collector.episode.policy import Reply, Stopped, assistant_record, text_turn
from sandpiper.collector.inference.vllm_client import ContextLengthExceeded
from sandpiper.config import SamplingLimits
from sandpiper.config.sampling import NoRoom
from sandpiper.errors import InferenceError, SandpiperError
from sandpiper.store.records import Role, StopReason, ToolCallRecord, ToolErrorKind, TurnRecord


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
        """The first choice of one completion, with the reply's ``usage``; raises
        ``InferenceError`` (``ContextLengthExceeded`` when the prompt is too long)."""
        body = {"model": self.model, "messages": messages, **params}
        try:
            response = await self._http.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as e:
            raise InferenceError(f"chat endpoint: {type(e).__name__}: {e}") from e
        if response.status_code == 400 and "context length" in response.text.lower():
            raise ContextLengthExceeded(f"chat endpoint: {response.text[:300]}")
        if response.status_code != 200:
            raise InferenceError(
                f"chat endpoint: HTTP {response.status_code}: {response.text[:300]}"
            )
        try:
            reply = response.json()
            choice = reply["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise InferenceError(f"chat endpoint: malformed reply: {response.text[:300]}") from e
        if not isinstance(choice, dict):
            raise InferenceError(f"chat endpoint: malformed reply: {response.text[:300]}")
        return {**choice, "usage": reply.get("usage") or {}}

    async def aclose(self) -> None:
        await self._http.aclose()


class ChatPolicy:
    """Opens one text-mode session per episode against ``endpoint``."""

    def __init__(self, endpoint: ChatEndpoint, tool_schemas: Sequence[Mapping[str, Any]]) -> None:
        self.endpoint = endpoint
        self.tools = [dict(t) for t in tool_schemas]

    def session(self, messages: list[dict[str, Any]], limits: SamplingLimits) -> ChatSession:
        return ChatSession(self.endpoint, self.tools, messages, limits)


class ChatSession:
    """The conversation as chat messages; ``usage.completion_tokens`` counts the budget."""

    trainable = False

    def __init__(
        self,
        endpoint: ChatEndpoint,
        tools: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        limits: SamplingLimits,
    ) -> None:
        self.endpoint, self.tools, self.limits = endpoint, tools, limits
        self.messages = [dict(m) for m in messages]
        self.completion_tokens = 0
        self._call_ids: list[str] = []

    def prompt_turn(self, at: datetime) -> TurnRecord:
        text = "\n\n".join(str(m.get("content") or "") for m in self.messages)
        return text_turn(0, Role.USER, text, at)

    async def reply(self) -> Reply | Stopped:
        # The endpoint renders the prompt, so its length is not known here (None: no
        # context term); a prompt too long for the endpoint's context is its 400, below.
        request = self.limits.reply_request(
            prompt_tokens=None, sampled_tokens=self.completion_tokens
        )
        if isinstance(request, NoRoom):
            return Stopped(StopReason(request.reason))
        try:
            choice = await self.endpoint.chat(
                self.messages,
                tools=self.tools,
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
            )
        except ContextLengthExceeded:
            return Stopped(StopReason.CONTEXT_EXCEEDED)
        except SandpiperError as e:
            return Stopped(StopReason.MODEL_ERROR, f"inference: {e}")
        message = choice.get("message") or {}
        usage = choice.get("usage") or {}
        self.completion_tokens += int(usage.get("completion_tokens") or 0)
        content = message.get("content") or ""
        if not isinstance(content, str):
            return Stopped(StopReason.MODEL_ERROR, "inference: message content is not text")
        api_calls = message.get("tool_calls") or []
        if api_calls:
            calls, ids, rendered = _api_calls(api_calls, self.limits)
        else:
            parsed = parse_tool_calls(
                content,
                self.limits.tool_format,
                tool_schemas=self.tools,
                max_argument_bytes=self.limits.max_argument_bytes,
            )
            calls, rendered = list(parsed.tool_calls), ""
            content = parsed.content if parsed.tool_calls else content
            ids = [f"call_{i}" for i in range(len(calls))]
        self._call_ids = ids
        self.messages.append(_assistant_message(message, api_calls))
        truncated = StopReason.MAX_TOKENS if choice.get("finish_reason") == "length" else None
        text = (message.get("content") or "") + rendered
        return Reply(text=text, content=content, tool_calls=tuple(calls), truncated=truncated)

    def assistant_turn(
        self,
        index: int,
        reply: Reply,
        tool_calls: Sequence[ToolCallRecord],
        timing: tuple[datetime, float],
    ) -> TurnRecord:
        return assistant_record(index, reply, tool_calls, timing)

    def add_tool_results(
        self, index: int, messages: Sequence[Mapping[str, Any]], at: datetime, duration_ms: float
    ) -> TurnRecord:
        # Every call of the reply gets a result (the API requires it); the loop only stops
        # early after submit or a dead sandbox, and then the episode is over.
        for call_id, message in zip(self._call_ids, messages, strict=False):
            self.messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": message["content"]}
            )
        text = "\n".join(str(m["content"]) for m in messages)
        return text_turn(index, Role.TOOL, text, at, duration_ms)


def _api_calls(
    api_calls: list[Any], limits: SamplingLimits
) -> tuple[list[ParsedToolCall], list[str], str]:
    """Parse API tool calls with the training parser (same errors, same argument limits)."""
    calls, ids, rendered = [], [], []
    for i, raw in enumerate(api_calls):
        fn = raw.get("function", {}) if isinstance(raw, dict) else {}
        name = fn.get("name", "") if isinstance(fn, dict) else ""
        arguments = fn.get("arguments") if isinstance(fn, dict) else None
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {})
        block = (
            f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'
        )
        parsed = parse_tool_calls(block, "hermes", max_argument_bytes=limits.max_argument_bytes)
        if parsed.tool_calls:
            calls.append(parsed.tool_calls[0])
        else:
            calls.append(
                ParsedToolCall(name=str(name), arguments=None, arguments_json=arguments,
                               error_kind=ToolErrorKind.BAD_JSON, error="Error: the tool call could not be parsed.")
            )  # fmt: skip
        ids.append(str(raw.get("id") or f"call_{i}") if isinstance(raw, dict) else f"call_{i}")
        rendered.append("\n" + block)
    return calls, ids, "".join(rendered)


def _assistant_message(message: Mapping[str, Any], api_calls: list[Any]) -> dict[str, Any]:
    if api_calls:
        return {"role": "assistant", "content": message.get("content"), "tool_calls": api_calls}
    return {"role": "assistant", "content": message.get("content") or ""}
