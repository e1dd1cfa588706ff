"""The policy seam of the episode loop: who writes the assistant turns.

:func:`sandpiper.collector.episode.loop.run_episode` talks to the model only through a :class:`Policy`, which
opens one :class:`PolicySession` per episode. A session renders the opening prompt, samples a
reply, and appends tool results; the loop never sees whether the model sits behind token ids
or behind a chat API. Two implementations:

- :class:`TokenPolicy` — training: token ids in and out through a ``PolicyClient`` (vLLM), the
  prompt rendered once with the tokenizer's chat template, every sampled id, logprob and
  policy version stored (trainable turns).
- ``collector.episode.chat_policy.ChatPolicy`` — evaluation against any OpenAI-compatible chat
  endpoint: text in and out, stored untrainable.

Another entry point (e.g. an OpenAI-compatible gateway in front of the collector) implements
:class:`Policy` and reuses the same loop, tools, answer handling and rewards.

A session never raises for the model's failures: :meth:`PolicySession.reply` returns a
:class:`Stopped` (stop reason and error) when the episode must end before a reply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import numpy as np

from sandpiper.collector.episode.parsers import ParsedToolCall, parse_tool_calls
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.inference.base import PolicyClient, SamplingParams
from sandpiper.collector.inference.vllm_client import ContextLengthExceeded
from sandpiper.config import SamplingLimits
from sandpiper.config.sampling import NoRoom
from sandpiper.errors import SandpiperError
from sandpiper.store.records import Role, StopReason, ToolCallRecord, TurnRecord

_NO_IDS = np.zeros(0, dtype=np.int32)


@dataclass(frozen=True, slots=True)
class Reply:
    """One assistant turn as the loop needs it."""

    text: str
    """Everything the model wrote this turn (tool calls included), as stored and as checked
    for banned patterns."""
    content: str
    """The text outside tool calls: the answer when the turn calls no tool."""
    tool_calls: tuple[ParsedToolCall, ...]
    truncated: StopReason | None = None
    """Set when the turn was cut (``max_tokens`` or ``context_exceeded``): the episode ends."""
    token_ids_T: np.ndarray = field(default_factory=lambda: _NO_IDS)
    logprobs_T: np.ndarray | None = None
    policy_versions_T: np.ndarray | None = None
    trainable: bool = False


@dataclass(frozen=True, slots=True)
class Stopped:
    """The episode ends before a reply (context full, budget spent, model error)."""

    stop: StopReason
    error: str | None = None


class PolicySession(Protocol):
    """One episode's conversation with the policy."""

    trainable: bool
    """Whether the episode's sampled turns can be trained on (token ids and logprobs)."""

    def prompt_turn(self, at: datetime) -> TurnRecord:
        """The opening (system + user) segment, as stored."""
        ...

    async def reply(self) -> Reply | Stopped: ...

    def assistant_turn(
        self,
        index: int,
        reply: Reply,
        tool_calls: Sequence[ToolCallRecord],
        timing: tuple[datetime, float],
    ) -> TurnRecord:
        """Store ``reply`` (with the records of the calls that ran) as turn ``index``."""
        ...

    def add_tool_results(
        self, index: int, messages: Sequence[Mapping[str, Any]], at: datetime, duration_ms: float
    ) -> TurnRecord:
        """Append the tool results of the last reply; return them as turn ``index``."""
        ...


class Policy(Protocol):
    """Opens one session per episode."""

    tools: list[dict[str, Any]]
    """Tool schemas offered to the model; calls to any other tool are refused."""

    def session(self, messages: list[dict[str, Any]], limits: SamplingLimits) -> PolicySession: ...


# ---- token-in / token-out (training) ------------------------------------------------------


class TokenPolicy:
    """Training policy: a ``PolicyClient`` serving token ids and a chat-template renderer."""

    def __init__(self, client: PolicyClient, renderer: ChatRenderer) -> None:
        self.client = client
        self.renderer = renderer
        self.tools = renderer.tools

    def session(self, messages: list[dict[str, Any]], limits: SamplingLimits) -> TokenSession:
        return TokenSession(self.client, self.renderer, messages, limits)


