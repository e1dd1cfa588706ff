"""Prefix sharing: a group's common prompt goes through the model once.

A GRPO group's G samples start with the same tokens (the prompt; for an agent, the first
turn's context with its tool schemas), usually most of each sequence. Packed one after the
other, the model computes that prefix G times. Here sequences that share a token prefix
form a *cluster*, laid out in one row as ``[P, c_1, ..., c_k]``: the prefix once, then each
member's continuation. A custom 4D attention mask lets every token of ``c_i`` attend to
``P`` and causally to ``c_i`` (never to another continuation); ``c_i``'s position ids go on
from ``len(P)``. Each token of each member then has, in the model's output, a hidden state
equal to the one the member's own unshared forward gives it (the same keys, values and
positions reach it), and :data:`SharedLayout.source_T` says where.

Only the model input changes: the loss's per-token arrays stay those of the unshared
sequences (``packing.pack_shared``), and ``packing.packed_logprobs`` gathers each loss
token's predecessor hidden state through ``source_T`` (a prefix position's hidden state
serves every member, so its gradient is the sum over members, as it would be unshared).

A cluster forms only where it is cheaper (:func:`share_clusters`): its row is longer than
any member's, and a custom mask makes attention compute every (query, key) pair of the row,
so a short prompt before long completions is cheaper unshared. Rows stay within
``inference.max_model_len``, the memory planner's row (``memory_plan.LearnerSetup.
row_tokens``): a micro-batch of R rows of L tokens holds R L <= ``micro_batch_tokens``
tokens and a mask of R L^2 <= ``micro_batch_tokens`` x ``row_tokens``, the planner's terms,
so the planner needs none of its own.

The mechanism relies on transformers passing a 4D mask through unchanged
(``masking_utils._preprocess_mask_arguments`` returns it as-is, 5.19) to an attention that
honours it: sdpa (a boolean mask) and eager (an additive one). Flash attention ignores it
and reads sequence boundaries from the position ids; flex attention wants a block mask;
sliding-window layers would need the window in the mask. :func:`unsupported_reason` names
those cases, and the learner falls back to unshared packing for them. Equality with the
unshared computation (logprobs and gradients) is what tests/unit/trainer/test_prefix.py
checks, per architecture and attention implementation listed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

SHARED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
"""Causal LMs whose decoder builds its mask with ``create_causal_mask`` (a 4D mask passes
unchanged) and whose output is tested equal to the unshared one (transformers 5.19)."""
SHARED_ATTENTION = frozenset({"sdpa", "eager"})
"""Attention implementations that apply a custom 4D mask as given."""
MIN_SHARED_PREFIX = 16
"""Fewer common tokens than this are not worth a mask of their own: such sequences are
packed as they would be unshared."""


@dataclass(frozen=True, slots=True)
class Cluster:
    """Sequences (indices into the caller's list) laid out as one prefix + continuations."""

    members: tuple[int, ...]
    prefix: int
    """Tokens every member starts with (the whole sequence for a cluster of one)."""
    tokens: int
    """Length in the shared layout: ``prefix`` + the members' continuations."""


@dataclass(frozen=True, slots=True)
class Sharing:
    """How the learner shares prefixes: one object, built once for its model."""

    max_row_tokens: int
    """Longest row of a cluster (``inference.max_model_len``: the longest row unshared
    packing makes, so the memory planner's attention mask holds either way)."""
    attention_tokens: float
    """Row length at which a token's attention costs as much as its other layers (see
    :func:`attention_tokens`): a longer row costs more per token, so clustering weighs
    the tokens saved against the longer row."""

    def cost(self, row_tokens: int) -> float:
        """Work of a forward on a row of ``row_tokens`` tokens, in token-layers: every
        token's projections and MLP, plus every (query, key) pair's attention (a custom
        mask computes all pairs of the row)."""
        return row_tokens + row_tokens * row_tokens / self.attention_tokens


def attention_tokens(config: Any) -> float:
    """``Sharing.attention_tokens`` from a transformers config: per layer, a token's
    projections and MLP cost ``2 h (2 q + 2 kv + 3 i)`` FLOPs and a (query, key) pair
    ``4 q`` (scores and weighted values); their ratio (768 for the tiny model, about 3,100
    for SmolLM2-135M, 12,300 for Qwen3-4B)."""
    h, i = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    return 2 * h * (2 * q + 2 * kv + 3 * i) / (4 * q)


@dataclass(frozen=True, slots=True)
class SharedLayout:
    """The model input of a micro-batch whose sequences share prefixes.

    The loss side of the micro-batch is unchanged (one row of the unshared sequences,
    ``MicroBatch.input_ids`` of shape (1, N)); this is what the model runs on instead.
    """

    input_ids: torch.Tensor
    """(R, L) int64: rows of clusters, each its prefix then its members' continuations;
    the tail of a row is padding (id 0, its own causal segment, never gathered)."""
    position_ids: torch.Tensor
    """(R, L) int64: 0.. over a prefix, ``len(prefix)``.. over each continuation."""
    attention_mask: torch.Tensor
    """(R, 1, L, L) bool, True where a query (dim 2) may attend to a key (dim 3)."""
    source_T: torch.Tensor
    """(N,) int64: for each token of the unshared row, the flat (row-major, R * L) index of
    the position of the shared layout that holds its hidden state."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def share_clusters(
    tokens: Sequence[np.ndarray], sharing: Sharing, *, min_prefix: int = MIN_SHARED_PREFIX
) -> list[Cluster]:
    """Partition sequences into clusters that share a prefix (every sequence in exactly one).

    Sequences sorted by content put those with a common prefix next to each other; a run
    of them becomes one cluster while adding the next one costs less than computing it
    alone (:meth:`Sharing.cost`: the tokens saved against the longer row's attention; a
    sample of another task that shares only the system prompt does not cut a group's
    prompt down to it), the prefix stays at least ``min_prefix`` and the cluster fits in
    ``sharing.max_row_tokens`` (a group too large for one row splits into several clusters,
    each with its own copy of the prefix). Deterministic: every rank gets the same.
    """
    order = sorted(range(len(tokens)), key=lambda i: (tokens[i].astype(">i8").tobytes(), i))
    clusters: list[Cluster] = []
    members: list[int] = []
    prefix = size = 0
    for i in order:
        n = len(tokens[i])
        if members:
            shared = min(prefix, common_prefix(tokens[members[-1]], tokens[i]))
            grown = size + (len(members) - 1) * (prefix - shared) + (n - shared)
            cheaper = sharing.cost(grown) <= sharing.cost(size) + sharing.cost(n)
            if shared >= min_prefix and cheaper and grown <= sharing.max_row_tokens:
                members.append(i)
                prefix, size = shared, grown
                continue
            clusters.append(Cluster(tuple(members), prefix, size))
        members, prefix, size = [i], n, n
    if members:
        clusters.append(Cluster(tuple(members), prefix, size))
    return clusters


def shared_layout(
    rows: Sequence[Sequence[tuple[Sequence[np.ndarray], int]]], device: torch.device | str
) -> SharedLayout:
    """The model input for ``rows`` of clusters, each ``(member token arrays, prefix)``.

    ``source_T`` follows the members in the order given (row by row, cluster by cluster),
    which is the order of the unshared row the loss sees.
    """
    row_len = max(sum(p + sum(len(m) - p for m in members) for members, p in row) for row in rows)
    ids = np.zeros((len(rows), row_len), np.int64)
    pos = np.zeros((len(rows), row_len), np.int64)
    segment = np.zeros((len(rows), row_len), np.int64)
    parent = np.full((len(rows), row_len), -1, np.int64)
    sources: list[np.ndarray] = []
    seg_id = 0
    for r, row in enumerate(rows):
        at = 0
        for members, p in row:
            ids[r, at : at + p] = members[0][:p]
            pos[r, at : at + p] = np.arange(p)
            segment[r, at : at + p] = prefix_seg = seg_id
            seg_id += 1
            prefix_at, at = at, at + p
            for member in members:
                rest = len(member) - p
                ids[r, at : at + rest] = member[p:]
                pos[r, at : at + rest] = np.arange(p, len(member))
                segment[r, at : at + rest] = seg_id
                parent[r, at : at + rest] = prefix_seg
                sources.append(
                    r * row_len + np.concatenate([prefix_at + np.arange(p), at + np.arange(rest)])
                )
                seg_id += 1
                at += rest
        pos[r, at:] = np.arange(row_len - at)  # padding: a causal segment of its own
        segment[r, at:] = seg_id
        seg_id += 1
    seg_t = torch.from_numpy(segment)
    same = seg_t[:, :, None] == seg_t[:, None, :]
    causal = torch.ones(row_len, row_len, dtype=torch.bool).tril()
    to_prefix = torch.from_numpy(parent)[:, :, None] == seg_t[:, None, :]
    mask = (same & causal) | to_prefix

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=torch.int64)

    return SharedLayout(
        input_ids=t(ids),
        position_ids=t(pos),
        attention_mask=mask[:, None].to(device),
        source_T=t(np.concatenate(sources)),
    )


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why prefix sharing cannot run on ``model`` (a causal LM or an engine around one), or
    None when it can."""
    inner = getattr(model, "module", None)
    module: Any = inner if isinstance(inner, torch.nn.Module) else model
    name = type(module).__name__
    if name not in SHARED_ARCHITECTURES:
        return f"{name} is not one of {', '.join(sorted(SHARED_ARCHITECTURES))}"
    config = module.config
    attn = getattr(config, "_attn_implementation", None)
    if attn not in SHARED_ATTENTION:
        return f"attention implementation {attn!r} does not apply a custom 4D mask"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return "the model has sliding-window layers (the mask would need the window)"
    return None


def model_mask(layout: SharedLayout, model: torch.nn.Module) -> torch.Tensor:
    """The mask in the form ``model``'s attention takes it: boolean for sdpa, additive (0 or
    the dtype's minimum) for eager attention, which adds it to the scores."""
    inner = getattr(model, "module", None)
    module: Any = inner if isinstance(inner, torch.nn.Module) else model
    if module.config._attn_implementation != "eager":
        return layout.attention_mask
    dtype = next(module.parameters()).dtype
    additive = torch.zeros(layout.attention_mask.shape, dtype=dtype, device=layout.input_ids.device)
    return additive.masked_fill(~layout.attention_mask, torch.finfo(dtype).min)
