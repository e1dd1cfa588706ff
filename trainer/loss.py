"""GRPO loss with importance correction for off-policy (stale) samples.

Per sampled token, three log-probabilities:

- ``logp_behav``: what the sampler (vLLM) reported when it produced the token;
- ``logp_prox``: the learner's log-probability with the weights at the start of this step
  (no gradient);
- ``logp``: the current learner log-probability (with gradient).

``ratio = exp(logp - logp_prox)`` is PPO-clipped to ``[1 - eps_low, 1 + eps_high]``. The
behaviour gap is corrected by ``w = exp(logp_prox - logp_behav)``, applied without gradient,
per token or per sequence (sum or mean of the token log-ratios), then either truncated at
``C`` (TIS) or zeroed outside ``[lo, hi]`` (IcePop / MIS). With behaviour = proximal policy,
``w`` is exactly 1 and the loss is plain GRPO. An optional k3 KL term pulls towards a
reference model. Aggregation is carried by ``token_scale_T`` (see ``packing.token_scales``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

from sandpiper.config import LearnerConfig

_LEARNER = LearnerConfig()
"""Defaults of the loss knobs come from ``LearnerConfig``: one place declares them."""


@dataclass(frozen=True, slots=True)
class LossConfig:
    """The loss knobs of ``LearnerConfig`` (same names and defaults), as a plain frozen
    dataclass for the hot path. Build it from a config with :meth:`from_learner`."""

    eps_low: float = _LEARNER.eps_low
    eps_high: float = _LEARNER.eps_high
    is_level: Literal["token", "sequence_sum", "sequence_mean"] = _LEARNER.is_level
    is_mode: Literal["truncate", "mask", "none"] = _LEARNER.is_mode
    is_cap: float = _LEARNER.is_cap
    is_lo: float = _LEARNER.is_lo
    is_hi: float = _LEARNER.is_hi
    kl_coef: float = _LEARNER.kl_coef

    @classmethod
    def from_learner(cls, learner: LearnerConfig) -> LossConfig:
        return cls(**{f.name: getattr(learner, f.name) for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class LossStats:
    """Sums over loss tokens of one micro-batch; add them up, then call ``summary``."""

    tokens: float = 0.0
    w_sum: float = 0.0
    w_sq_sum: float = 0.0
    w_min: float = float("inf")
    w_max: float = float("-inf")
    clipped: float = 0.0
    is_masked: float = 0.0
    kl_behav_sum: float = 0.0
    kl_ref_sum: float = 0.0

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(
            self.tokens + other.tokens,
            self.w_sum + other.w_sum,
            self.w_sq_sum + other.w_sq_sum,
            min(self.w_min, other.w_min),
            max(self.w_max, other.w_max),
            self.clipped + other.clipped,
            self.is_masked + other.is_masked,
            self.kl_behav_sum + other.kl_behav_sum,
            self.kl_ref_sum + other.kl_ref_sum,
        )

    def summary(self) -> dict[str, float]:
        """Metrics: raw importance weights (before truncation/masking), ESS in (0, 1]."""
        n = max(self.tokens, 1.0)
        return {
            "is/w_mean": self.w_sum / n,
            "is/w_min": self.w_min if self.tokens else 1.0,
            "is/w_max": self.w_max if self.tokens else 1.0,
            "is/ess": (self.w_sum**2) / (n * self.w_sq_sum) if self.w_sq_sum > 0 else 1.0,
            "is/masked_frac": self.is_masked / n,
            "loss/clipped_frac": self.clipped / n,
            "kl/sampler_vs_learner": self.kl_behav_sum / n,
            "kl/ref": self.kl_ref_sum / n,
        }


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's unbiased, non-negative KL estimator ``e^x - 1 - x`` with ``x = log q/p``."""
    return torch.expm1(log_ratio) - log_ratio


def importance_log_weights(
    logp_prox_T: torch.Tensor,
    logp_behav_T: torch.Tensor,
    mask_T: torch.Tensor,
    seq_index_T: torch.Tensor,
    num_seqs: int,
    level: Literal["token", "sequence_sum", "sequence_mean"],
) -> torch.Tensor:
    """(N,) log importance weight per token (no gradient), 0 where masked."""
    log_w = torch.where(mask_T, logp_prox_T.detach() - logp_behav_T, torch.zeros_like(logp_prox_T))
    if level == "token":
        return log_w
    seq_sum = log_w.new_zeros(num_seqs).index_add_(0, seq_index_T, log_w)
    if level == "sequence_mean":
        counts = log_w.new_zeros(num_seqs).index_add_(0, seq_index_T, mask_T.to(log_w.dtype))
        seq_sum = seq_sum / counts.clamp(min=1.0)
    return torch.where(mask_T, seq_sum[seq_index_T], torch.zeros_like(log_w))


def grpo_loss(
    logp_T: torch.Tensor,
    logp_prox_T: torch.Tensor,
    logp_behav_T: torch.Tensor,
    advantages_T: torch.Tensor,
    mask_T: torch.Tensor,
    token_scale_T: torch.Tensor,
    seq_index_T: torch.Tensor,
    num_seqs: int,
    cfg: LossConfig,
    logp_ref_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Scalar loss of one packed micro-batch (already normalised) and its statistics."""
    zeros = torch.zeros_like(logp_T)
    logp_prox_T = logp_prox_T.detach()
    log_ratio = torch.where(mask_T, logp_T - logp_prox_T, zeros)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    surrogate = torch.minimum(ratio * advantages_T, clipped_ratio * advantages_T)

    log_w = importance_log_weights(
        logp_prox_T, logp_behav_T, mask_T, seq_index_T, num_seqs, cfg.is_level
    )
    raw_w = torch.exp(log_w)
    keep = mask_T.clone()
    if cfg.is_mode == "truncate":
        w = raw_w.clamp(max=cfg.is_cap)
    elif cfg.is_mode == "mask":
        inside = (raw_w >= cfg.is_lo) & (raw_w <= cfg.is_hi)
        keep = keep & inside
        w = torch.where(inside, raw_w, zeros)
    else:
        w = torch.ones_like(raw_w)

    per_token = -w * surrogate
    kl_ref = zeros
    if cfg.kl_coef and logp_ref_T is not None:
        kl_ref = torch.where(mask_T, k3(logp_ref_T.detach() - logp_T), zeros)
        per_token = per_token + cfg.kl_coef * kl_ref
    loss = (per_token * token_scale_T * mask_T).sum()

    with torch.no_grad():
        m = mask_T
        n = float(m.sum())
        is_clipped = (ratio * advantages_T > clipped_ratio * advantages_T) & m
        stats = LossStats(
            tokens=n,
            w_sum=float(raw_w[m].sum()),
            w_sq_sum=float((raw_w[m] ** 2).sum()),
            w_min=float(raw_w[m].min()) if n else float("inf"),
            w_max=float(raw_w[m].max()) if n else float("-inf"),
            clipped=float(is_clipped.sum()),
            is_masked=float((m & ~keep).sum()),
            kl_behav_sum=float(k3(torch.where(m, logp_prox_T - logp_behav_T, zeros)).sum()),
            kl_ref_sum=float(kl_ref.sum()),
        )
    return loss, stats
