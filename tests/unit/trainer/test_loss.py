"""Correctness of the GRPO loss with importance correction and of group advantages.

(a) on a categorical policy, the importance-corrected gradient from samples of a different
behaviour policy matches the exact on-policy gradient; (b) with behaviour = current policy
every weight is exactly 1 and the loss equals plain GRPO.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sandpiper.trainer.advantages import batch_advantages, group_advantages
from sandpiper.trainer.loss import LossConfig, grpo_loss


def _token_loss(logp, prox, behav, adv, cfg, seq_index=None, num_seqs=None, ref=None):
    n = logp.shape[0]
    seq_index = torch.arange(n) if seq_index is None else seq_index
    return grpo_loss(
        logp,
        prox,
        behav,
        adv,
        torch.ones(n, dtype=torch.bool),
        torch.full((n,), 1.0 / n),
        seq_index,
        num_seqs or n,
        cfg,
        ref,
    )


def test_importance_corrected_gradient_matches_exact_on_policy_gradient() -> None:
    torch.manual_seed(0)
    k = 6
    theta = torch.randn(k, requires_grad=True)
    reward_K = torch.linspace(-1.0, 2.0, k)
    behaviour_K = torch.softmax(torch.randn(k) * 1.5, 0)  # clearly not the policy

    pi = torch.softmax(theta, 0)
    exact = torch.autograd.grad((pi * reward_K).sum(), theta)[0]

    n = 400_000
    x_N = torch.multinomial(behaviour_K, n, replacement=True)
    logp_N = torch.log_softmax(theta, 0)[x_N]
    cfg = LossConfig(is_mode="truncate", is_cap=1e9)  # no truncation: unbiased
    loss, stats = _token_loss(logp_N, logp_N.detach(), behaviour_K.log()[x_N], reward_K[x_N], cfg)
    estimate = -torch.autograd.grad(loss, theta)[0]

    # The estimator is a mean of n iid terms: compare within 5 standard errors.
    w_N = (pi.detach()[x_N] / behaviour_K[x_N]) * reward_K[x_N]
    score_NK = torch.nn.functional.one_hot(x_N, k) - pi.detach()
    se_K = (w_N[:, None] * score_NK).std(0) / n**0.5
    assert torch.all((estimate - exact).abs() < 5 * se_K + 1e-6), (estimate, exact, se_K)
    assert stats.w_max > 1.5  # the weights really did correct something

    # Without correction the same samples estimate the wrong gradient.
    logp_N = torch.log_softmax(theta, 0)[x_N]
    plain, _ = _token_loss(
        logp_N, logp_N.detach(), behaviour_K.log()[x_N], reward_K[x_N], LossConfig(is_mode="none")
    )
    biased = -torch.autograd.grad(plain, theta)[0]
    assert (biased - exact).abs().max() > 20 * se_K.max()


def _plain_grpo(logp, old, adv, eps_low, eps_high):
    ratio = torch.exp(logp - old)
    return -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv).mean()


@pytest.mark.parametrize("level", ["token", "sequence_sum", "sequence_mean"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_on_policy_weights_are_exactly_one_and_loss_is_plain_grpo(level, mode) -> None:
    torch.manual_seed(1)
    n = 64
    old = -torch.rand(n) * 3
    logp = (old + torch.randn(n) * 0.3).requires_grad_()
    adv = torch.randn(n)
    seq_index = torch.arange(n) // 8
    cfg = LossConfig(is_level=level, is_mode=mode, eps_low=0.2, eps_high=0.28)
    loss, stats = _token_loss(logp, old, old.clone(), adv, cfg, seq_index, 8)
    s = stats.summary()
    assert s["is/w_min"] == 1.0 and s["is/w_max"] == 1.0 and s["is/w_mean"] == 1.0
    assert s["is/ess"] == pytest.approx(1.0) and s["is/masked_frac"] == 0.0
    expected = _plain_grpo(logp, old, adv, 0.2, 0.28)
    assert torch.allclose(loss, expected, atol=1e-6)
    g1 = torch.autograd.grad(loss, logp)[0]
    g2 = torch.autograd.grad(expected, logp)[0]
    assert torch.allclose(g1, g2, atol=1e-7)
    assert 0 < s["loss/clipped_frac"] < 1


def test_truncation_caps_and_mask_drops_out_of_range_weights() -> None:
    logp = torch.zeros(4, requires_grad=True)
    behav = torch.log(torch.tensor([1 / 4, 1 / 1.5, 1.0, 8.0]))  # w = 4, 1.5, 1, 1/8
    adv = torch.ones(4)
    trunc, st = _token_loss(logp, logp.detach(), behav, adv, LossConfig(is_cap=2.0))
    assert trunc.item() == pytest.approx(-(2 + 1.5 + 1 + 0.125) / 4)
    assert st.summary()["is/w_max"] == pytest.approx(4.0)
    masked, sm = _token_loss(
        logp, logp.detach(), behav, adv, LossConfig(is_mode="mask", is_lo=0.5, is_hi=2.0)
    )
    assert masked.item() == pytest.approx(-(1.5 + 1) / 4)
    assert sm.summary()["is/masked_frac"] == pytest.approx(0.5)


def test_sequence_level_weight_is_product_or_geometric_mean() -> None:
    logp = torch.zeros(4, requires_grad=True)
    behav = torch.log(torch.tensor([0.5, 0.5, 1.0, 0.25]))  # token w = 2, 2 | 1, 4
    seq = torch.tensor([0, 0, 1, 1])
    adv = torch.ones(4)
    for level, (a, b) in {"sequence_sum": (4.0, 4.0), "sequence_mean": (2.0, 2.0)}.items():
        cfg = LossConfig(is_level=level, is_mode="none")
        _, st = _token_loss(logp, logp.detach(), behav, adv, cfg, seq, 2)
        assert st.w_max == pytest.approx(max(a, b)) and st.w_min == pytest.approx(min(a, b))


def test_kl_to_reference_is_zero_at_reference_and_positive_elsewhere() -> None:
    logp = torch.log(torch.tensor([0.5, 0.2])).requires_grad_()
    adv = torch.zeros(2)
    cfg = LossConfig(kl_coef=0.1)
    at_ref, _ = _token_loss(logp, logp.detach(), logp.detach(), adv, cfg, ref=logp.detach())
    assert at_ref.item() == pytest.approx(0.0)
    away, st = _token_loss(logp, logp.detach(), logp.detach(), adv, cfg, ref=logp.detach() - 1)
    assert away.item() > 0 and st.summary()["kl/ref"] > 0


def test_group_advantages_exclude_invalid_and_skip_zero_variance() -> None:
    adv = group_advantages([1.0, 0.0, None, 1.0], [True, True, False, True], mode="std")
    assert adv is not None and np.isnan(adv[2])
    valid = adv[[0, 1, 3]]
    assert valid.mean() == pytest.approx(0.0) and valid.std() == pytest.approx(1.0, rel=1e-4)
    assert group_advantages([0.5, 0.5, 0.0], [True, True, False], mode="std") is None
    assert group_advantages([1.0, 0.0], [True, False], mode="mean") is None
    mean_only = group_advantages([3.0, 1.0], [True, True], mode="mean")
    assert mean_only.tolist() == [1.0, -1.0]


def test_batch_advantages_counts_what_it_skipped() -> None:
    from sandpiper.store.records import TrainEpisode, TrainGroup

    def ep(r, ok=True):
        e = np.zeros(2, np.int32)
        return TrainEpisode("e", r, ok, e, e.astype(bool), e.astype(np.float32), e)

    groups = [
        TrainGroup("a", "t", 0, (ep(1.0), ep(0.0), ep(None, False))),
        TrainGroup("b", "t", 0, (ep(1.0), ep(1.0))),
        TrainGroup("c", "t", 0, (ep(1.0), ep(None, False))),
    ]
    stats = batch_advantages(groups, mode="std", eps=1e-6)
    assert [g.group_id for g in stats.kept] == ["a"]
    assert stats.kept[0].advantages_G[2] is None
    assert (stats.zero_variance_groups, stats.too_few_valid_groups) == (1, 1)
    assert stats.invalid_episodes == 2 and len(stats.rewards) == 5


def test_loss_config_follows_the_learner_config() -> None:
    from sandpiper.config import LearnerConfig

    custom = LearnerConfig(eps_low=0.1, is_mode="mask", is_lo=0.3, kl_coef=0.05)
    cfg = LossConfig.from_learner(custom)
    assert (cfg.eps_low, cfg.is_mode, cfg.is_lo, cfg.kl_coef) == (0.1, "mask", 0.3, 0.05)
    assert LossConfig() == LossConfig.from_learner(LearnerConfig())
