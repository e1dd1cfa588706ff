"""One episode's calls through the gateway: prompt construction, token splicing, records.

An unmodified agent sends its whole conversation as OpenAI messages on every call. To train
on exactly what the model saw and sampled, the prompt of each call is built the way the
native loop builds it (:mod:`sandpiper.collector.render`) whenever the agent's history allows it:

- **Extends.** The request's messages start with the previous call's messages plus the
  assistant message the gateway returned for it (compared by role, content and tool calls),
  followed by new messages (tool results, a user turn). The prompt is then the previous
  call's prompt ids + the ids the model sampled (exactly, not re-tokenized) + the new
  messages rendered as a delta (:meth:`ChatRenderer.tool_delta_ids`), just as the native
  loop appends tool results. The episode's token sequence only grows. A reply cut off by
  ``max_tokens`` extends the same way: its ids stay as sampled, and the delta opens with the
  template's whole closing text, which the model did not sample.
- **Restarts.** Anything else (the agent rewrote, truncated or summarised its history, or a
  completions call whose prompt is not an extension) is rendered from scratch with the chat
  template: a new *segment* that starts a new training sequence sharing the episode's
  advantage. Why the history did not extend is recorded (``restart_reason``).

For every extending call the gateway also renders the messages from scratch and records
whether plain re-tokenization would have produced different ids (``retokenized_differs``):
the model saw the spliced ids, so training is exact, but an analyst sees how often a naive
gateway would have trained on tokens the model never sampled.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sandpiper.collector.gateway.openai_api import fast_loads
from sandpiper.collector.inference.base import Generation
from sandpiper.collector.parsers import ParsedToolCall
from sandpiper.collector.render import ChatRenderer, canonical_json, tools_key
from sandpiper.store.records import StopReason


@dataclass(slots=True)
class GatewayCall:
    """One model call of an episode, as sent to vLLM and as sampled."""

    index: int
    endpoint: str
    """``chat`` or ``completions``."""
    prompt_ids: tuple[int, ...]
    """Exactly the ids sent to the server."""
    extends: bool
    """True when ``prompt_ids`` = previous prompt + previous sampled ids + ``delta_ids``."""
    delta_ids: tuple[int, ...]
    """Ids appended after the previous call's sampled ids (empty unless ``extends``)."""
    restart_reason: str | None
    """Why a call did not extend the previous one (None for the first call and extensions)."""
    retokenized_differs: bool
    """A from-scratch render of the messages would have given other ids than the splice
    (filled in when the episode closes: await :meth:`EpisodeSession.settle`)."""
    generation: Generation
    text: str
    """Decoded sampled text (end-of-turn token included when sampled)."""
    tool_calls: tuple[ParsedToolCall, ...]
    started_at: datetime
    duration_ms: float
    """The model call's time: the PolicyClient's ``generate`` alone. The native loop's turns
    also count their decoding and parsing (~0.05 ms)."""
    tool_outputs: dict[str, str] = field(default_factory=dict)
    """Tool results the agent sent back in the next call, by tool-call id."""


def normalise(message: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of an OpenAI message that change what the model sees, in a comparable form."""
    out: dict[str, Any] = {"role": message.get("role"), "content": _content(message)}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            (c.get("function", {}).get("name"), _arguments(c.get("function", {}).get("arguments")))
            for c in calls
        ]
    if message.get("role") == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    return out


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI message as HF chat templates expect it (arguments as objects, text content)."""
    out: dict[str, Any] = {"role": message["role"], "content": _content(message)}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "type": "function",
                "id": c.get("id"),
                "function": {
                    "name": c["function"]["name"],
                    "arguments": _arguments(c["function"].get("arguments")),
                },
            }
            for c in message["tool_calls"]
        ]
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # A list of content parts: only text parts are supported (checked at the API edge).
    return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        parsed = fast_loads(arguments)  # every call compares the whole history: fast path
        if parsed is not None:
            return parsed
        try:  # what orjson refuses or may change (NaN, huge integers, lone surrogates)
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments if arguments is not None else {}


_FRESH_CACHE: OrderedDict[tuple[int, bytes], list[int]] = OrderedDict()
_FRESH_CACHE_SIZE = 256


