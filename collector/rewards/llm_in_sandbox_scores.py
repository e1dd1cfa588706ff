"""The LLM-in-Sandbox-RL peer's rewards by domain, routed as its ``instruct_pretrain`` reward.

The peer's rllm environment always scores with ``benchmark/instruct_pretrain/reward.py``,
which routes by domain to its ``math``, ``chem`` and ``biomed`` scorers. Each function below
reproduces one of them, decision for decision (tests/unit/collector/rewards/test_llm_in_sandbox_scores.py
holds the peer's cases). :func:`sandpiper.collector.rewards.compute.compute_reward` calls
:func:`score` for a task whose reference is ``llm_in_sandbox``; the rows themselves are read by
:mod:`sandpiper.collector.tasks.formats.llm_in_sandbox`.
"""

from __future__ import annotations

import re
import threading

from sandpiper.collector.rewards.answer_scores import rouge


def score(answer: str | None, truth: str, domain: str, qa_type: str | None) -> float:
    """The peer's reward for one answer (``compute_score`` of ``instruct_pretrain``)."""
    if not answer or not truth:
        return 0.0
    answer, truth, domain = answer.strip(), truth.strip(), domain.lower()
    if domain.startswith(("math", "physics")):
        return math_score(answer, truth)
    if domain.startswith(("chem", "biomed")):  # the two scorers are the same code
        return letter_score(answer, truth)
    kind = question_type(qa_type, truth)
    if kind == "multiple_choice_single_answer":
        return letter_score(answer, truth)
    if kind == "multiple_choice_multiple_answers":
        return _choices_f1(answer, truth)
    if math_score(answer, truth) > 0:  # open-ended: math first, then ROUGE-L F-measure
        return 1.0
    return rouge(truth, answer, "rougeL")


def math_score(answer: str, truth: str) -> float:
    """The peer's math scorer: the last ``\\boxed{}`` of the answer (else the whole answer)
    and the truth, each wrapped in ``\\boxed{}``, compared by math-verify with LaTeX extraction
    for the truth and expression-then-LaTeX extraction for the answer. A bare sentence such as
    "The answer is 42" therefore scores 0, as it does for the peer."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # math-verify's timeouts use SIGALRM, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse("\\boxed{" + truth + "}", (LatexExtractionConfig(),), parsing_timeout=timeout)
        if not gold:  # the peer's metric raises here and its scorer returns 0
            return 0.0
        pred = parse(
            "\\boxed{" + last_boxed(answer) + "}",
            (ExprExtractionConfig(), LatexExtractionConfig()),
            parsing_timeout=timeout,
        )
        return float(bool(verify(gold, pred, 6, timeout_seconds=timeout)))
    except Exception:  # the peer scores any failure of math-verify as 0
        return 0.0


def last_boxed(text: str) -> str:
    """The content of the last ``\\boxed{...}`` (nested braces allowed), stripped; the
    stripped text itself when there is none or its braces never close."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return text.strip()
    depth, i = 1, start + len("\\boxed{")
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[start + len("\\boxed{") : i - 1].strip() if depth == 0 else text.strip()


def letter_score(answer: str, truth: str) -> float:
    """The peer's multiple-choice scorer (biomed and chem): the whole answer equal to the
    truth (any case), else the option letter :func:`choice_letter` finds equal to it."""
    if answer.strip().upper() == truth.strip().upper():
        return 1.0
    return float(choice_letter(answer) == truth.strip().upper())


_JSON_ANSWER = re.compile(r'"answer"\s*:\s*"([A-Z])"', re.IGNORECASE)
_ANSWER_COLON = re.compile(r"answer\s*[:：]\s*([A-Z])\b", re.IGNORECASE)
_ANSWER_IS = re.compile(r"(?:answer|choice)\s+is\s+([A-Z])\b", re.IGNORECASE)
_LONE_LETTER = re.compile(r"\b([A-Z])\b")


def choice_letter(text: str) -> str:
    """The option letter an answer names, tried in the peer's order: ``"answer": "C"``,
    ``Answer: C``, ``the answer is C`` / ``the choice is C`` (any case), the first letter of
    the last ``\\boxed{}``, the last standalone letter, the answer's first letter; "" if none."""
    if not text:
        return ""
    for pattern in (_JSON_ANSWER, _ANSWER_COLON, _ANSWER_IS):
        found = pattern.search(text)
        if found:
            return found.group(1).upper()
    boxed = last_boxed(text)
    if boxed != text.strip() and boxed and boxed[0].upper().isalpha():
        return boxed[0].upper()
    letters = _LONE_LETTER.findall(text.upper())
    if letters:
        return letters[-1]
    stripped = text.strip()
    return stripped[0].upper() if stripped and stripped[0].upper().isalpha() else ""


def question_type(qa_type: str | None, truth: str) -> str:
    if not qa_type:
        return "open_ended"
    if "multiple choice" in qa_type.lower():
        return (
            "multiple_choice_multiple_answers" if "," in truth else "multiple_choice_single_answer"
        )
    return "open_ended"


def _choices_f1(answer: str, truth: str) -> float:
    """Several correct options: F1 of the comma-separated answer against the truth."""
    chosen = {c.strip().upper() for c in answer.split(",") if c.strip()}
    gold = {c.strip().upper() for c in truth.split(",") if c.strip()}
    if not chosen or not gold:
        return 0.0
    correct = len(chosen & gold)
    if correct == 0:
        return 0.0
    precision, recall = correct / len(chosen), correct / len(gold)
    return 2 * precision * recall / (precision + recall)
