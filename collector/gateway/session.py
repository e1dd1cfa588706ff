"""One episode's calls through the gateway: prompt construction, token splicing, records.

An unmodified agent sends its whole conversation as OpenAI messages on every call. To train
on exactly what the model saw and sampled, the prompt of each call is built the way the
native loop builds it (:mod:`sandpiper.collector.episode.render`) whenever the agent's history allows it:

- **Extends.** The request's messages start with an earlier call's messages plus the
  assistant message the gateway returned for it (compared by role, content and tool calls),
  followed by new messages (tool results, a user turn). The prompt is then that call's
  prompt ids + the ids the model sampled (exactly, not re-tokenized) + the new messages
  rendered as a delta (:meth:`ChatRenderer.tool_delta_ids`), just as the native loop
  appends tool results. Of all earlier calls, the one with the longest history the request
  starts with is extended (a prefix tree): an agent that runs a sub-agent between two of
  its own calls, or compacts its history and later calls from it, keeps each branch one
  growing token sequence. A reply cut off by ``max_tokens`` extends the same way: its ids
  stay as sampled, and the delta opens with the template's whole closing text, which the
  model did not sample.
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
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sandpiper.collector.episode.parsers import ParsedToolCall
from sandpiper.collector.episode.render import ChatRenderer, canonical_json, tools_key
from sandpiper.collector.gateway.openai_api import fast_loads
from sandpiper.collector.inference.base import Generation
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
    """Tool results the agent sent back in a later call, by tool-call id."""
    parent: int | None = None
    """Index of the call this one extends (None unless ``extends``)."""


@dataclass(slots=True)
class _Branch:
    """What one chat call leaves for later calls to extend: the conversation the model saw."""

    call: int
    history: list[dict[str, Any]]
    """Normalised messages of the call plus the assistant message returned."""
    sent: Sequence[Mapping[str, Any]]
    """The call's messages as the agent sent them: a message equal to its counterpart there
    needs no normalising to be compared (agents resend their history unchanged, so a call
    normalises only its new messages, not the whole history)."""
    tools_key: bytes


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


_CALL_ID = re.compile(r"call_(\d+)_\d+")
"""A tool-call id the gateway gave: ``call_<call index>_<tool index>``."""

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


def _why_not_extending(
    branch: _Branch, messages: Sequence[Mapping[str, Any]], tools_key: bytes
) -> str | None:
    if tools_key != branch.tools_key:
        return "the tools changed"
    n = len(branch.history)
    if len(messages) <= n:
        return "the history is not longer than the previous call's"
    sent = branch.sent
    for i, (want, got) in enumerate(zip(branch.history, messages, strict=False)):
        if (i >= len(sent) or got != sent[i]) and normalise(got) != want:
            return f"message {i} differs from what the model saw"
    if any(m.get("role") == "assistant" for m in messages[n:]):
        return "the new messages include an assistant message the model did not sample"
    return None


class BudgetSpent(Exception):
    """A call refused because the episode's turn or token budget is spent."""


