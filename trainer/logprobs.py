"""Log-probabilities of chosen tokens without full-vocabulary logits.

The causal-LM head would turn every position's hidden state into V logits: (tokens x V)
floats, 1.6 GB in fp32 for 8,192 tokens at SmolLM2's V = 49,152, 5 GB at Qwen3's 151,936,
plus as much again for its gradient. Only loss tokens need a log-softmax, and one chunk of
them at a time is enough: :func:`selected_logprobs` runs the output layer on
``chunk_tokens`` selected hidden states at a time and keeps only each token's logprob. With
more than one chunk every chunk runs under non-reentrant activation checkpointing, so the
backward recomputes one chunk's logits at a time instead of keeping them all: peak memory
is O(chunk_tokens x V), whatever the number of tokens.

The output layer is *called as a module* (``model.get_output_embeddings()(h)``), never
through its ``.weight``: under DeepSpeed ZeRO-3 the weight is a partition, and the module's
hooks gather it for the call (and again for the recompute in the backward).

Only architectures whose logits are exactly ``lm_head(final hidden state)`` qualify:
Llama, Qwen2 and Qwen3 in transformers 5.19 (read from their ``forward``). Others scale or
soft-cap the logits after the head (Gemma2's ``final_logit_softcapping``, Cohere's
``logit_scale``, Granite's ``logits_scaling``); for them :func:`supports_chunked` is False
and the caller computes full logits as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNKED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
"""Causal-LM classes whose logits are the output layer applied to the last hidden state,
with no scaling or soft-capping after it (checked in transformers 5.19's modeling code)."""

NO_LOGITS = torch.empty(0, dtype=torch.int64)
"""``logits_to_keep`` that makes the model's own head compute logits for no position."""


def supports_chunked(model: torch.nn.Module) -> bool:
    """True when ``model``'s logits are exactly its output layer on the last hidden state."""
    return type(model).__name__ in CHUNKED_ARCHITECTURES


def selected_logprobs(
    head: torch.nn.Module,
    hidden_NH: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    chunk_tokens: int,
    temperature_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """(N,) float32 ``log softmax(head(h) / temperature)[target]`` per selected position.

    ``temperature_N`` None means 1 (raw logits, and no division at all, so the result is
    bit-identical to the full-logits computation's cross-entropy on the same rows).
    """
    n = hidden_NH.shape[0]
    if n <= chunk_tokens:  # one chunk: checkpointing it would only add a recompute
        return _chunk_logprobs(head, hidden_NH, targets_N, temperature_N)
    parts = []
    for start in range(0, n, chunk_tokens):
        part = slice(start, start + chunk_tokens)
        temp = None if temperature_N is None else temperature_N[part]
        args = (head, hidden_NH[part], targets_N[part], temp)
        if torch.is_grad_enabled() and hidden_NH.requires_grad:
            parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(*args))
    return torch.cat(parts)


def _chunk_logprobs(
    head: torch.nn.Module,
    hidden_NH: torch.Tensor,
    targets_N: torch.Tensor,
    temperature_N: torch.Tensor | None,
) -> torch.Tensor:
    logits = head(hidden_NH).float()
    if temperature_N is not None:
        logits = logits / temperature_N[:, None]
    return -F.cross_entropy(logits, targets_N, reduction="none")
