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

Options (formulas and sources on the fields of ``sandpiper.config.LearnerConfig``): the
policy term is PPO's, GSPO's (sequence ratio) or CISPO's (clipped stop-gradient weight);
samples can be rejected by a k1/k2/k3 divergence between learner and sampler (token or
sequence level) and masked by M2PO; the KL term can carry its importance correction. On
on-policy data (behaviour = proximal) every correction is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

from sandpiper.config import LearnerConfig
from sandpiper.trainer.corrections import gspo_log_ratio, m2po_keep, rejection_keep

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
    objective: Literal["ppo", "gspo", "cispo"] = _LEARNER.objective
    reject: Literal["none", "k1", "k2", "k3"] = _LEARNER.reject
    reject_level: Literal["token", "sequence_sum", "sequence_mean", "sequence_max"] = (
        _LEARNER.reject_level
    )
    reject_lo: float = float("-inf")
    """``LearnerConfig.reject_lo`` with None (no bound) as -inf."""
    reject_hi: float = float("inf")
    m2po_tau: float = _LEARNER.m2po_tau
    kl_is_correction: bool = _LEARNER.kl_is_correction

    @classmethod
    def from_learner(cls, learner: LearnerConfig) -> LossConfig:
        values = {f.name: getattr(learner, f.name) for f in fields(cls)}
        for name, unbounded in (("reject_lo", float("-inf")), ("reject_hi", float("inf"))):
            if values[name] is None:
                values[name] = unbounded
        return cls(**values)


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
    applied_w_sum: float = 0.0
    """Sum of the weights the loss applied (truncated; 0 where masked, rejected or dropped
    by M2PO): the effective sample size of what was trained on."""
    applied_w_sq_sum: float = 0.0
    rejected: float = 0.0
    """Loss tokens removed by divergence rejection (``reject``)."""
    m2po_masked: float = 0.0
    """Loss tokens removed by the M2PO mask."""
    dropped: float = 0.0
    """Loss tokens with no policy gradient for any of the above reasons (IS mask included)."""
    truncated: float = 0.0
    """Loss tokens whose importance weight was truncated at ``is_cap``."""

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(
            **{
                f.name: (min if f.name == "w_min" else max if f.name == "w_max" else _add)(
                    getattr(self, f.name), getattr(other, f.name)
                )
                for f in fields(LossStats)
            }
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
            "is/ess_applied": (
                (self.applied_w_sum**2) / (n * self.applied_w_sq_sum)
                if self.applied_w_sq_sum > 0
                else (1.0 if not self.tokens else 0.0)
            ),
            "is/rejected_frac": self.rejected / n,
            "is/m2po_masked_frac": self.m2po_masked / n,
            "is/dropped_frac": self.dropped / n,
            "is/truncated_frac": self.truncated / n,
        }


def _add(a: float, b: float) -> float:
    return a + b


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
    token_log_ratio = torch.where(mask_T, logp_T - logp_prox_T, zeros)
    if cfg.objective == "gspo":
        log_ratio = gspo_log_ratio(logp_T, logp_prox_T, mask_T, seq_index_T, num_seqs)
    else:
        log_ratio = token_log_ratio
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    if cfg.objective == "cispo":
        # value clip(r) A, gradient clip(r) A grad(logp): exp(l - sg[l]) is 1 with l's gradient
        surrogate = (
            clipped_ratio.detach() * advantages_T * torch.exp(log_ratio - log_ratio.detach())
        )
    else:
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

    x_T = torch.where(mask_T, logp_prox_T - logp_behav_T, zeros)  # token behaviour log-ratio
    rejection = m2po = accepted = mask_T
    if cfg.reject != "none":
        rejection = rejection_keep(
            x_T, mask_T, seq_index_T, num_seqs, kind=cfg.reject, level=cfg.reject_level,
            lo=cfg.reject_lo, hi=cfg.reject_hi,
        )  # fmt: skip
        accepted = accepted & rejection
    if cfg.m2po_tau > 0:
        m2po = m2po_keep(x_T, advantages_T, mask_T, cfg.m2po_tau)
        accepted = accepted & m2po

    per_token = -w * surrogate
    kl_ref = zeros
    if cfg.kl_coef and logp_ref_T is not None:
        kl_ref = torch.where(mask_T, k3(logp_ref_T.detach() - logp_T), zeros)
        kl_term = kl_ref * torch.exp(token_log_ratio) * w if cfg.kl_is_correction else kl_ref
        per_token = per_token + cfg.kl_coef * kl_term
    if accepted is not mask_T:  # rejected / M2PO-masked tokens leave the loss entirely
        per_token = torch.where(accepted, per_token, zeros)
    loss = (per_token * token_scale_T * mask_T).sum()

    with torch.no_grad():
        m = mask_T
        n = float(m.sum())
        if cfg.objective == "cispo":
            is_clipped = (ratio != clipped_ratio) & m
        else:
            is_clipped = (ratio * advantages_T > clipped_ratio * advantages_T) & m
        applied = torch.where(accepted & keep, w, zeros)[m]
        stats = LossStats(
            tokens=n,
            w_sum=float(raw_w[m].sum()),
            w_sq_sum=float((raw_w[m] ** 2).sum()),
            w_min=float(raw_w[m].min()) if n else float("inf"),
            w_max=float(raw_w[m].max()) if n else float("-inf"),
            clipped=float(is_clipped.sum()),
            is_masked=float((m & ~keep).sum()),
            kl_behav_sum=float(k3(x_T).sum()),
            kl_ref_sum=float(kl_ref.sum()),
            applied_w_sum=float(applied.sum()),
            applied_w_sq_sum=float((applied**2).sum()),
            rejected=float((m & ~rejection).sum()),
            m2po_masked=float((m & ~m2po).sum()),
            dropped=float((m & ~(accepted & keep)).sum()),
            truncated=float((m & (raw_w > cfg.is_cap)).sum()) if cfg.is_mode == "truncate" else 0.0,
        )
    return loss, stats
