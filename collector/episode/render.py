"""Token-in / token-out prompt construction with the tokenizer's chat template.

The chat template is rendered **once**, for the initial prompt (system + user + tool
schemas). After that the context only grows by appending token ids:

1. the ids the policy sampled (stored as they came back from the server, stop token
   included), then
2. the tool-result segment, rendered as a *delta* and tokenized once.

How the delta is made, and why the sequence stays identical to what the model saw: we render
a fixed probe conversation ``[user, assistant(PROBE)]`` without a generation prompt (text
``A``) and the same conversation plus the new tool messages with a generation prompt (text
``B``). The template is append-only for these roles, so ``B`` starts with ``A`` and
``B[len(A):]`` is exactly the text the template puts after a finished assistant turn for
these tool messages. The template's text between the assistant content and the end of ``A``
(e.g. ``<|im_end|>\\n``) starts with the end-of-turn token the model itself sampled; what
follows that token (the ``\\n``) belongs to the delta. The delta text is tokenized once
(special tokens recognised), stored as a ``tool`` turn with ``trainable=False``, and appended
to the context. The next request sends ``prompt + sampled + delta + sampled + ...``: the
concatenation of the stored turns, never a re-tokenization of the whole conversation.

Two settings change what is rendered (:func:`renderer_for` reads them from the config):

- ``chat_template``: a Jinja template that replaces the tokenizer's own (a model whose
  template has no tools, or one whose template re-renders history differently);
- ``action_format``: with ``bash_block`` the tool schemas are *not* rendered (the template
  may not support them; the system prompt describes the protocol instead) and tool results
  return as a plain user turn (:func:`sandpiper.collector.episode.parsers.format_observation`).

``tests/unit/collector/episode/test_render.py`` proves, for every shipped template and format, that the
rendering of turn ``k`` is a token prefix of the rendering of turn ``k + 1``.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from sandpiper.collector.episode.client_tools import PLAIN_TEXT_FORMATS, plain_history
from sandpiper.collector.episode.parsers import ToolFormat, format_observation
from sandpiper.errors import ConfigError, InferenceError

if TYPE_CHECKING:
    from sandpiper.config import CollectorSettings

_PROBE = "\u2063probe\u2063"
"""Assistant content of the probe conversation (invisible separators: cannot collide)."""
_PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
"""The tool offered in the self-check of a renderer without tools of its own."""


class ChatRenderer:
    """Renders prompts and tool-result deltas for one tokenizer and tool set."""

    def __init__(
        self,
        tokenizer: Any,
        tool_schemas: Sequence[Mapping[str, Any]] = (),
        *,
        chat_template: str | None = None,
        action_format: ToolFormat = "hermes",
    ) -> None:
        if not chat_template and not getattr(tokenizer, "chat_template", None):
            raise InferenceError("the tokenizer has no chat template (set inference.chat_template)")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        """Template text used instead of the tokenizer's; None = the tokenizer's own."""
        self.action_format: ToolFormat = action_format
        self.tools = [dict(t) for t in tool_schemas]
        """Schemas of the tools offered (rendered into the prompt unless ``bash_block``)."""
        eos = tokenizer.eos_token
        if eos is None:
            raise InferenceError("the tokenizer has no EOS token (end of assistant turn)")
        self.eos_text: str = eos
        self.stop_token_ids: tuple[int, ...] = (int(tokenizer.convert_tokens_to_ids(eos)),)
        """Token ids that end an assistant turn (sent as stop tokens to the server)."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}]
        self._probe = probe
        self._pieces = _PieceEncoder.for_tokenizer(tokenizer)
        self._probe_text = self.render(probe, add_generation_prompt=False)
        tail = self._probe_text[self._probe_text.rindex(_PROBE) + len(_PROBE) :]
        cut = tail.find(self.eos_text)
        # Text the template adds after the end-of-turn token the model sampled ("\n").
        self._after_eos = tail[cut + len(self.eos_text) :] if cut >= 0 else tail
        self._after_content = tail
        self._probe_cache: dict[bytes, str] = {}
        if self._pieces is not None and not self._pieces.agrees(self._self_check_texts()):
            self._pieces = None
        self._bare_probe_text = self.render(probe, add_generation_prompt=False, tools=[])
        self._delta_without_tools = self._tools_only_before_the_probe()
        """Render deltas without the tool schemas: the template puts the schemas before the
        conversation (as the common templates do), so a delta's text is the same with or
        without them and the schemas' JSON is not rendered again on every call."""

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Template text of ``messages``; ``tools`` overrides the renderer's tool schemas
        (the gateway renders each request with the tools its client sent). The bash-block
        format renders no tool schemas: the native loop's protocol is in its system prompt,
        and a gateway client's ``tools`` are described as text
        (:func:`sandpiper.collector.episode.client_tools.plain_history`)."""
        rendered_tools = self.tools if tools is None else [dict(t) for t in tools]
        if self.action_format in PLAIN_TEXT_FORMATS:
            if tools:
                messages = plain_history(messages, tools)
            rendered_tools = []
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=rendered_tools or None,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added): the tokenizer's own ids, through a
        cache of the pieces between added tokens when that is exact (:class:`_PieceEncoder`)."""
        if self._pieces is not None:
            return self._pieces.encode(text)
        return self._encode_whole(text)

    def _encode_whole(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _self_check_texts(self) -> list[str]:
        """Renders of this template to compare piece-wise and whole encoding on: a whole
        conversation with the renderer's tools, a tool call and a tool result."""
        call = {"type": "function", "id": "call_0_0",
                "function": {"name": "probe", "arguments": {"x": " é\u0301 1"}}}  # fmt: skip
        conversation: list[dict[str, Any]] = [
            {"role": "system", "content": " System  text.\n"},
            {"role": "user", "content": "Ünïcode\u0301 x  \n\n y"},
            {"role": "assistant", "content": " ok\n", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0_0", "content": "\n out \n"},
        ]
        texts = [self._probe_text]
        with contextlib.suppress(Exception):  # a template refusing this shape: the probe decides
            texts.append(self.render(conversation, add_generation_prompt=True))
        return texts

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of the initial prompt, ending with the assistant generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def tool_delta_ids(
        self,
        tool_messages: Sequence[Mapping[str, Any]],
        *,
        ended_with_eos: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Ids to append after a finished assistant turn: the tool results and the next
        generation prompt. ``ended_with_eos`` is False when the sampled turn did not end
        with the end-of-turn token (the template's whole closing text is then added)."""
        if self.action_format in PLAIN_TEXT_FORMATS:
            tool_messages = _observation_turns(tool_messages)
        lead = self._after_eos if ended_with_eos else self._after_content
        return self.encode(lead + self._delta_text(tool_messages, tools, self._delta_without_tools))

    def _delta_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        without_tools: bool,
    ) -> str:
        """Template text that ``messages`` add after the probe conversation's turn, with the
        generation prompt (rendered without the tool schemas when ``without_tools``)."""
        if without_tools:
            tools, probe_text = [], self._bare_probe_text
        else:
            probe_text = self._probe_text if tools is None else self._probe_with(tools)
        full = self.render([*self._probe, *messages], add_generation_prompt=True, tools=tools)
        if not full.startswith(probe_text):
            raise InferenceError("the chat template is not append-only for tool messages")
        return full[len(probe_text) :]

    def _tools_only_before_the_probe(self) -> bool:
        """Whether deltas render the same without the tool schemas, on tool results (one and
        two), a user turn and a tool-call turn, with the renderer's tools (or a probe tool)."""
        if self.action_format == "bash_block":
            return True  # no schemas are rendered at all
        tools = self.tools or [_PROBE_TOOL]
        call = {"type": "function", "id": "call_0_0",
                "function": {"name": _PROBE_TOOL["function"]["name"], "arguments": {"x": "1"}}}  # fmt: skip
        samples: list[list[dict[str, Any]]] = [
            [{"role": "tool", "tool_call_id": "call_0_0", "content": " out\n"}],
            [{"role": "tool", "tool_call_id": "call_0_0", "content": "a"},
             {"role": "tool", "tool_call_id": "call_0_1", "content": "b"}],
            [{"role": "user", "content": "next"}],
            [{"role": "tool", "tool_call_id": "call_0_0", "content": "c"},
             {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_0_0", "content": "d"}],
        ]  # fmt: skip
        try:
            return all(
                self._delta_text(m, tools, True) == self._delta_text(m, tools, False)
                for m in samples
            )
        except Exception:  # a template refusing a sample: keep rendering the schemas
            return False

    def _probe_with(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """The probe conversation's text with other tools (cached: the gateway renders a
        delta on every call of an episode with the same tools)."""
        key = tools_key(tools)
        if key not in self._probe_cache:
            if len(self._probe_cache) > 64:
                self._probe_cache.clear()
            self._probe_cache[key] = self.render(
                self._probe, add_generation_prompt=False, tools=tools
            )
        return self._probe_cache[key]

    def strip_eos(self, text: str) -> str:
        return text.removesuffix(self.eos_text)


def tools_key(tools: Iterable[Mapping[str, Any]]) -> bytes:
    """A canonical JSON form of tool schemas (to tell whether two requests' tools differ)."""
    return canonical_json(list(tools))


def canonical_json(value: Any) -> bytes:
    """``value`` as JSON with sorted keys (objects that JSON cannot hold as ``str()``): an
    equality key. orjson is ~10x faster than the json module; what it cannot encode (an
    integer past 64 bits) falls back to json."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS, default=str)
    except TypeError:
        return json.dumps(value, sort_keys=True, default=str).encode()


PIECE_CACHE_CHARS = 2_000_000
"""Characters of text pieces whose ids a renderer's :class:`_PieceEncoder` keeps, least
recently used out first: room for the system prompts and tool schemas of a run and the tool
results of its open episodes (for their close-time checks). At 3–4 characters a token and
~36 bytes a kept id (a tuple slot and an int object), up to ~20–25 MB per renderer."""


class _PieceEncoder:
    """Encodes a text as the ids of its pieces between added tokens, each piece's ids cached.

    Why: every episode of a run opens with the same system prompt and tool schemas, and every
    call of an episode appends the same template text around its tool results, so most of
    what the gateway encodes has been encoded before (a first prompt of the tiny model took
    ~0.6 ms to encode, most of a call's CPU). At episode close the from-scratch re-render of
    the whole history (the re-tokenization check) finds its tool results and template text
    cached as well.

    Why it is exact: a fast (Rust) tokenizer first cuts the text at its added tokens
    (``<|im_start|>``, ``<tool_call>``, ...), then normalizes, pre-tokenizes and encodes each
    piece on its own, so the ids of a text are its pieces' ids in order. That fails when an
    added token eats neighbouring whitespace (``lstrip``/``rstrip``/``single_word``), when
    added tokens are not split out (``split_special_tokens``), when the pre-tokenizer treats
    the start of a text differently from the start of a piece (``Metaspace`` with
    ``prepend_scheme: first``), or for a tokenizer that is not a fast one:
    :meth:`for_tokenizer` returns None then. Pieces are cut where the tokenizer cuts them
    (the leftmost, longest added token), and the renderer compares both ways on renders of
    its own template before using it (:meth:`agrees`); ``tests/unit/collector/episode/test_render_pieces.py``
    compares them on the shipped templates and tokenizers.
    """

    def __init__(self, tokenizer: Any, tokens: dict[str, int]) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens
        alternatives = sorted(tokens, key=len, reverse=True)  # longest first: leftmost-longest
        self.split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")").split
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cache_chars = 0
        self._lock = threading.Lock()
        """The re-tokenization checks run in a worker thread while the event loop encodes."""

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> _PieceEncoder | None:
        """The encoder, or None when piece-wise encoding may differ (see the class doc)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        added = getattr(tokenizer, "added_tokens_decoder", None)
        if backend is None or not isinstance(added, dict) or not added:
            return None
        if getattr(tokenizer, "split_special_tokens", False):
            return None
        tokens: dict[str, int] = {}
        for token_id, token in added.items():
            if token.lstrip or token.rstrip or token.single_word:
                return None
            if not token.normalized:  # normalized ones are matched inside a piece
                tokens[str(token.content)] = int(token_id)
        try:
            config = json.loads(backend.to_str())
        except (ValueError, AttributeError):
            return None
        if not tokens or _has_first_only_prefix(config.get("pre_tokenizer")):
            return None
        return cls(tokenizer, tokens)

    def agrees(self, texts: Iterable[str]) -> bool:
        """Whether piece-wise encoding gives the tokenizer's own ids on ``texts``."""
        return all(
            self.encode(t, keep=False) == list(self.tokenizer.encode(t, add_special_tokens=False))
            for t in texts
        )

    def encode(self, text: str, *, keep: bool = True) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(self.split(text)):
            if i % 2:  # the split's odd items are the added tokens it cut at
                ids.append(self.tokens[piece])
            elif piece:
                ids.extend(self._piece(piece, keep))
        return ids

    def _piece(self, piece: str, keep: bool) -> tuple[int, ...]:
        cache = self._cache
        with self._lock:
            ids = cache.get(piece)
            if ids is not None:
                cache.move_to_end(piece)
                return ids
        ids = tuple(self.tokenizer.encode(piece, add_special_tokens=False))
        if not keep or len(piece) > PIECE_CACHE_CHARS // 4:
            return ids
        with self._lock:
            if piece not in cache:
                cache[piece] = ids
                self._cache_chars += len(piece)
            while self._cache_chars > PIECE_CACHE_CHARS:
                old, _ = cache.popitem(last=False)
                self._cache_chars -= len(old)
        return ids


def _has_first_only_prefix(pre_tokenizer: Any) -> bool:
    """A pre-tokenizer (or one in a sequence) that adds a prefix only at a text's start."""
    if isinstance(pre_tokenizer, dict):
        scheme = pre_tokenizer.get("prepend_scheme")  # absent in old files: check to be safe
        if pre_tokenizer.get("type") == "Metaspace" and scheme not in ("always", "never"):
            return True
        return any(_has_first_only_prefix(v) for v in pre_tokenizer.values())
    if isinstance(pre_tokenizer, list):
        return any(_has_first_only_prefix(v) for v in pre_tokenizer)
    return False


def _observation_turns(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """bash_block: each run of tool messages as one user turn (:func:`_as_user_turn`); other
    messages (a gateway client's own user turn) as they are."""
    out: list[Mapping[str, Any]] = []
    run: list[Mapping[str, Any]] = []
    for m in [*messages, {"role": "end"}]:
        if m.get("role") == "tool":
            run.append(m)
            continue
        if run:
            out.append(_as_user_turn(run))
            run = []
        if m.get("role") != "end":
            out.append(m)
    return out


def _as_user_turn(tool_messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """bash_block: the observation(s) of one turn as a single user message."""
    parts = [format_observation(m["content"], m.get("exit_code")) for m in tool_messages]
    return {"role": "user", "content": "\n".join(parts)}


def read_chat_template(path: str | None) -> str | None:
    """The text of ``inference.chat_template`` (None when unset)."""
    if not path:
        return None
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"inference.chat_template: cannot read {path}: {e}") from None


def renderer_for(tokenizer: Any, config: CollectorSettings) -> ChatRenderer:
    """The renderer a run's config asks for: offered tools, template and action format."""
    from sandpiper.collector.episode.tools import offered_schemas

    cc = config.collector
    return ChatRenderer(
        tokenizer,
        offered_schemas(cc.tools, cc.tool_descriptions),
        chat_template=read_chat_template(config.inference.chat_template),
        action_format=cc.tool_parser,
    )
