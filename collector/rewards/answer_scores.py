"""How close a submitted answer is to the gold one: exact match (SQuAD-normalised), math
equivalence (math-verify) and ROUGE (rouge-score). The leaf under :mod:`sandpiper.collector.rewards.compute`
and the peer formats' own scorers (:mod:`sandpiper.collector.tasks.formats`), which both use them.
"""

from __future__ import annotations

import re
import threading


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation, in this order: lower-case; every character that is neither a
    word character (letters, digits, ``_``, in any script) nor whitespace becomes a space
    (so ``-09`` is ``09`` and ``1,2`` is ``1 2``); the whole words ``a``, ``an``, ``the``
    become spaces; runs of whitespace become one space, ends stripped."""
    text = text.lower()
    text = re.sub(r"[^\w\s]", " ", text)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(gold: str, answer: str) -> bool:
    return normalize_answer(gold) == normalize_answer(answer)


def strict_match(gold: str, answer: str) -> bool:
    """Equal after stripping surrounding whitespace (``str.strip()``); nothing else changes."""
    return gold.strip() == answer.strip()


CHOICE_STRIP = "(). \t\r\n\f\v"
"""Characters stripped from both ends of a ``choice`` answer (``str.strip`` of these)."""


def choice_letter(text: str) -> str | None:
    """The single letter A-Z of a multiple-choice answer, upper-cased: the text with
    :data:`CHOICE_STRIP` stripped from both ends must be exactly one ASCII letter (``b``,
    ``(B)``, ``B.``, `` (b). ``); anything else (``B) 4``, ``Answer: B``, ``AB``) is None."""
    core = text.strip(CHOICE_STRIP)
    if len(core) == 1 and "A" <= core.upper() <= "Z" and core.isascii():
        return core.upper()
    return None


def choice_match(gold: str, answer: str) -> bool:
    letter = choice_letter(answer)
    return letter is not None and letter == choice_letter(gold)


def math_equal(gold: str, answer: str) -> bool:
    """Mathematical equivalence with math-verify (LaTeX, boxed answers, numbers, sets)."""
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(_as_math(gold), parsing_timeout=timeout)
    answer_parsed = parse(answer, parsing_timeout=timeout)
    if not gold_parsed or not answer_parsed:
        return exact_match(gold, answer)
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=timeout))


def _as_math(gold: str) -> str:
    # A bare gold answer ("1/2") parses more reliably as inline math.
    return gold if "$" in gold or "\\" in gold else f"${gold}$"


def rouge(gold: str, answer: str, rouge_type: str = "rougeL") -> float:
    """ROUGE F-measure of ``answer`` against ``gold`` (rouge-score, Porter stemming)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer([rouge_type], use_stemmer=True)
    return float(scorer.score(gold, answer)[rouge_type].fmeasure)
