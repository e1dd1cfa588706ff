"""GRPO group advantages.

Each group holds G samples of the same prompt. An episode's advantage is its reward relative
to the other *valid* episodes of its group: ``(r - mean) / (std + eps)`` (``"std"``),
``r - mean`` (``"mean"``, Dr. GRPO) or ``(r - mean) / (std_batch + eps)`` (``"batch_std"``,
the group mean and the std of every valid reward of the batch: "Lite PPO" of Liu et al.
2025, "Part I: Tricks or Traps?"). Invalid episodes (infrastructure failures) carry no
reward signal: they are excluded from the statistics and get no advantage (never scored 0).
A group whose valid rewards are all equal has zero advantage everywhere; it is counted and
skipped so it costs no forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from sandpiper.store.records import MIN_VALID_EPISODES, TrainGroup


@dataclass(frozen=True, slots=True)
class GroupAdvantages:
    """Advantages of one group; ``None`` for each invalid (excluded) episode."""

    group_id: str
    advantages_G: tuple[float | None, ...]
    """One entry per episode of the group, in the group's order."""


@dataclass(frozen=True, slots=True)
class AdvantageStats:
    """What happened to a batch of groups; all of it goes to the step metrics."""

    kept: tuple[GroupAdvantages, ...]
    """Groups with a non-zero reward spread, ready to train on."""
    zero_variance_groups: int
    """Groups skipped because every valid reward was equal."""
    too_few_valid_groups: int
    """Groups skipped because fewer than ``MIN_VALID_EPISODES`` episodes were valid."""
    invalid_episodes: int
    rewards: np.ndarray
    """float64 rewards of all valid episodes of the batch (for reward stats)."""


def group_advantages(
    rewards_G: Sequence[float | None],
    valid_G: Sequence[bool],
    *,
    mode: Literal["std", "mean"] = "std",
    eps: float = 1e-6,
) -> np.ndarray | None:
    """Advantages of one group as float64 with NaN for invalid episodes.

    Returns None when fewer than ``MIN_VALID_EPISODES`` (the store's rule) episodes are
    valid or when all valid rewards are equal.
    """
    valid = np.array(valid_G, dtype=bool) & np.array([r is not None for r in rewards_G])
    if valid.sum() < MIN_VALID_EPISODES:
        return None
    rewards = np.array([r if ok else np.nan for r, ok in zip(rewards_G, valid, strict=True)])
    centred = rewards - np.nanmean(rewards)
    spread = float(np.nanstd(rewards))  # population std, as in the GRPO paper's code
    if spread == 0.0:
        return None
    return centred / (spread + eps) if mode == "std" else centred


def batch_advantages(
    groups: Sequence[TrainGroup], *, mode: Literal["std", "mean", "batch_std"], eps: float
) -> AdvantageStats:
    """Compute advantages for every group of a batch and count what was skipped."""
    kept: list[GroupAdvantages] = []
    zero_variance = too_few = invalid = 0
    all_rewards: list[float] = []
    for group in groups:
        valid = [e.valid and e.reward is not None for e in group.episodes]
        invalid += valid.count(False)
        all_rewards.extend(
            e.reward
            for e, ok in zip(group.episodes, valid, strict=True)
            if ok and e.reward is not None
        )
    batch_spread = float(np.std(all_rewards)) if all_rewards else 0.0
    for group in groups:
        rewards = [e.reward for e in group.episodes]
        valid = [e.valid and e.reward is not None for e in group.episodes]
        group_mode = "mean" if mode == "batch_std" else mode
        adv = group_advantages(rewards, valid, mode=group_mode, eps=eps)
        if adv is not None and mode == "batch_std":
            adv = adv / (batch_spread + eps)
        if adv is None:
            if sum(valid) < MIN_VALID_EPISODES:
                too_few += 1
            else:
                zero_variance += 1
            continue
        kept.append(
            GroupAdvantages(group.group_id, tuple(None if np.isnan(a) else float(a) for a in adv))
        )
    return AdvantageStats(
        tuple(kept), zero_variance, too_few, invalid, np.asarray(all_rewards, dtype=np.float64)
    )
