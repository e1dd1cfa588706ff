"""Rewards: math equivalence, exact match, ROUGE, tests, banned patterns, breakdown."""

from __future__ import annotations

import pytest

from sandpiper.collector.rewards.answer_scores import exact_match, math_equal, rouge
from sandpiper.collector.rewards.compute import compute_reward
from sandpiper.errors import TaskError


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


def test_banned_patterns_are_literal_substrings_with_trls_penalty():
    ref = {"reward": "exact", "answer": "yes", "banned_patterns": ["sorted(", "Cat /tests"]}
    clean = compute_reward(ref, answer="yes", model_text="ls; sorted  (x)")
    cheat = compute_reward(ref, answer="yes", model_text="return SORTED(xs)")
    assert clean.reward == 1.0 and "banned_hits" not in clean.breakdown
    # TRL: p.lower() in text.lower(), and a hit scores -1 whatever the answer
    assert cheat.reward == -1.0 and cheat.breakdown["banned_hits"] == ["sorted("]
    assert cheat.breakdown["banned_penalty"] == 1.0
    # "(" is not a regex error: a literal
    assert compute_reward(ref, answer="no", model_text="cat /TESTS/x").reward == -1.0


def test_unknown_reward_kind_and_bad_patterns_are_task_errors():
    with pytest.raises(TaskError, match="unknown reward kind"):
        compute_reward({"reward": "vibes"}, answer="x")
    with pytest.raises(TaskError, match="banned_patterns"):
        compute_reward({"reward": "exact", "answer": "x", "banned_patterns": "rm"}, answer="x")


@pytest.mark.parametrize(
    ("domain", "qa_type", "truth", "answer", "expected"),
    [
        ("math", None, "\\frac{1}{2}", "0.5", 1.0),
        ("physics", None, "42", "41", 0.0),
        ("biomed", None, "B", "The answer is B", 1.0),
        ("chem", None, "C", "After checking, the answer is (B).", 0.0),
        ("instruct_pretrain", "Multiple choice", "D", "\\boxed{D}", 1.0),
        ("instruct_pretrain", "multiple choice", "A, C", "A,B,C", 0.8),
        ("long_context", "free-form", "12", "12", 1.0),
        ("long_context", None, "a", "", 0.0),
    ],
)
def test_llm_in_sandbox_reward_by_domain(domain, qa_type, truth, answer, expected):
    ref = {"reward": "llm_in_sandbox", "answer": truth, "domain": domain}
    if qa_type:
        ref["qa_type"] = qa_type
    assert compute_reward(ref, answer=answer).reward == pytest.approx(expected)


def test_llm_in_sandbox_long_context_is_rouge_l_not_math():
    """A wrong long-context answer gets the peer's ROUGE-L F-measure, not 1.0."""
    from rouge_score import rouge_scorer

    truth = "The committee approved the budget in March after two rounds of review."
    answer = "The budget was approved by the committee in May."
    ref = {"reward": "llm_in_sandbox", "answer": truth, "domain": "long_context"}
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    expected = scorer.score(truth, answer)["rougeL"].fmeasure
    got = compute_reward(ref, answer=answer).reward
    assert 0.0 < got < 1.0 and got == pytest.approx(expected)


def test_strict_strips_only_surrounding_whitespace():
    ref = {"reward": "strict", "answer": "-09"}
    assert compute_reward(ref, answer=" -09\n").reward == 1.0
    for wrong in ("-9", "09", "- 09", "-09."):
        assert compute_reward(ref, answer=wrong).reward == 0.0, wrong


def test_choice_is_one_letter_after_brackets_dots_and_spaces():
    ref = {"reward": "choice", "answer": "B"}
    for right in ("B", "b", "(B)", "B.", " (b). ", "\n(B)\n"):
        assert compute_reward(ref, answer=right).reward == 1.0, right
    for wrong in ("A", "B) 4", "Answer: B", "BB", "", "Ｂ"):
        assert compute_reward(ref, answer=wrong).reward == 0.0, wrong


def test_exact_does_what_docs_tasks_says():
    from sandpiper.collector.rewards.answer_scores import normalize_answer

    assert normalize_answer("The  Answer, is: -09!") == "answer is 09"
    assert normalize_answer("[1, 2, 3]") == normalize_answer("1 2 3")
    assert normalize_answer("An apple") == "apple"
