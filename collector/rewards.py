"""Episode rewards: task tests, math equivalence, ROUGE, exact match, banned patterns.

The reward kind and its data live in the task's ``reference`` dict (``TaskRecord.reference``)::

    {"reward": "math" | "exact" | "rouge" | "tests" | "llm_in_sandbox" | "none",
     "answer": "42",                       # math / exact / rouge / llm_in_sandbox
     "rouge_type": "rougeL",               # rouge (default rougeL F-measure)
     "domain": "math", "qa_type": "...",   # llm_in_sandbox: the peer's reward by domain
     "banned_patterns": ["sorted(", "/tests"],  # plain substrings (case-insensitive, as TRL)
     "banned_penalty": 1.0}                # a hit makes the reward -banned_penalty (TRL: -1)

Format-specific scoring lives with its format (:mod:`sandpiper.collector.task_formats`).

Only the *policy's* failures are scored (a wrong answer, no answer, failing tests: 0).
Infrastructure failures never reach this module: the agent loop marks those episodes
invalid with ``reward=None`` before scoring. The breakdown records every component so that
analysts can see why an episode got its reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sandpiper.collector.answer_scores import (  # noqa: F401 (exact_match, normalize_answer: API)
    exact_match,
    math_equal,
    normalize_answer,
    rouge,
)
from sandpiper.errors import TaskError

REWARD_KINDS = ("math", "exact", "rouge", "tests", "llm_in_sandbox", "none")


@dataclass(frozen=True, slots=True)
class RewardOutcome:
    reward: float
    breakdown: dict[str, Any] = field(default_factory=dict)
    """Components (kind, base score, test details, banned hits, penalty)."""


def compute_reward(
    reference: dict[str, Any],
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
    kind = reference.get("reward", "tests" if test_reward is not None else "exact")
    if kind not in REWARD_KINDS:
        raise TaskError(f"unknown reward kind {kind!r}; expected one of {REWARD_KINDS}")
    breakdown: dict[str, Any] = {"kind": kind, "answered": answer is not None}
    gold = reference.get("answer")
    if kind == "tests":
        base = float(test_reward) if test_reward is not None else 0.0
        breakdown["test_details"] = test_details or {}
    elif kind == "none" or answer is None or gold is None:
        base = 0.0
    elif kind == "math":
        base = float(math_equal(str(gold), answer))
    elif kind == "exact":
        base = float(exact_match(str(gold), answer))
    elif kind == "llm_in_sandbox":
        from sandpiper.collector.task_formats.llm_in_sandbox import score

        base = score(answer, str(gold), str(reference.get("domain", "")), reference.get("qa_type"))
    else:
        base = rouge(str(gold), answer, reference.get("rouge_type", "rougeL"))
    breakdown[kind] = base
    hits = banned_hits(model_text, reference.get("banned_patterns", ()))
    if hits:  # as TRL does: a banned pattern replaces the reward with the penalty
        penalty = float(reference.get("banned_penalty", 1.0))
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
