"""Sequence packing: many episodes in one row, never padded to the batch maximum.

Sequences are concatenated into one row per micro-batch; ``position_ids`` restart at 0 for
every sequence, which is what tells transformers' attention (sdpa / flash) where the
boundaries are. The forward pass uses ``attention_mask=None`` and ``use_cache=False``:
with a cache the packed logits are silently wrong (see PLATFORM.md).

With ``learner.share_prefix`` the model runs on a shared layout instead (``pack_shared``,
:mod:`sandpiper.trainer.prefix`): sequences that start alike hold their common prefix once,
under a custom 4D attention mask; the per-token arrays below are still those of the
unshared sequences, so the loss reads the same tokens in either case.

Every per-token array here is aligned with the *token* it describes: ``logp_T[i]`` is the
log-probability of ``input_ids[i]`` given the tokens before it in its own sequence. The
first token of a sequence has no such probability; it is never in the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from sandpiper.errors import LearnerError
from sandpiper.store.records import TrainGroup
from sandpiper.trainer.logprobs import NO_LOGITS, selected_logprobs, supports_chunked
from sandpiper.trainer.prefix import SharedLayout, model_mask, shared_layout, unsupported_reason

DEFAULT_LOGPROB_CHUNK_TOKENS = 1024
"""Loss tokens per output-layer chunk (``learner.logprob_chunk_tokens``' default)."""


def score_temperature(group: TrainGroup, logprobs_mode: str) -> float:
    """The temperature the learner scores ``group``'s tokens at, so that its logprobs are of
    the same distribution as the stored sampling logprobs: vLLM's processed logprobs are of
    ``logits / temperature`` (what the tokens were sampled from), its raw ones of the logits
    (the config allows raw ones only at temperature 1, where the two agree)."""
    return group.temperature if logprobs_mode == "processed_logprobs" else 1.0


@dataclass(frozen=True, slots=True)
class TrainSequence:
    """One episode ready for the loss."""

    episode_id: str
    token_ids_T: np.ndarray
    """int32 context + sampled tokens, exactly as stored."""
    loss_mask_T: np.ndarray
    """bool, True on sampled tokens (the first token is always False here)."""
    behaviour_logprobs_T: np.ndarray
    """float32 sampling logprobs; NaN where masked."""
    advantage: float
    """GRPO advantage of the episode (0.0 for SFT)."""
    staleness: int = 0
    """Policy versions between the oldest sampled token and the version being trained."""
    temperature: float = 1.0
    """Temperature the learner scores the tokens at: the group's sampling temperature when
    the stored logprobs are processed ones, 1 (raw logits) otherwise (``score_temperature``)."""

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask_T.sum())


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Packed tensors for one forward pass: R rows of L tokens, flattened per-token arrays.

    Per-token arrays (``_T``) have R * L entries in row-major order. The tail of a row that
    is not filled is one padding segment (id 0, own positions, never in the loss), counted
    as an extra sequence so per-sequence sums never mix it with real tokens.
    """

    input_ids: torch.Tensor
    """(R, L) int64."""
    position_ids: torch.Tensor
    """(R, L) int64, restarting at 0 per sequence."""
    seq_index_T: torch.Tensor
    """(R*L,) int64 index of the owning sequence within this micro-batch."""
    loss_mask_T: torch.Tensor
    """(R*L,) bool."""
    logp_behav_T: torch.Tensor
    """(R*L,) float32, 0 where masked (so masked arithmetic stays finite); a non-finite value
    on a loss token is an error (see ``_check_finite``), never mapped to a number."""
    advantages_T: torch.Tensor
    """(R*L,) float32, the sequence's advantage broadcast to its tokens."""
    token_scale_T: torch.Tensor
    """(R*L,) float32 loss normaliser per token (aggregation mode, see ``token_scales``)."""
    num_seqs: int
    """Sequences including padding segments (the size of per-sequence reductions)."""
    temperature_T: torch.Tensor | None = None
    """(R*L,) float32 temperature each token is scored at; None = 1 everywhere (raw logits,
    no division)."""
    shared: SharedLayout | None = None
    """The model input when sequences share prefixes (``pack_shared``; R = 1 then, and the
    row above is only what the loss reads); None = the model runs on ``input_ids``."""

    @property
    def num_tokens(self) -> int:
        """Tokens the model runs on (padding included)."""
        return self.shared.num_tokens if self.shared else int(self.input_ids.numel())


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices into bins of at most ``max_tokens`` tokens (rows).

    First-fit decreasing: few, well-filled bins. A sequence longer than ``max_tokens`` gets a
    bin of its own (it is never split: its tokens attend to each other).
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return bins