class EpisodeSession:
    """Builds prompts for one episode's calls and keeps their records (single-threaded use:
    the server serialises calls of one episode with a lock)."""

    def __init__(self, episode_id: str, renderer: ChatRenderer) -> None:
        self.episode_id = episode_id
        self.renderer = renderer
        self.calls: list[GatewayCall] = []
        self._branches: list[_Branch] = []
        """One per chat call, in call order: the prefixes a later call may extend."""
        self._parent: _Branch | None = None
        """The branch the last :meth:`chat_prompt` extends (None: rendered from scratch)."""
        self._tools_key = b""
        self.max_calls: int | None = None
        """Model calls allowed (the run's ``max_turns``); None = unlimited."""
        self.max_completion_tokens: int | None = None
        """Sampled tokens allowed over the episode; None = unlimited."""
        self.completion_tokens = 0
        self._checks: list[tuple[GatewayCall, Callable[[], bool]]] = []
        self.api_state: dict[str, Any] = {}
        """State an API keeps for the episode's calls (the Responses API's stored
        responses, say): it lives and goes with the episode."""
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

    def check_turns(self) -> None:
        """Raises BudgetSpent when the episode's model calls are spent. Its sampled-token
        budget (``max_completion_tokens``) bounds each reply through the run's one formula
        (``SamplingLimits.reply_request``), which says when it is spent
        (:meth:`tokens_spent`)."""
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self.budget_spent = StopReason.MAX_TURNS
            raise BudgetSpent(f"the episode's {self.max_calls} model calls are spent")

    def tokens_spent(self) -> BudgetSpent:
        """Mark the episode's sampled-token budget spent; the refusal to raise."""
        self.budget_spent = StopReason.MAX_TOKENS
        return BudgetSpent(f"the episode's {self.max_completion_tokens} sampled tokens are spent")

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
    ) -> tuple[list[int], bool, list[int], str | None, Callable[[], bool] | None]:
        """(prompt ids, extends, delta ids, restart reason, check).

        ``check`` (None unless the call extends) renders the messages from scratch and says
        whether that differs from the splice; the server runs it after replying
        (:meth:`check_later`), so it adds no latency."""
        key = tools_key(tools)
        self._tools_key = key
        parent, reason = self._longest_prefix(messages, key)
        self._parent = parent
        if parent is None:
            templ = [template_message(m) for m in messages]
            fresh = _fresh_ids(self.renderer, templ, tools, key)
            return fresh, False, [], (None if not self.calls else reason), None
        base = self.calls[parent.call]
        sampled = [int(t) for t in base.generation.token_ids_T]
        ended_with_eos = bool(sampled) and sampled[-1] in self.renderer.stop_token_ids
        # A turn cut off by max_tokens is continued like any other: its ids stay in the
        # context as sampled, and the delta opens with the template's whole closing text
        # (``ended_with_eos`` False), where a from-scratch render closes the assistant
        # message the agent echoes back.
        new = [template_message(m) for m in messages[len(parent.history) :]]
        delta = self.renderer.tool_delta_ids(new, ended_with_eos=ended_with_eos, tools=tools)
        prompt = [*base.prompt_ids, *sampled, *delta]

        def differs() -> bool:  # at episode close: the whole history's template form then
            templ = [template_message(m) for m in messages]
            return prompt != _fresh_ids(self.renderer, templ, tools, key, cached=False)

        return prompt, True, delta, None, differs

    def _longest_prefix(
        self, messages: Sequence[Mapping[str, Any]], tools_key: bytes
    ) -> tuple[_Branch | None, str | None]:
        """(the branch with the longest history that ``messages`` extend, None), or (None,
        why the latest chat call is not extended). Branches are tried longest first, the
        latest first among equals: an agent that extends its last call (the common case)
        costs one comparison, and a shorter history is rejected by its length alone."""
        if not self._branches:
            return None, ("first call" if not self.calls else "no earlier chat call")
        order = sorted(self._branches, key=lambda b: (len(b.history), b.call), reverse=True)
        for branch in order:
            if _why_not_extending(branch, messages, tools_key) is None:
                return branch, None
        return None, _why_not_extending(self._branches[-1], messages, tools_key)

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
        self.completion_tokens += len(generation.token_ids_T)
        if messages is None or returned is None:  # a completions call: it extends the last
            call.parent = call.index - 1 if extends else None
            return call
        parent = self._parent if extends else None
        call.parent = parent.call if parent is not None else None
        # an extending call's messages start with the parent's history (compared equal)
        kept = parent.history if parent is not None else []
        fresh = [normalise(m) for m in messages[len(kept) :]]
        self._branches.append(
            _Branch(call.index, [*kept, *fresh, normalise(returned)], messages, self._tools_key)
        )
        return call

    def _attach_tool_outputs(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Tool results go to the call whose tool call they answer (named by its id, see
        :func:`~sandpiper.collector.gateway.assembly.call_id`; else the latest call)."""
        if not self.calls:
            return
        for m in messages:
            if m.get("role") == "tool" and m.get("tool_call_id"):
                tool_id = str(m["tool_call_id"])
                match = _CALL_ID.fullmatch(tool_id)
                index = int(match.group(1)) if match else len(self.calls) - 1
                if index < len(self.calls):
                    self.calls[index].tool_outputs[tool_id] = _content(m)
