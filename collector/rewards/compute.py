"""Episode rewards: task tests, math equivalence, ROUGE, exact / strict / choice match,
reasoning-gym's own scorers, your own function, banned patterns.

The reward kind and its data are the task's reference, a tagged union on ``reward``
(:mod:`sandpiper.collector.rewards.reference`: math, exact, rouge, llm_in_sandbox, tests,
none; plus ``banned_patterns`` / ``banned_penalty`` on any kind). :func:`compute_reward` also
takes the reference as the plain dict a task file or the store holds.

A peer's own scoring lives beside the others, named after the peer
(:mod:`sandpiper.collector.rewards.llm_in_sandbox_scores`); its rows are read by its task
format (:mod:`sandpiper.collector.tasks.formats`).

Only the *policy's* failures are scored (a wrong answer, no answer, failing tests: 0).
Infrastructure failures never reach this module: the agent loop marks those episodes
invalid with ``reward=None`` before scoring. The breakdown records every component so that
analysts can see why an episode got its reward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sandpiper.collector.rewards.answer_scores import (
    choice_match,
    exact_match,
    math_equal,
    rouge,
    strict_match,
)
from sandpiper.collector.rewards.reference import (
    REWARD_KINDS,
    LlmInSandboxReference,
    PythonReference,
    ReasoningGymReference,
    RougeReference,
    TaskReference,
    TestsReference,
    parse_reference,
)
from sandpiper.errors import TaskError

__all__ = ["REWARD_KINDS", "RewardOutcome", "banned_hits", "compute_reward"]


@dataclass(frozen=True, slots=True)
class RewardOutcome:
    reward: float
    breakdown: dict[str, Any] = field(default_factory=dict)
    """Components (kind, base score, test details, banned hits, penalty)."""


def compute_reward(
    reference: TaskReference | Mapping[str, Any],
    *,
    answer: str | None,
    test_reward: float | None = None,
    test_details: dict[str, Any] | None = None,
    model_text: str = "",
) -> RewardOutcome:
    """Score one finished episode.

    ``answer`` is what the agent submitted (or its final message); ``test_reward`` is what the
    task's test script reported at submit (None when it did not run); ``model_text`` is all
    text the policy wrote (for the banned-pattern check).
    """
    ref = parse_reference(reference, default_kind="tests" if test_reward is not None else "exact")
    kind = ref.reward
    breakdown: dict[str, Any] = {"kind": kind, "answered": answer is not None}
    gold = getattr(ref, "answer", None)
    if isinstance(ref, TestsReference):
        base = float(test_reward) if test_reward is not None else 0.0
        breakdown["test_details"] = test_details or {}
    elif isinstance(ref, PythonReference):  # the function decides, with or without an answer
        from sandpiper.collector.rewards import custom

        base, extras = custom.score(ref, answer)
        if extras:  # a verl dict's other keys (verl's reward_extra_info)
            breakdown["reward_extra_info"] = extras
    elif isinstance(ref, ReasoningGymReference):  # the library decides (None scores too)
        from sandpiper.collector.rewards import reasoning_gym_scores

        base = reasoning_gym_scores.score(ref, answer)
    elif kind == "none" or answer is None or gold is None:
        base = 0.0
    elif kind == "math":
        base = float(math_equal(gold, answer))
    elif kind == "exact":
        base = float(exact_match(gold, answer))
    elif kind == "strict":
        base = float(strict_match(gold, answer))
    elif kind == "choice":
        base = float(choice_match(gold, answer))
    elif isinstance(ref, LlmInSandboxReference):
        from sandpiper.collector.rewards.llm_in_sandbox_scores import score

        base = score(answer, gold, ref.domain, ref.qa_type)
    elif isinstance(ref, RougeReference):
        base = rouge(gold, answer, ref.rouge_type)
    else:  # pragma: no cover - every kind is handled above
        raise TaskError(f"no scorer for reward kind {kind!r}")
    breakdown[kind] = base
    hits = banned_hits(model_text, ref.banned_patterns)
    if hits:  # as TRL does: a banned pattern replaces the reward with the penalty
        penalty = ref.banned_penalty
        breakdown["banned_hits"] = hits
        breakdown["banned_penalty"] = penalty
        return RewardOutcome(reward=-penalty, breakdown=breakdown)
    return RewardOutcome(reward=base, breakdown=breakdown)


def banned_hits(text: str, patterns: Any) -> list[str]:
    """The patterns that occur in ``text``: plain substrings, case-insensitive (TRL's
    ``p.lower() in text.lower()``), never regexes."""
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise TaskError(f"banned_patterns must be a list of strings, got {patterns!r}")
    lowered = text.lower()
    return [p for p in patterns if p.lower() in lowered]
