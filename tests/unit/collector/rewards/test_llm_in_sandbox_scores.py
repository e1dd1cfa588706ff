"""LLM-in-Sandbox-RL rewards against the peer's own scorer, answer for answer.

Each expected value is what the peer's ``benchmark/instruct_pretrain/reward.py`` (the reward
its rllm environment always calls; llm-in-sandbox commit 1c9f7a9) returned for the same
answer, ground truth and row fields, computed by running the peer's code. Ten of these cases
scored differently before this table existed (e.g. "The answer is 42" for a math truth of 42:
the peer gives 0; "Answer: d" for a biomed truth of D: the peer gives 1).
"""

from __future__ import annotations

import threading

import pytest

from sandpiper.collector.rewards.compute import compute_reward

# (agent's answer.txt, ground_truth, domain, qa_type, the peer's reward)
PEER_CASES = [
    ("42", "42", "math", None, 1.0),
    ("The answer is 42", "42", "math", None, 0.0),
    ("\\boxed{42}", "42", "math", None, 1.0),
    ("so x = \\boxed{\\frac{1}{2}}", "0.5", "math", None, 1.0),
    ("0.5", "\\frac{1}{2}", "physics", None, 1.0),
    ("x = 3", "3", "math_mini", None, 1.0),
    ("7", "42", "math", None, 0.0),
    ("", "42", "math", None, 0.0),
    ("B", "B", "biomed", None, 1.0),
    ("b", "B", "biomed", None, 1.0),
    ("The answer is B", "B", "biomed", None, 1.0),
    ("(B)", "B", "chem", None, 1.0),
    ("\\boxed{B}", "B", "chem", None, 1.0),
    ('{"answer": "c"}', "C", "biomed", None, 1.0),
    ("Answer: d", "D", "biomed", None, 1.0),
    ("I pick A, not B", "B", "biomed", None, 1.0),
    ("I pick A, not B", "A", "biomed", None, 0.0),
    ("the choice is c because", "C", "chem", None, 1.0),
    ("Option B is correct", "B", "biomed", None, 1.0),
    ("Based on the data I choose a", "A", "biomed", None, 1.0),
    ("bravo", "B", "biomed", None, 1.0),
    ("A", "A", "instruct_pretrain", "Multiple Choice", 1.0),
    ("The answer is A", "A", "long_context", "multiple choice (single)", 1.0),
    ("A, C", "A,C", "instruct_pretrain", "multiple choice", 1.0),
    ("A, B", "A,C", "instruct_pretrain", "multiple choice", 0.5),
    ("March", "The committee approved the budget in March.", "long_context", "free-form", 0.25),
    (
        "The committee approved it in March.",
        "The committee approved the budget in March.",
        "long_context",
        None,
        0.769231,
    ),
    ("42", "42", "instruct_pretrain", "free-form", 1.0),
    ("The total is 42", "42", "long_context", None, 0.4),
    (
        "In March the budget was approved by the committee",
        "The committee approved the budget in March.",
        "instruct_pretrain",
        "free-form",
        0.375,
    ),
]


@pytest.mark.parametrize(("answer", "truth", "domain", "qa_type", "peer"), PEER_CASES)
def test_reward_equals_the_peers(answer, truth, domain, qa_type, peer):
    reference = {"reward": "llm_in_sandbox", "answer": truth, "domain": domain}
    if qa_type:
        reference["qa_type"] = qa_type
    assert compute_reward(reference, answer=answer).reward == pytest.approx(peer)


def test_math_scoring_off_the_main_thread_gives_the_same_reward():
    """The collector scores in worker threads, where math-verify cannot use SIGALRM."""
    got = []
    reference = {"reward": "llm_in_sandbox", "answer": "0.5", "domain": "math"}
    answers = ["so x = \\boxed{\\frac{1}{2}}", "The answer is 0.5", "7"]
    worker = threading.Thread(
        target=lambda: got.extend(compute_reward(reference, answer=a).reward for a in answers)
    )
    worker.start()
    worker.join()
    assert got == [1.0, 0.0, 0.0]
