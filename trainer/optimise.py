"""One optimiser pass over packed micro-batches, shared by GRPO and SFT.

A batch of sequences is split into ``minibatches`` (one optimiser step each) and run for
``epochs``. Each minibatch is sharded over the data-parallel ranks by token count, packed into
micro-batches of at most ``micro_batch_tokens`` and accumulated. Loss normalisers are computed
over the *whole* minibatch (all ranks), and multiplied by the world size because DeepSpeed
averages gradients over ranks: the accumulated gradient is exactly the full-batch gradient.
Ranks pad to the same number of micro-batches (ZeRO-3 gathers parameters collectively in
every forward pass, so every rank must run the same number of them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sandpiper.trainer.engine import World
from sandpiper.trainer.loss import LossStats
from sandpiper.trainer.packing import (
    DEFAULT_LOGPROB_CHUNK_TOKENS,
    MicroBatch,
    TrainSequence,
    pack,
    pack_rows,
    pack_shared,
    packed_logprobs,
    plan_rows,
    token_scales,
)
from sandpiper.trainer.prefix import Cluster, Sharing, share_clusters

LossFn = Callable[[torch.Tensor, MicroBatch, torch.Tensor], tuple[torch.Tensor, LossStats]]
"""(logp_T with grad, micro-batch, logp_prox_T) -> (scalar loss, stats)."""

_PAD = TrainSequence(
    "pad", np.zeros(2, np.int32), np.zeros(2, bool), np.full(2, np.nan, np.float32), 0.0
)


@dataclass(frozen=True, slots=True)
class PassResult:
    stats: LossStats
    optimizer_steps: int
    grad_norm: float
    forward_tokens: int
    """Tokens this rank pushed through the model (all passes, all epochs)."""


def shard(items: Sequence[Any], sizes: Sequence[int], world: World) -> list[Any]:
    """This rank's share of ``items``, balanced by ``sizes`` (same answer on every rank)."""
    load = [0] * world.world_size
    mine = []
    for i in sorted(range(len(items)), key=lambda i: (-sizes[i], i)):
        rank = int(np.argmin(load))
        load[rank] += sizes[i]
        if rank == world.rank:
            mine.append(items[i])
    return mine


def _all_max(value: int, world: World) -> int:
    if world.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def build_minibatch(
    seqs: Sequence[TrainSequence],
    *,
    learner_cfg: Any,
    world: World,
    sharing: Sharing | None = None,
) -> list[MicroBatch]:
    """Pack this rank's share of one minibatch into micro-batches (padded across ranks).

    ``sharing``: sequences that start alike (a GRPO group's prompt) are packed so that their
    common prefix is computed once (``prefix.share_clusters``); None packs them unshared.
    The learner passes one where ``learner.share_prefix`` is on and the model honours the
    mask (``prefix.unsupported_reason``).
    """
    scales = token_scales(
        seqs,
        mode=learner_cfg.loss_agg,
        total_loss_tokens=sum(s.loss_tokens for s in seqs),
        total_seqs=len(seqs),
        constant=learner_cfg.loss_constant,
    )
    pairs = list(zip(seqs, [c * world.world_size for c in scales], strict=True))
    if sharing is not None:
        micros = _shared_micros(pairs, learner_cfg.micro_batch_tokens, sharing, world)
    else:
        mine = shard(pairs, [len(s.token_ids_T) for s in seqs], world)
        plan = plan_rows([len(s.token_ids_T) for s, _ in mine], learner_cfg.micro_batch_tokens)
        micros = [pack_rows([[mine[i] for i in r] for r in rows], world.device) for rows in plan]
    while len(micros) < _all_max(len(micros), world):
        micros.append(pack([_PAD], [0.0], world.device))
    return micros