def _fresh_ids(
    renderer: ChatRenderer,
    messages: list[dict[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    tools_key: bytes,
    *,
    cached: bool = True,
) -> list[int]:
    """Token ids of ``messages`` rendered from scratch; the episodes of a GRPO group open
    with the same messages, so first calls are served from a small LRU cache. The
    re-tokenization checks (``cached=False``) render histories no other call sends again:
    kept, they would push the first calls out."""
    if not cached:
        return renderer.encode(renderer.render(messages, add_generation_prompt=True, tools=tools))
    key = (id(renderer), tools_key + canonical_json(messages))
    ids = _FRESH_CACHE.get(key)
    if ids is None:
        ids = renderer.encode(renderer.render(messages, add_generation_prompt=True, tools=tools))
        _FRESH_CACHE[key] = ids
        if len(_FRESH_CACHE) > _FRESH_CACHE_SIZE:
            _FRESH_CACHE.popitem(last=False)
    else:
        _FRESH_CACHE.move_to_end(key)
    return list(ids)


class BudgetSpent(Exception):
    """A call refused because the episode's turn or token budget is spent."""


class EpisodeSession:
    """Builds prompts for one episode's calls and keeps their records (single-threaded use:
    the server serialises calls of one episode with a lock)."""

    def __init__(self, episode_id: str, renderer: ChatRenderer) -> None:
        self.episode_id = episode_id
        self.renderer = renderer
        self.calls: list[GatewayCall] = []
        self._history: list[dict[str, Any]] | None = None
        """Normalised messages of the last chat call plus the assistant message returned."""
        self._sent: Sequence[Mapping[str, Any]] = ()
        """The last chat call's messages as the agent sent them: a message equal to its
        counterpart there needs no normalising to be compared (agents resend their history
        unchanged, so a call normalises only its new messages, not the whole history)."""
        self._context: list[int] = []
        """Prompt ids + sampled ids of the last call."""
        self._ended_with_eos = True
        self._tools_key: bytes | None = None
        self.max_calls: int | None = None
        """Model calls allowed (the run's ``max_turns``); None = unlimited."""
        self.max_completion_tokens: int | None = None
        """Sampled tokens allowed over the episode; None = unlimited."""
        self.completion_tokens = 0
        self._checks: list[tuple[GatewayCall, Callable[[], bool]]] = []
        self.budget_spent: StopReason | None = None
        """Set when a call was refused because a budget was spent (the episode's stop)."""

    def check_later(self, call: GatewayCall, check: Callable[[], bool]) -> None:
        """Keep the re-tokenization ``check`` of ``call`` for :meth:`settle`.

        Not run per call, even in a background thread: it renders the whole conversation
        from scratch through the chat template (~0.2 ms per check with the renderer's piece
        cache, ~0.75 ms before it, against ~0.25 ms for the rest of a call, measured by
        bench/gateway_bench.py) and, in a thread, holds the GIL against the next request of
        this and every other episode. At episode end it delays nothing."""
        self._checks.append((call, check))

    async def settle(self) -> None:
        """Run the pending re-tokenization checks in one worker thread (call before
        assembling the episode)."""
        checks, self._checks = self._checks, []
        if not checks:
            return

        def run_all() -> list[bool]:
            return [check() for _, check in checks]

        for (call, _), differs in zip(checks, await asyncio.to_thread(run_all), strict=True):
            call.retokenized_differs = differs

    def check_budget(self, asked_max_tokens: int) -> int:
        """The max_tokens this call may use; raises BudgetSpent when none is left."""
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self.budget_spent = StopReason.MAX_TURNS
            raise BudgetSpent(f"the episode's {self.max_calls} model calls are spent")
        if self.max_completion_tokens is None:
            return asked_max_tokens
        left = self.max_completion_tokens - self.completion_tokens
        if left <= 0:
            self.budget_spent = StopReason.MAX_TOKENS
            raise BudgetSpent(
                f"the episode's {self.max_completion_tokens} sampled tokens are spent"
            )
        return min(asked_max_tokens, left)

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
    ) -> tuple[list[int], bool, list[int], str | None, Callable[[], bool] | None]:
        """(prompt ids, extends, delta ids, restart reason, check).

        ``check`` (None unless the call extends) renders the messages from scratch and says
        whether that differs from the splice; the server runs it after replying
        (:meth:`check_later`), so it adds no latency."""
        key = tools_key(tools)
        reason = self._why_not_extending(messages, key)
        self._tools_key = key
        if reason is not None:
            templ = [template_message(m) for m in messages]
            fresh = _fresh_ids(self.renderer, templ, tools, key)
            return fresh, False, [], (None if not self.calls else reason), None
        assert self._history is not None
        new = [template_message(m) for m in messages[len(self._history) :]]
        delta = self.renderer.tool_delta_ids(new, ended_with_eos=self._ended_with_eos, tools=tools)
        prompt = [*self._context, *delta]

        def differs() -> bool:  # at episode close: the whole history's template form then
            templ = [template_message(m) for m in messages]
            return prompt != _fresh_ids(self.renderer, templ, tools, key, cached=False)

        return prompt, True, delta, None, differs

    def _why_not_extending(
        self, messages: Sequence[Mapping[str, Any]], tools_key: bytes
    ) -> str | None:
        if self._history is None:
            return "first call" if not self.calls else "previous call was not a chat call"
        if tools_key != self._tools_key:
            return "the tools changed"
        n = len(self._history)
        if len(messages) <= n:
            return "the history is not longer than the previous call's"
        sent = self._sent
        for i, (want, got) in enumerate(zip(self._history, messages, strict=False)):
            if (i >= len(sent) or got != sent[i]) and normalise(got) != want:
                return f"message {i} differs from what the model saw"
        if any(m.get("role") == "assistant" for m in messages[n:]):
            return "the new messages include an assistant message the model did not sample"
        return None

    def record(
        self,
        *,
        endpoint: str,
        prompt_ids: list[int],
        extends: bool,
        delta_ids: list[int],
        restart_reason: str | None,
        retokenized_differs: bool,
        generation: Generation,
        text: str,
        tool_calls: tuple[ParsedToolCall, ...],
        started_at: datetime,
        duration_ms: float,
        messages: Sequence[Mapping[str, Any]] | None,
        returned: Mapping[str, Any] | None,
    ) -> GatewayCall:
        """Keep one call; ``messages``/``returned`` are the chat request and reply (None for
        completions, which never extend a chat history)."""
        if messages is not None:
            self._attach_tool_outputs(messages)
        call = GatewayCall(
            index=len(self.calls),
            endpoint=endpoint,
            prompt_ids=tuple(prompt_ids),
            extends=extends,
            delta_ids=tuple(delta_ids),
            restart_reason=restart_reason,
            retokenized_differs=retokenized_differs,
            generation=generation,
            text=text,
            tool_calls=tool_calls,
            started_at=started_at,
            duration_ms=duration_ms,
        )
        self.calls.append(call)
        sampled = [int(t) for t in generation.token_ids_T]
        self.completion_tokens += len(sampled)
        self._context = [*prompt_ids, *sampled]
        self._ended_with_eos = bool(sampled) and sampled[-1] in self.renderer.stop_token_ids
        # A turn cut off by max_tokens is continued like any other: its ids stay in the
        # context as sampled, and the next delta opens with the template's whole closing
        # text (``ended_with_eos`` False), where a from-scratch render closes the assistant
        # message the agent echoes back.
        if messages is None or returned is None:
            self._history, self._sent = None, ()  # a completions call: no chat history
        else:
            # an extending call's messages start with the history (compared equal just now)
            kept = self._history if extends and self._history is not None else []
            fresh = [normalise(m) for m in messages[len(kept) :]]
            self._history = [*kept, *fresh, normalise(returned)]
            self._sent = messages
        return call

    def _attach_tool_outputs(self, messages: Sequence[Mapping[str, Any]]) -> None:
        if not self.calls:
            return
        last = self.calls[-1]
        for m in messages:
            if m.get("role") == "tool" and m.get("tool_call_id"):
                last.tool_outputs[str(m["tool_call_id"])] = _content(m)
