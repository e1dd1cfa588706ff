"""Supervised fine-tuning (``sandpiper learn --algo sft``) on episodes selected from the store.

Takes valid, trainable episodes whose reward is at least ``learner.sft_min_reward`` (for
example successful rollouts, or demonstrations a task source inserted with reward 1), and
minimises the cross-entropy of their sampled (loss-mask) tokens for ``learner.epochs`` epochs
of ``learner.minibatches`` optimiser steps each. The result is checkpointed and registered as
the next policy version of the run, so GRPO (or the collector) starts from it: a warm start.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from sandpiper.store.step_metrics import StepMetrics
from sandpiper.trainer.engine import broadcast_from_main
from sandpiper.trainer.learner import Learner
from sandpiper.trainer.loss import LossStats
from sandpiper.trainer.optimise import optimise, reduce_stats, split_minibatches
from sandpiper.trainer.packing import MicroBatch, TrainSequence


def sft_sequences(learner: Learner) -> list[TrainSequence]:
    """Selected episodes as sequences (rank 0 reads the store, then broadcasts)."""
    episodes = None
    if learner.world.is_main:
        assert learner.store is not None
        episodes = learner.store.claims.sft_episodes(
            run_id=learner.run_id,
            min_reward=learner.lc.sft_min_reward,
            limit=learner.lc.sft_max_episodes,
        )
    episodes = broadcast_from_main(episodes, learner.world)
    return [
        TrainSequence(
            e.episode_id if k == 0 else f"{e.episode_id}#{k}",
            e.token_ids_T[lo:hi],
            e.loss_mask_T[lo:hi],
            e.behaviour_logprobs_T[lo:hi],
            0.0,
        )
        for e in episodes
        for k, (lo, hi) in enumerate(e.segments())
        if e.loss_mask_T[lo + 1 : hi].any()
    ]


def run_sft(learner: Learner) -> dict[str, float]:
    """Fine-tune on the selected episodes and register the result as the next version."""
    started = time.perf_counter()
    seqs = sft_sequences(learner)
    nll = {"sum": 0.0}

    def nll_loss(
        logp_T: torch.Tensor, micro: MicroBatch, _prox: torch.Tensor
    ) -> tuple[torch.Tensor, LossStats]:
        per_token = -logp_T * micro.loss_mask_T
        nll["sum"] += float(per_token.detach().sum())
        return (per_token * micro.token_scale_T).sum(), LossStats(
            tokens=float(micro.loss_mask_T.sum())
        )

    metrics = StepMetrics(sft_episodes=float(len(seqs)))
    if seqs:
        minibatches = [learner.pack(mb) for mb in split_minibatches(seqs, learner.lc.minibatches)]
        # Every epoch re-reads the data; no importance weights, so no proximal pass needed.
        result = optimise(
            learner.engine,
            minibatches,
            nll_loss,
            epochs=learner.lc.epochs,
            proximal=False,
            logprob_chunk_tokens=learner.lc.logprob_chunk_tokens,
        )
        tokens = reduce_stats(result.stats, learner.world).tokens
        metrics.sft_nll = nll["sum"] / max(result.stats.tokens, 1.0)
        metrics.sft_loss_tokens = tokens / max(learner.lc.epochs, 1)
        metrics.grad_norm = result.grad_norm
        metrics.optimizer_steps = float(result.optimizer_steps)
        metrics.tokens = float(sum(len(s.token_ids_T) for s in seqs) * learner.lc.epochs)
    metrics.sft_reward_threshold = learner.lc.sft_min_reward
    metrics.sft_mean_len = float(np.mean([len(s.token_ids_T) for s in seqs] or [0]))
    return learner.publish(metrics, started, claim_id=None)
