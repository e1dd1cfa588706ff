"""The loss options (GSPO, CISPO, divergence rejection, M2PO, the KL importance correction,
batch-std advantages) against independent float64 implementations of their formulas written
here with loops, and the special case every correction must meet: on on-policy data
(sampler = learner = proximal policy) each one leaves plain GRPO unchanged.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sandpiper.trainer.advantages import batch_advantages
from sandpiper.trainer.corrections import m2po_keep, rejection_keep
from sandpiper.trainer.loss import LossConfig, grpo_loss

S, L = 6, 7
"""Sequences and loss tokens per sequence of the synthetic micro-batch."""


def _batch(seed: int, *, spread: float = 0.3, drift: float = 0.15, dtype=torch.float64):
    """Flat per-token tensors of S sequences of L tokens with a sequence-mean normaliser."""
    g = torch.Generator().manual_seed(seed)
    n = S * L
    seq = torch.arange(n) // L
    prox = -torch.rand(n, generator=g, dtype=dtype) * 3 - 0.05
    behav = prox - torch.randn(n, generator=g, dtype=dtype) * spread
    logp = prox + torch.randn(n, generator=g, dtype=dtype) * drift
    adv = torch.randn(S, generator=g, dtype=dtype)[seq]
    mask = torch.ones(n, dtype=torch.bool)
    mask[torch.arange(S) * L] = False  # first token of every sequence is context
    counts = torch.bincount(seq, weights=mask.to(dtype))
    scale = 1.0 / (counts[seq] * S)
    return logp, prox, behav, adv, mask, scale, seq


def _run(cfg: LossConfig, logp, prox, behav, adv, mask, scale, seq, ref=None):
    logp = logp.clone().requires_grad_()
    loss, stats = grpo_loss(logp, prox, behav, adv, mask, scale, seq, S, cfg, ref)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad.numpy(), stats


def _np(*ts):
    return [t.detach().numpy().astype(np.float64) for t in ts]


# ---- GSPO ------------------------------------------------------------------------------


def test_gspo_matches_the_sequence_level_objective_of_the_paper() -> None:
    """J = 1/S sum_i w_i min(s_i A_i, clip(s_i) A_i), s_i = (prod_t r_t)^(1/|y_i|), written per
    sequence (not the GSPO-token form the loss uses); equal in value and gradient."""
    logp, prox, behav, adv, mask, scale, seq = _batch(3, drift=0.02)
    cfg = LossConfig(objective="gspo", eps_low=3e-3, eps_high=4e-3, is_level="sequence_mean",
                     is_mode="truncate", is_cap=1.2)  # fmt: skip
    value, grad, stats = _run(cfg, logp, prox, behav, adv, mask, scale, seq)

    lp = logp.clone().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    clipped_seqs = 0
    for i in range(S):
        toks = [t for t in range(i * L, (i + 1) * L) if mask[t]]
        log_s = sum(lp[t] - prox[t] for t in toks) / len(toks)
        s = torch.exp(log_s)
        w = min(math.exp(sum(float(prox[t] - behav[t]) for t in toks) / len(toks)), 1.2)
        a = float(adv[toks[0]])
        clip_s = torch.clamp(s, 1 - 3e-3, 1 + 4e-3)
        clipped_seqs += bool(s.item() * a > clip_s.item() * a)
        total = total - w * torch.minimum(s * a, clip_s * a) / S
    (expected_grad,) = torch.autograd.grad(total, lp)
    assert value == pytest.approx(total.item(), rel=1e-13)
    np.testing.assert_allclose(grad, expected_grad.numpy(), rtol=1e-12, atol=1e-15)
    assert 0 < clipped_seqs < S  # the data exercises both branches
    assert stats.clipped == clipped_seqs * (L - 1)


# ---- CISPO -----------------------------------------------------------------------------


def test_cispo_clips_the_stop_gradient_weight_and_keeps_every_token_gradient() -> None:
    """J = sum_t c_t w_t sg[clip(r_t)] A_t log pi(y_t): the gradient of the paper's form; the
    loss value is sum_t c_t w_t clip(r_t) A_t (the log factor is replaced by exp(l - sg l))."""
    logp, prox, behav, adv, mask, scale, seq = _batch(4, drift=0.3)
    cfg = LossConfig(objective="cispo", eps_low=1.0, eps_high=0.2, is_mode="truncate", is_cap=2)
    value, grad, stats = _run(cfg, logp, prox, behav, adv, mask, scale, seq)

    lp, pr, be, a, c = _np(logp, prox, behav, adv, scale)
    exp_value, exp_grad, clipped = 0.0, np.zeros_like(lp), 0
    for t in range(len(lp)):
        if not mask[t]:
            continue
        r = math.exp(lp[t] - pr[t])
        clip_r = min(max(r, 1 - 1.0), 1 + 0.2)
        clipped += clip_r != r
        w = min(math.exp(pr[t] - be[t]), 2.0)
        exp_value -= c[t] * w * clip_r * a[t]
        exp_grad[t] = -c[t] * w * clip_r * a[t]  # d/dlogp of -c w sg[clip r] A logp
    assert value == pytest.approx(exp_value, rel=1e-13)
    np.testing.assert_allclose(grad, exp_grad, rtol=1e-12, atol=1e-15)
    assert clipped > 0 and stats.clipped == clipped
    # Unlike PPO, a clipped token still has a gradient.
    assert np.count_nonzero(grad[mask.numpy()]) == int(mask.sum())


# ---- divergence rejection ----------------------------------------------------------------


def _divergence(x: float, kind: str) -> float:
    return {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[kind]


def _token_divergences(x, mask, kind, level):
    """Per loss token, the divergence its keep decision reads (its own or its sequence's)."""
    d = np.full(len(x), np.nan)
    for i in range(S):
        toks = [t for t in range(i * L, (i + 1) * L) if mask[t]]
        ds = [_divergence(x[t], kind) for t in toks]
        if level == "token":
            d[toks] = ds
            continue
        d[toks] = {"sequence_sum": sum(ds), "sequence_mean": sum(ds) / len(ds),
                   "sequence_max": max(ds)}[level]  # fmt: skip
    return d


def _ppo_terms(lp, pr, be, a, c, eps_low, eps_high, cap):
    """Per-token -c w min(rA, clip(r)A) and its derivative, plain float64 loops."""
    value, grad = np.zeros(len(lp)), np.zeros(len(lp))
    for t in range(len(lp)):
        r = math.exp(lp[t] - pr[t])
        w = min(math.exp(pr[t] - be[t]), cap)
        clip_r = min(max(r, 1 - eps_low), 1 + eps_high)
        value[t] = -c[t] * w * min(r * a[t], clip_r * a[t])
        unclipped = r * a[t] <= clip_r * a[t] or clip_r == r
        grad[t] = -c[t] * w * r * a[t] if unclipped else 0.0
    return value, grad


REJECTIONS = [
    (kind, level)
    for level in ("token", "sequence_sum", "sequence_mean", "sequence_max")
    for kind in ("k1", "k2", "k3")
]


@pytest.mark.parametrize(("kind", "level"), REJECTIONS)
def test_divergence_rejection_matches_loops(kind, level) -> None:
    logp, prox, behav, adv, mask, scale, seq = _batch(5, spread=0.2)
    lp, pr, be, a, c = _np(logp, prox, behav, adv, scale)
    d = _token_divergences(pr - be, mask.numpy(), kind, level)
    # Bounds inside the data's range, so that some tokens are kept and some rejected; k1
    # (which can be negative) is bounded on both sides, as verl bounds it.
    lo = float(np.nanquantile(d, 0.2)) if kind == "k1" else -math.inf
    hi = float(np.nanquantile(d, 0.75))
    keep = mask.numpy() & (d >= lo) & (d <= hi)
    assert 0 < keep.sum() < mask.sum()

    cfg = LossConfig(reject=kind, reject_level=level, reject_lo=lo, reject_hi=hi, is_cap=3.0)
    value, grad, stats = _run(cfg, logp, prox, behav, adv, mask, scale, seq)
    got = rejection_keep(prox - behav, mask, seq, S, kind=kind, level=level, lo=lo, hi=hi)
    np.testing.assert_array_equal(got.numpy(), keep)
    terms, dterms = _ppo_terms(lp, pr, be, a, c, 0.2, 0.28, 3.0)
    assert value == pytest.approx(terms[keep].sum(), rel=1e-13)
    np.testing.assert_allclose(grad, np.where(keep, dterms, 0.0), rtol=1e-12, atol=1e-15)
    assert stats.rejected == mask.sum().item() - keep.sum()


# ---- M2PO ------------------------------------------------------------------------------


def _m2po_loop(x, adv, mask, tau):
    """Algorithm 1 of the paper, literally: drop the largest x^2 while the mean is above tau."""
    keep = mask.copy()
    trust = [t for t in range(len(x)) if mask[t] and ((adv[t] > 0 and x[t] > 0)
                                                     or (adv[t] < 0 and x[t] < 0))]  # fmt: skip
    while trust and sum(x[t] ** 2 for t in trust) / len(trust) > tau:
        j = max(trust, key=lambda t: x[t] ** 2)
        keep[j] = False
        trust.remove(j)
    return keep


@pytest.mark.parametrize("tau", [0.001, 0.01, 0.04, 0.2, 1e-9])
def test_m2po_mask_matches_the_papers_loop(tau) -> None:
    logp, prox, behav, adv, mask, scale, seq = _batch(6, spread=0.3)
    x, a = _np(prox - behav, adv)
    expected = _m2po_loop(x, a, mask.numpy(), tau)
    got = m2po_keep(prox - behav, adv, mask, tau)
    np.testing.assert_array_equal(got.numpy(), expected)

    cfg = LossConfig(m2po_tau=tau, is_mode="none", eps_low=0.2, eps_high=1e9)
    value, grad, stats = _run(cfg, logp, prox, behav, adv, mask, scale, seq)
    lp, pr, c = _np(logp, prox, scale)
    terms, dterms = _ppo_terms(lp, pr, pr, a, c, 0.2, 1e9, 1.0)  # is_mode none: w = 1
    assert value == pytest.approx(terms[expected].sum(), rel=1e-13)
    np.testing.assert_allclose(grad, np.where(expected, dterms, 0.0), rtol=1e-12, atol=1e-15)
    assert stats.m2po_masked == int(mask.sum()) - int(expected.sum())


def test_m2po_masks_only_trust_region_tokens_and_meets_the_bound() -> None:
    _, prox, behav, adv, mask, _, _ = _batch(7, spread=0.5)
    keep = m2po_keep(prox - behav, adv, mask, 0.04).numpy()
    x, a = _np(prox - behav, adv)
    trust = mask.numpy() & (a * x > 0)
    assert (~keep & mask.numpy() & ~trust).sum() == 0
    left = trust & keep
    assert (~keep & mask.numpy()).any() and (x[left] ** 2).mean() <= 0.04


# ---- the KL importance correction ------------------------------------------------------


def test_kl_correction_matches_its_formula() -> None:
    """Per token c (-w min(rA, clip(r)A) + beta * k3(ref - logp) * r * w), r with gradient."""
    logp, prox, behav, adv, mask, scale, seq = _batch(8)
    ref = prox - 0.3 * torch.rand(
        len(prox), dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    cfg = LossConfig(kl_coef=0.1, kl_is_correction=True, is_cap=5.0)
    value, grad, _ = _run(cfg, logp, prox, behav, adv, mask, scale, seq, ref)

    lp, pr, be, a, c, rf = _np(logp, prox, behav, adv, scale, ref)
    terms, dterms = _ppo_terms(lp, pr, be, a, c, 0.2, 0.28, 5.0)
    exp_value, exp_grad = 0.0, np.zeros(len(lp))
    for t in range(len(lp)):
        if not mask[t]:
            continue
        w = min(math.exp(pr[t] - be[t]), 5.0)
        r = math.exp(lp[t] - pr[t])
        d = rf[t] - lp[t]
        k3 = math.exp(d) - d - 1
        dk3 = -math.exp(d) + 1  # d k3 / d logp
        exp_value += terms[t] + c[t] * 0.1 * k3 * r * w
        exp_grad[t] = dterms[t] + c[t] * 0.1 * w * (k3 * r + r * dk3)
    assert value == pytest.approx(exp_value, rel=1e-13)
    np.testing.assert_allclose(grad, exp_grad, rtol=1e-12, atol=1e-15)


def test_kl_correction_makes_the_gradient_that_of_the_true_kl() -> None:
    """On a categorical policy, the mean over samples of the corrected term's gradient is
    grad KL(pi || ref); without the correction it is grad KL(ref || pi), another quantity."""
    torch.manual_seed(0)
    k = 5
    theta = torch.randn(k, dtype=torch.float64, requires_grad=True)
    ref_K = torch.log_softmax(torch.randn(k, dtype=torch.float64), 0)
    log_pi = torch.log_softmax(theta, 0)
    pi = log_pi.exp()
    (exact,) = torch.autograd.grad((pi * (log_pi - ref_K)).sum(), theta)
    log_pi = torch.log_softmax(theta, 0)
    (reverse,) = torch.autograd.grad((ref_K.exp() * (ref_K - log_pi)).sum(), theta)

    def expected_grad(correct: bool) -> torch.Tensor:
        # The expectation over samples x ~ pi, computed exactly by summing over the k values.
        cfg = LossConfig(kl_coef=1.0, kl_is_correction=correct, is_mode="none")
        lp = torch.log_softmax(theta, 0)
        x = torch.arange(k)
        zeros = torch.zeros(k, dtype=torch.float64)
        loss, _ = grpo_loss(
            lp[x],
            lp[x].detach(),
            lp[x].detach(),
            zeros,
            torch.ones(k, dtype=torch.bool),
            pi.detach(),
            x,
            k,
            cfg,
            ref_K[x],
        )
        return torch.autograd.grad(loss, theta)[0]

    torch.testing.assert_close(expected_grad(True), exact, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(expected_grad(False), reverse, rtol=1e-12, atol=1e-14)
    assert (exact - reverse).abs().max() > 1e-2


# ---- batch-level reward scaling --------------------------------------------------------


def _episode(reward, valid=True):
    from sandpiper.store.records import TrainEpisode

    e = np.zeros(2, np.int32)
    return TrainEpisode("e", reward, valid, e, e.astype(bool), e.astype(np.float32), e)


def test_batch_std_divides_group_centred_rewards_by_the_batch_std() -> None:
    from sandpiper.store.records import TrainGroup

    rewards = [[1.0, 0.0, 0.5, None], [1.0, 1.0, 1.0], [0.0, 0.2, 0.9]]
    groups = [
        TrainGroup(f"g{i}", "t", 0, tuple(_episode(r, r is not None) for r in rs))
        for i, rs in enumerate(rewards)
    ]
    stats = batch_advantages(groups, mode="batch_std", eps=1e-6)
    valid = [r for rs in rewards for r in rs if r is not None]
    mean_b = sum(valid) / len(valid)
    std_b = math.sqrt(sum((r - mean_b) ** 2 for r in valid) / len(valid))
    expected = {}
    for i, rs in enumerate(rewards):
        vs = [r for r in rs if r is not None]
        m = sum(vs) / len(vs)
        if len(set(vs)) > 1:
            expected[f"g{i}"] = [None if r is None else (r - m) / (std_b + 1e-6) for r in rs]
    assert {g.group_id for g in stats.kept} == set(expected)
    for g in stats.kept:
        for got, want in zip(g.advantages_G, expected[g.group_id], strict=True):
            assert (got is None and want is None) or got == pytest.approx(want, rel=1e-14)
    assert stats.zero_variance_groups == 1  # the all-equal group still counts in std_b


def test_batch_std_of_one_group_is_group_std() -> None:
    from sandpiper.store.records import TrainGroup

    group = TrainGroup("g", "t", 0, tuple(_episode(r) for r in (0.0, 1.0, 0.25, 1.0)))
    a = batch_advantages([group], mode="batch_std", eps=1e-6).kept[0].advantages_G
    b = batch_advantages([group], mode="std", eps=1e-6).kept[0].advantages_G
    assert a == pytest.approx(b, rel=1e-15)


# ---- on-policy data: every correction is the identity ----------------------------------

ON_POLICY = [
    LossConfig(objective="gspo"),
    LossConfig(objective="cispo"),
    LossConfig(objective="gspo", eps_low=3e-4, eps_high=4e-4),
    LossConfig(objective="cispo", eps_low=1.0, eps_high=0.01),
    *[
        LossConfig(reject=k, reject_level=lv, reject_lo=-1e-9, reject_hi=1e-9)
        for k, lv in REJECTIONS
    ],
    LossConfig(m2po_tau=1e-12),
    LossConfig(kl_is_correction=True, kl_coef=0.1),
    LossConfig(
        is_mode="mask", is_lo=0.999, is_hi=1.001, reject="k3", m2po_tau=1e-12, objective="cispo"
    ),
]


@pytest.mark.parametrize(
    "cfg",
    ON_POLICY,
    ids=lambda c: f"{c.objective}-{c.reject}-{c.reject_level}-{c.m2po_tau}-{c.kl_is_correction}",
)
def test_on_policy_data_makes_every_correction_the_identity(cfg: LossConfig) -> None:
    """Sampler = proximal = current policy (the first pass of a step): same loss, same
    gradient as plain PPO-GRPO, nothing rejected, masked or down-weighted."""
    _, prox, _, adv, mask, scale, seq = _batch(9)
    ref = prox - 0.2  # the KL term is the same with and without its correction here
    plain = LossConfig(kl_coef=cfg.kl_coef)
    v0, g0, _ = _run(plain, prox, prox, prox.clone(), adv, mask, scale, seq, ref)
    v1, g1, st = _run(cfg, prox, prox, prox.clone(), adv, mask, scale, seq, ref)
    assert v1 == pytest.approx(v0, rel=1e-14)
    if not cfg.kl_is_correction:  # its gradient differs on purpose (see the test above)
        np.testing.assert_allclose(g1, g0, rtol=1e-13, atol=1e-16)
    s = st.summary()
    assert s["is/dropped_frac"] == 0.0 and s["is/rejected_frac"] == 0.0
    assert s["is/m2po_masked_frac"] == 0.0 and s["is/ess_applied"] == pytest.approx(1.0)
    assert s["loss/clipped_frac"] == 0.0
