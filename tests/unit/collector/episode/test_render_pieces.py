"""Piece-wise cached encoding (``collector.episode.render._PieceEncoder``) gives the tokenizer's own ids.

The renderer encodes a text as the ids of its pieces between added tokens, each piece's ids
cached (the gateway's first prompts and deltas repeat the same system prompt, tool schemas
and template text). These tests compare it with the tokenizer's whole-text encoding on the
tiny model's and SmolLM2's tokenizers, over texts built to catch a wrong cut (tokens next to
each other, whitespace and combining marks at the cuts, partial tokens), check the cache's
bound, and that a tokenizer for which the cut is not exact gets whole-text encoding.
"""

from __future__ import annotations

import random

import pytest

from sandpiper.collector.episode import render
from sandpiper.collector.episode.render import ChatRenderer, _PieceEncoder
from sandpiper.collector.episode.tools import offered_schemas
from tests.unit.collector.episode.test_render import smollm2_tokenizer  # noqa: F401  (a fixture)

TOOLS = offered_schemas(["execute_bash", "str_replace_editor", "submit"], "brief")
FRAGMENTS = [
    "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
    "</tool_response>", "<|endoftext|>", "<|im_start", "im_end|>", "<<|im_end|>>", "<tool_",
    " ", "  ", "\n", "\n\n", "\t", "user\n", "assistant", " hello", "wörld", "e\u0301",
    "\u0301", "Ω", "😀", "123", " 4 5", '{"command": "ls -la"}', "'s", "x", "",
]  # fmt: skip
"""Added tokens of both tokenizers, near-misses of them, and text that merges across cuts."""


def _texts(renderer: ChatRenderer) -> list[str]:
    rng = random.Random(20)
    texts = ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12))) for _ in range(400)]
    conversation = [
        {"role": "system", "content": "You are an agent in a Linux sandbox."},
        {"role": "user", "content": "List the files.\n"},
        {"role": "assistant", "content": ' <tool_call>\n{"name": "execute_bash"}\n</tool_call>'},
        {"role": "tool", "tool_call_id": "call_0_0", "content": "\na.txt  b.txt\n\n"},
    ]
    for k in range(1, len(conversation) + 1):
        texts.append(renderer.render(conversation[:k], add_generation_prompt=True))
    return texts


@pytest.mark.parametrize("name", ["tiny_tokenizer", "smollm2_tokenizer"])
def test_piece_wise_encoding_equals_the_tokenizers(request, name):
    tokenizer = request.getfixturevalue(name)
    renderer = ChatRenderer(tokenizer, TOOLS)
    assert renderer._pieces is not None, "piece-wise encoding should apply to this tokenizer"
    for text in _texts(renderer):
        whole = list(tokenizer.encode(text, add_special_tokens=False))
        assert renderer.encode(text) == whole, repr(text)
        assert renderer.encode(text) == whole, repr(text)  # again, from the cache


def test_the_piece_cache_stays_within_its_bound(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(render, "PIECE_CACHE_CHARS", 400)
    renderer = ChatRenderer(tiny_tokenizer, TOOLS)
    pieces = renderer._pieces
    assert pieces is not None
    for i in range(200):
        text = f"<|im_start|>user\nmessage number {i}<|im_end|>"
        assert renderer.encode(text) == list(tiny_tokenizer.encode(text, add_special_tokens=False))
    assert 0 < pieces._cache_chars <= 400
    assert pieces._cache_chars == sum(len(p) for p in pieces._cache)
    assert "user\nmessage number 199" in pieces._cache  # the newest are kept
    assert "user\nmessage number 0" not in pieces._cache


def test_a_tokenizer_whose_cut_is_not_exact_is_encoded_whole(tiny_tokenizer, monkeypatch):
    """An added token that strips whitespace, or a disagreement on the renderer's own
    renders, turns piece-wise encoding off (whole-text ids are always right)."""
    from copy import deepcopy

    stripping = deepcopy(tiny_tokenizer)
    stripping.add_special_tokens(
        {"additional_special_tokens": [_added("<|strip|>", lstrip=True)]}
    )  # fmt: skip
    assert _PieceEncoder.for_tokenizer(stripping) is None
    assert ChatRenderer(stripping, TOOLS)._pieces is None

    monkeypatch.setattr(_PieceEncoder, "encode", lambda self, text, keep=True: [0])
    assert ChatRenderer(tiny_tokenizer, TOOLS)._pieces is None


def test_a_first_only_prefix_pre_tokenizer_is_detected():
    first = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}
    always = {**first, "prepend_scheme": "always"}
    assert render._has_first_only_prefix({"type": "Sequence", "pretokenizers": [first]})
    assert not render._has_first_only_prefix({"type": "Sequence", "pretokenizers": [always]})
    assert not render._has_first_only_prefix({"type": "ByteLevel", "add_prefix_space": False})


def _added(content: str, **flags):
    from tokenizers import AddedToken

    return AddedToken(content, normalized=False, **flags)
