"""Ingest check of sampled tokens: an episode whose sampler output cannot be trained on is
stored as an infra failure instead of reaching the learner.

Every sampled token (the tokens of a ``trainable`` turn) needs a finite sampling logprob and a
policy version that is a finite non-negative integer. A NaN logprob would otherwise be mapped
to some number by whoever reads it (importance weight ``exp(logp_prox - ?)``), and a NaN
version cannot even be stored as an integer. Such an episode is marked invalid with stop reason
``bad_sampler_output`` and the cause in ``error``; nothing of it is lost: the stored logprobs
keep their non-finite values, the original stop reason and reward move into
``reward_breakdown["invalidated"]``, and only versions that are not integers become -1
(which ``EpisodeRecord.policy_version_range`` skips). The group's status then follows from its
valid episodes as usual (too few valid: ``invalid``).

:func:`check_group` is pure and idempotent. Groups are converted to Arrow first and the
converted buffers checked in one pass (``to_arrow.convert_groups``); only groups with a
suspect value go through :func:`check_group` (``to_arrow.checked_tables``), so every group
ends up as if it had been checked. The writer's ``put`` does this once per group and spools
the checked rows, which the commit inserts as they are; ``Store.write_groups`` does it for
a batch of records.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from sandpiper.store.records import EpisodeRecord, GroupRecord, StopReason, TurnRecord

log = logging.getLogger(__name__)


def _turn_problems(turn: TurnRecord) -> tuple[list[str], TurnRecord]:
    """What is wrong with a trainable turn's sampler output, and the turn made storable."""
    problems: list[str] = []
    n = len(turn.token_ids_T)
    if turn.logprobs_T is not None:
        lp = np.asarray(turn.logprobs_T, dtype=np.float64)
        bad = ~np.isfinite(lp)
        if bad.any():
            kinds = sorted({"nan" if np.isnan(v) else ("+inf" if v > 0 else "-inf")
                            for v in lp[bad]})  # fmt: skip
            problems.append(
                f"turn {turn.index}: {int(bad.sum())} of {n} sampled tokens have a non-finite "
                f"logprob ({', '.join(kinds)})"
            )
    if turn.policy_versions_T is not None:
        v = np.asarray(turn.policy_versions_T)
        if v.dtype.kind in "iu":
            bad = v < 0
        else:
            vf = v.astype(np.float64)
            with np.errstate(invalid="ignore"):
                bad = ~np.isfinite(vf) | (vf < 0) | (vf != np.round(vf))
        if bad.any():
            problems.append(
                f"turn {turn.index}: {int(bad.sum())} of {n} sampled tokens have no valid "
                "policy version (non-finite, negative or fractional)"
            )
            fixed = np.where(bad, -1, np.nan_to_num(v.astype(np.float64), nan=-1)).astype(np.int32)
            turn = dataclasses.replace(turn, policy_versions_T=fixed)
    return problems, turn


def check_episode(episode: EpisodeRecord) -> EpisodeRecord:
    """``episode`` unchanged when its sampler output is sound, else marked invalid."""
    if episode.stop_reason is StopReason.BAD_SAMPLER_OUTPUT:
        return episode  # already checked (write_groups may see a group twice)
    problems: list[str] = []
    turns = []
    for turn in episode.turns:
        if turn.trainable:
            found, turn = _turn_problems(turn)
            problems += found
        turns.append(turn)
    if not problems:
        return episode
    breakdown = dict(episode.reward_breakdown)
    breakdown["invalidated"] = {
        "stop_reason": str(episode.stop_reason),
        "valid": episode.valid,
        "reward": episode.reward,
    }
    cause = "bad sampler output: " + "; ".join(problems)
    return dataclasses.replace(
        episode,
        turns=tuple(turns),
        stop_reason=StopReason.BAD_SAMPLER_OUTPUT,
        valid=False,
        reward=None,
        reward_breakdown=breakdown,
        error=cause if episode.error is None else f"{cause} (earlier error: {episode.error})",
    )


def _sound(group: GroupRecord) -> bool:
    """True when every sampled token of ``group`` has a finite logprob and an integer
    version >= 0: one check over the group's concatenated arrays (the usual case), instead
    of per turn (measured ~0.15 s CPU per 2,000 trajectories × 20 turns)."""
    sampled = [t for e in group.episodes for t in e.turns if t.trainable]
    lps = [t.logprobs_T for t in sampled if t.logprobs_T is not None]
    if lps and not np.isfinite(np.concatenate(lps)).all():
        return False
    vs = [np.asarray(t.policy_versions_T) for t in sampled if t.policy_versions_T is not None]
    vs = [v for v in vs if len(v)]
    if not vs:
        return True
    if any(v.dtype.kind not in "iu" for v in vs):
        return False  # floats: the per-turn check decides
    return bool(np.concatenate(vs).min() >= 0)


def check_group(group: GroupRecord) -> GroupRecord:
    """``group`` with every episode passed through :func:`check_episode` (the same object
    when nothing changed); logs one warning per invalidated episode."""
    if _sound(group):
        return group
    episodes = tuple(check_episode(e) for e in group.episodes)
    if all(a is b for a, b in zip(episodes, group.episodes, strict=True)):
        return group
    for before, after in zip(group.episodes, episodes, strict=True):
        if before is not after:
            log.warning("%s/%s invalid: %s", group.group_id, after.episode_id, after.error)
    return dataclasses.replace(group, episodes=episodes)