def plan_rows(lengths: Sequence[int], max_tokens: int) -> list[list[list[int]]]:
    """Micro-batches of rows of sequence indices.

    Rows are as long as the longest sequence (attention costs row length per token, so long
    rows of many short sequences would waste compute on masked-out pairs); as many rows as
    fit in ``max_tokens`` make one micro-batch (one batched forward pass).
    """
    if not lengths:
        return []
    row_len = max(lengths)
    rows = plan_micro_batches(lengths, row_len)
    per_micro = max(1, max_tokens // row_len)
    return [rows[i : i + per_micro] for i in range(0, len(rows), per_micro)]


def token_scales(
    seqs: Sequence[TrainSequence],
    *,
    mode: Literal["token_mean", "sequence_mean", "constant"],
    total_loss_tokens: int,
    total_seqs: int,
    constant: float,
) -> list[float]:
    """Per-sequence factor each loss token is multiplied by, so that summing gives the mean.

    ``total_*`` count the whole optimiser minibatch (all micro-batches, all ranks), so that
    gradient accumulation over micro-batches gives exactly the full-batch loss.
    """
    if mode == "token_mean":
        return [1.0 / max(total_loss_tokens, 1)] * len(seqs)
    if mode == "sequence_mean":
        return [1.0 / (max(s.loss_tokens, 1) * max(total_seqs, 1)) for s in seqs]
    return [1.0 / (constant * max(total_seqs, 1))] * len(seqs)


def _padding(n: int) -> TrainSequence:
    return TrainSequence(
        "padding", np.zeros(n, np.int32), np.zeros(n, bool), np.full(n, np.nan, np.float32), 0.0
    )


def pack(
    seqs: Sequence[TrainSequence], scales: Sequence[float], device: torch.device | str = "cpu"
) -> MicroBatch:
    """Concatenate sequences into one row with per-sequence position ids."""
    return pack_rows([list(zip(seqs, scales, strict=True))], device)


def pack_rows(
    rows: Sequence[Sequence[tuple[TrainSequence, float]]], device: torch.device | str = "cpu"
) -> MicroBatch:
    """Pack rows of (sequence, loss scale) into one (R, L) micro-batch."""
    row_len = max(sum(len(s.token_ids_T) for s, _ in row) for row in rows)
    flat: list[tuple[TrainSequence, float]] = []
    for row in rows:
        flat.extend(row)
        fill = row_len - sum(len(s.token_ids_T) for s, _ in row)
        if fill:
            flat.append((_padding(fill), 0.0))
    seqs = [s for s, _ in flat]
    ids = np.concatenate([s.token_ids_T for s in seqs]).astype(np.int64)
    positions = np.concatenate([np.arange(len(s.token_ids_T)) for s in seqs])
    seq_index = np.concatenate([np.full(len(s.token_ids_T), i) for i, s in enumerate(seqs)])
    mask = np.concatenate([s.loss_mask_T for s in seqs]).astype(bool)
    mask[positions == 0] = False  # nothing predicts a sequence's first token
    behav = np.concatenate([s.behaviour_logprobs_T for s in seqs]).astype(np.float32)
    _check_finite(behav, mask, seq_index, seqs)
    behav = np.where(mask, behav, 0.0).astype(np.float32)
    adv = np.concatenate([np.full(len(s.token_ids_T), s.advantage) for s in seqs])
    scale = np.concatenate([np.full(len(s.token_ids_T), c) for s, c in flat])
    temps = np.concatenate([np.full(len(s.token_ids_T), s.temperature) for s in seqs])

    def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    return MicroBatch(
        input_ids=t(ids, torch.int64).view(len(rows), row_len),
        position_ids=t(positions, torch.int64).view(len(rows), row_len),
        seq_index_T=t(seq_index, torch.int64),
        loss_mask_T=t(mask, torch.bool),
        logp_behav_T=t(behav, torch.float32),
        advantages_T=t(adv, torch.float32),
        token_scale_T=t(scale, torch.float32),
        num_seqs=len(seqs),
        temperature_T=None if (temps == 1.0).all() else t(temps, torch.float32),
    )


def pack_shared(
    rows: Sequence[Sequence[Sequence[tuple[TrainSequence, float]]]],
    prefixes: Sequence[Sequence[int]],
    device: torch.device | str = "cpu",
) -> MicroBatch:
    """Pack rows of clusters (``prefix.share_clusters``) into one micro-batch whose model
    input computes each cluster's common prefix once.

    ``rows[r][c]`` is cluster ``c`` of row ``r`` as (sequence, loss scale) pairs and
    ``prefixes[r][c]`` the tokens its members share. The loss arrays are those of ``pack``
    on the same sequences in the same order (one row, no padding); ``shared`` holds the
    layout the model runs on.
    """
    flat = [pair for row in rows for cluster in row for pair in cluster]
    micro = pack_rows([flat], device)
    layout = shared_layout(
        [
            [([s.token_ids_T for s, _ in cluster], p) for cluster, p in zip(row, ps, strict=True)]
            for row, ps in zip(rows, prefixes, strict=True)
        ],
        device,
    )
    return replace(micro, shared=layout)


def _check_finite(
    behav_T: np.ndarray, mask_T: np.ndarray, seq_index_T: np.ndarray, seqs: Sequence[TrainSequence]
) -> None:
    """Every loss token needs a finite sampling logprob: one that is not would silently turn
    into some importance weight (the store marks such episodes invalid at ingest, so this is
    a bug upstream, never data to train on)."""
    bad = mask_T & ~np.isfinite(behav_T)
    if bad.any():
        ids = sorted({seqs[i].episode_id for i in np.unique(seq_index_T[bad])})
        raise LearnerError(
            f"{int(bad.sum())} loss tokens have a non-finite sampling logprob (episodes "
            f"{', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}); the store should have "
            "stored them invalid (stop reason bad_sampler_output): refusing to pack them"
        )


def packed_logprobs(
    model: torch.nn.Module, micro: MicroBatch, *, chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS
) -> torch.Tensor:
    """(R*L,) float32 log-probability of each loss token given its own sequence's prefix.

    ``model`` is a causal LM or a DeepSpeed engine around one (called through the engine, so
    that its hooks run). The logits are divided by each sequence's sampling temperature
    (``micro.temperature_T``; None = 1, raw model logprobs, what vLLM stores in
    ``raw_logprobs`` mode). Entries outside ``micro.loss_mask_T`` are 0.

    Only the loss tokens' logprobs are computed, ``chunk_tokens`` at a time from the last
    hidden state (:mod:`sandpiper.trainer.logprobs`): no (tokens x V) logits, forward or
    backward. Architectures whose logits are not the plain output layer get full logits.
    """
    inner = getattr(model, "module", None)
    module: Any = inner if isinstance(inner, torch.nn.Module) else model
    if micro.shared is not None:
        return _shared_logprobs(model, module, micro, micro.shared, chunk_tokens)
    # Only tokens in the loss need a log-softmax over the vocabulary (prompt and tool tokens
    # are most of an agent's context): select them before the cross-entropy.
    needed = micro.loss_mask_T.view(micro.input_ids.shape)[:, 1:]
    targets = micro.input_ids[:, 1:][needed]
    temperature = None
    if micro.temperature_T is not None:
        temperature = micro.temperature_T.view(micro.input_ids.shape)[:, 1:][needed]
    inputs = dict(
        input_ids=micro.input_ids, position_ids=micro.position_ids, attention_mask=None,
        use_cache=False,
    )  # fmt: skip
    if supports_chunked(module):
        out = model(**inputs, output_hidden_states=True, logits_to_keep=NO_LOGITS)
        hidden = out.hidden_states[-1][:, :-1][needed]  # after the final norm (tied)
        del out
        picked = selected_logprobs(
            module.get_output_embeddings(), hidden, targets,
            chunk_tokens=chunk_tokens, temperature_N=temperature,
        )  # fmt: skip
    else:
        logits = model(**inputs).logits[:, :-1][needed].float()
        if temperature is not None:
            logits = logits / temperature[:, None]
        picked = -F.cross_entropy(logits, targets, reduction="none")
    next_logp = torch.zeros(needed.shape, dtype=picked.dtype, device=picked.device)
    next_logp = next_logp.masked_scatter(needed, picked)
    logp = torch.cat([next_logp.new_zeros(next_logp.shape[0], 1), next_logp], dim=1)
    return logp.reshape(-1)


def _shared_logprobs(
    model: torch.nn.Module, module: Any, micro: MicroBatch, layout: SharedLayout, chunk_tokens: int
) -> torch.Tensor:
    """``packed_logprobs`` of a micro-batch with a shared layout (one loss row): the model
    runs on the layout, and each loss token is scored from the hidden state at the layout
    position of its predecessor in its own sequence."""
    reason = unsupported_reason(module)
    if reason is not None:
        raise LearnerError(f"learner.share_prefix: cannot share prefixes on this model: {reason}")
    needed = micro.loss_mask_T.view(micro.input_ids.shape)[:, 1:]
    targets = micro.input_ids[:, 1:][needed]
    # loss row position j + 1 is predicted at position j (same sequence: position 0 of a
    # sequence is never in the loss), held by the layout at source_T[j]
    before = layout.source_T[:-1][needed[0]]
    temperature = None
    if micro.temperature_T is not None:
        temperature = micro.temperature_T.view(micro.input_ids.shape)[:, 1:][needed]
    inputs = dict(
        input_ids=layout.input_ids, position_ids=layout.position_ids,
        attention_mask=model_mask(layout, module), use_cache=False,
    )  # fmt: skip
    # every architecture prefix sharing accepts computes chunked logprobs (prefix.py)
    out = model(**inputs, output_hidden_states=True, logits_to_keep=NO_LOGITS)
    last = out.hidden_states[-1]
    del out
    hidden = last.reshape(-1, last.shape[-1])[before]
    picked = selected_logprobs(
        module.get_output_embeddings(), hidden, targets,
        chunk_tokens=chunk_tokens, temperature_N=temperature,
    )  # fmt: skip
    logp = torch.zeros(micro.input_ids.numel(), dtype=picked.dtype, device=picked.device)
    return logp.masked_scatter(micro.loss_mask_T, picked)