def _shared_micros(
    pairs: Sequence[tuple[TrainSequence, float]], max_tokens: int, sharing: Sharing, world: World
) -> list[MicroBatch]:
    """Clusters of sequences sharing a prefix, sharded whole (a group's samples stay on one
    rank) and packed into rows like sequences (a cluster is never split). A micro-batch with
    nothing shared is packed exactly as without sharing."""
    clusters = share_clusters([s.token_ids_T for s, _ in pairs], sharing)
    mine: list[Cluster] = shard(clusters, [c.tokens for c in clusters], world)
    micros = []
    for rows in plan_rows([c.tokens for c in mine], max_tokens):
        picked = [[mine[i] for i in row] for row in rows]
        if all(len(c.members) == 1 for row in picked for c in row):
            plain = [[pairs[c.members[0]] for c in row] for row in picked]
            micros.append(pack_rows(plain, world.device))
            continue
        micros.append(pack_shared(
            [[[pairs[m] for m in c.members] for c in row] for row in picked],
            [[c.prefix for c in row] for row in picked], world.device,
        ))  # fmt: skip
    return micros


def split_minibatches(seqs: Sequence[TrainSequence], n: int) -> list[list[TrainSequence]]:
    chunks = np.array_split(np.arange(len(seqs)), max(1, min(n, len(seqs))))
    return [[seqs[i] for i in chunk] for chunk in chunks if len(chunk)]


def optimise(
    engine: Any,
    minibatches: Sequence[Sequence[MicroBatch]],
    loss_fn: LossFn,
    *,
    epochs: int,
    proximal: bool = True,
    logprob_chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS,
) -> PassResult:
    """Run ``epochs`` over ``minibatches``; one optimiser step per minibatch.

    ``logp_prox`` is the policy at the start of this pass. With a single minibatch and epoch
    it equals the first forward pass exactly, so that pass's detached logprobs are reused
    instead of paying for an extra no-grad forward. ``proximal=False`` (SFT) never needs it.
    """
    engine.train()
    need_prox = proximal and epochs * len(minibatches) > 1
    prox: dict[int, torch.Tensor] = {}
    tokens = 0
    if need_prox:
        with torch.no_grad():
            for mb in minibatches:
                for micro in mb:
                    prox[id(micro)] = packed_logprobs(
                        engine, micro, chunk_tokens=logprob_chunk_tokens
                    )
                    tokens += micro.num_tokens
    stats, steps, grad_norm = LossStats(), 0, 0.0
    for _ in range(epochs):
        for mb in minibatches:
            for j, micro in enumerate(mb):
                engine.set_gradient_accumulation_boundary(j == len(mb) - 1)
                logp_T = packed_logprobs(engine, micro, chunk_tokens=logprob_chunk_tokens)
                logp_prox_T = prox[id(micro)] if need_prox else logp_T.detach()
                loss, micro_stats = loss_fn(logp_T, micro, logp_prox_T)
                engine.backward(loss)
                stats = stats + micro_stats
                tokens += micro.num_tokens
            norm = _grad_norm(engine)
            engine.step()
            steps += 1
            norm = engine.get_global_grad_norm() if norm is None else norm
            grad_norm = float(norm) if norm is not None else float("nan")
    return PassResult(stats, steps, grad_norm, tokens)


def _grad_norm(engine: Any) -> float | None:
    """Pre-clipping gradient norm; ZeRO-0 keeps full grads on the module, the ZeRO optimisers
    report theirs through ``get_global_grad_norm`` after the step."""
    if engine.zero_optimization_stage() != 0:
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0


def reduce_stats(stats: LossStats, world: World) -> LossStats:
    """Sum / min / max the loss statistics over ranks (``w_min`` / ``w_max`` by min / max,
    every other field is a sum)."""
    if world.world_size == 1:
        return stats
    names = [f.name for f in fields(LossStats) if f.name not in ("w_min", "w_max")]
    sums = torch.tensor(
        [getattr(stats, k) for k in names], dtype=torch.float64, device=world.device
    )
    lo = torch.tensor([stats.w_min], dtype=torch.float64, device=world.device)
    hi = torch.tensor([stats.w_max], dtype=torch.float64, device=world.device)
    dist.all_reduce(sums)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return replace(
        stats, **dict(zip(names, sums.tolist(), strict=True)), w_min=lo.item(), w_max=hi.item()
    )