class TokenSession:
    """Renders the prompt once, then only appends sampled ids and tool-result deltas."""

    trainable = True

    def __init__(
        self,
        client: PolicyClient,
        renderer: ChatRenderer,
        messages: list[dict[str, Any]],
        limits: SamplingLimits,
    ) -> None:
        self.client, self.renderer, self.limits = client, renderer, limits
        self.prompt_ids = renderer.prompt_ids(messages)
        self.context_ids: list[int] = list(self.prompt_ids)
        self.completion_tokens = 0
        self._ended_with_eos = True

    def prompt_turn(self, at: datetime) -> TurnRecord:
        return _segment(0, Role.USER, self.renderer, self.prompt_ids, at, 0.0)

    async def reply(self) -> Reply | Stopped:
        limits, renderer = self.limits, self.renderer
        request = limits.reply_request(
            prompt_tokens=len(self.context_ids), sampled_tokens=self.completion_tokens
        )
        if isinstance(request, NoRoom):
            return Stopped(StopReason(request.reason))
        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            stop_token_ids=renderer.stop_token_ids,
        )
        try:
            generation = await self.client.generate(list(self.context_ids), params)
        except ContextLengthExceeded:
            return Stopped(StopReason.CONTEXT_EXCEEDED)  # the policy's doing: a valid episode
        except SandpiperError as e:
            return Stopped(StopReason.MODEL_ERROR, f"inference: {e}")
        ids = np.asarray(generation.token_ids_T, dtype=np.int32)
        if generation.finish_reason == "abort" or len(ids) == 0:
            error = f"inference: finish_reason={generation.finish_reason!r}, no tokens"
            return Stopped(StopReason.MODEL_ERROR, error)
        text = renderer.decode(ids.tolist())
        self._ended_with_eos = bool(ids[-1] in renderer.stop_token_ids)
        self.context_ids.extend(int(i) for i in ids)
        self.completion_tokens += len(ids)
        truncated = None
        if generation.finish_reason == "length" or not self._ended_with_eos:
            # A truncated turn cannot be continued with a well-formed tool delta.
            full = len(self.context_ids) >= limits.context_limit
            truncated = StopReason.CONTEXT_EXCEEDED if full else StopReason.MAX_TOKENS
        parsed = parse_tool_calls(
            renderer.strip_eos(text),
            limits.tool_format,
            tool_schemas=renderer.tools,
            max_argument_bytes=limits.max_argument_bytes,
        )
        return Reply(
            text=text,
            content=parsed.content,
            tool_calls=tuple(parsed.tool_calls),
            truncated=truncated,
            token_ids_T=ids,
            logprobs_T=np.asarray(generation.logprobs_T, dtype=np.float32),
            policy_versions_T=np.asarray(generation.policy_versions_T, dtype=np.int32),
            trainable=True,
        )

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
        delta = self.renderer.tool_delta_ids(messages, ended_with_eos=self._ended_with_eos)
        self.context_ids.extend(delta)
        return _segment(index, Role.TOOL, self.renderer, delta, at, duration_ms)


def assistant_record(
    index: int,
    reply: Reply,
    tool_calls: Sequence[ToolCallRecord],
    timing: tuple[datetime, float],
) -> TurnRecord:
    """The stored assistant turn; ``timing`` is (request start, generation duration in ms)."""
    return TurnRecord(
        index=index,
        role=Role.ASSISTANT,
        text=reply.text,
        token_ids_T=reply.token_ids_T,
        logprobs_T=reply.logprobs_T,
        policy_versions_T=reply.policy_versions_T,
        trainable=reply.trainable,
        started_at=timing[0],
        duration_ms=timing[1],
        tool_calls=tuple(tool_calls),
    )


def _segment(
    index: int,
    role: Role,
    renderer: ChatRenderer,
    ids: Sequence[int],
    at: datetime,
    duration_ms: float,
) -> TurnRecord:
    return TurnRecord(
        index=index,
        role=role,
        text=renderer.decode(ids),
        token_ids_T=np.asarray(ids, dtype=np.int32),
        logprobs_T=None,
        policy_versions_T=None,
        trainable=False,
        started_at=at,
        duration_ms=duration_ms,
    )


def text_turn(
    index: int, role: Role, text: str, at: datetime | None = None, duration_ms: float = 0.0
) -> TurnRecord:
    """An untrainable text-only turn (no token ids): chat-API episodes."""
    kwargs: dict[str, Any] = {"started_at": at} if at is not None else {}
    return TurnRecord(
        index=index,
        role=role,
        text=text,
        token_ids_T=_NO_IDS,
        logprobs_T=None,
        policy_versions_T=None,
        trainable=False,
        duration_ms=duration_ms,
        **kwargs,
    )
