"""Rewards: math equivalence, exact match, ROUGE, tests, banned patterns, breakdown."""

from __future__ import annotations

import pytest

from collector.rewards import compute_reward, exact_match, math_equal, rouge


@pytest.mark.parametrize(
    ("gold", "answer", "equal"),
    [
        ("1/2", "0.5", True),
        ("\\frac{1}{2}", "The answer is $\\boxed{\\frac{2}{4}}$", True),
        ("42", "42", True),
        ("42", "43", False),
        ("2^{10}", "$1024$", True),
    ],
)
def test_math_equal(gold, answer, equal):
    assert math_equal(gold, answer) is equal


def test_exact_match_normalises_case_articles_and_punctuation():
    assert exact_match("The Eiffel Tower", "eiffel tower.")
    assert not exact_match("Paris", "London")


def test_rouge_is_graded():
    assert rouge("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    partial = rouge("the cat sat on the mat", "a cat sat")
    assert 0.0 < partial < 1.0
    assert rouge("the cat sat", "quantum chromodynamics") == 0.0


def test_compute_reward_math_and_breakdown():
    out = compute_reward({"reward": "math", "answer": "4"}, answer="2+2 = 4")
    assert out.reward == 1.0
    assert out.breakdown == {"kind": "math", "answered": True, "math": 1.0}
    assert compute_reward({"reward": "math", "answer": "4"}, answer=None).reward == 0.0


def test_compute_reward_tests_uses_test_reward_and_keeps_details():
    details = {"passed": 3, "total": 4}
    out = compute_reward({"reward": "tests"}, answer=None, test_reward=0.75, test_details=details)
    assert (
        out.reward == 0.75
        and out.breakdown["test_details"] == details
        and out.breakdown["tests"] == 0.75
    )
    # not submitted: the tests never ran, which is the policy's failure
    assert compute_reward({"reward": "tests"}, answer=None).reward == 0.0


def test_banned_pattern_penalty_is_applied_and_recorded():
    ref = {"reward": "exact", "answer": "yes", "banned_patterns": [r"cat\s+/tests"]}
    clean = compute_reward(ref, answer="yes", model_text="ls")
    cheat = compute_reward(ref, answer="yes", model_text="cat  /tests/test.sh")
    assert clean.reward == 1.0 and "banned_hits" not in clean.breakdown
    assert cheat.reward == 0.0 and cheat.breakdown["banned_hits"] == [r"cat\s+/tests"]
    assert cheat.breakdown["banned_penalty"] == 1.0


def test_unknown_reward_kind_is_refused():
    with pytest.raises(ValueError, match="unknown reward kind"):
        compute_reward({"reward": "vibes"}, answer="x")
