"""LLM-in-Sandbox-RL data (``daixuancheng/llm-in-sandbox-rl``), as the peer writes it.

Two shapes are read:

- **rows** (the Hugging Face dataset, JSONL): ``id``, ``problem_statement``, ``ground_truth``,
  ``domain``, optional ``input_files`` (an object ``{file name: text}`` or that object as a
  JSON string), optional ``qa_type``;
- **the rllm JSON** written by the peer's ``convert_llm_sandbox_dataset.py``: a JSON *array*
  of ``{"prompt": [...], "reward_model": {"ground_truth", "style"}, "data_source",
  "extra_info": {id, domain, problem_statement, ground_truth, input_files?, qa_type?}}``.

The peer's sandbox works in ``/testbed``: input files in ``/testbed/documents/``, the answer
read from ``/testbed/answer.txt`` at the end of the episode. Here the working folder is
``/workspace`` (same layout below it). The reward is chosen by ``domain`` as the peer's
``instruct_pretrain`` reward does (:func:`score`).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import PurePosixPath
from typing import Any

from sandpiper.collector.answer_scores import rouge
from sandpiper.collector.task_model import missing_field
from sandpiper.errors import TaskError

WORKDIR = "/workspace"
INPUT_DIR = f"{WORKDIR}/documents"
ANSWER_FILE = f"{WORKDIR}/answer.txt"
ROW_FIELDS = ("id", "problem_statement", "ground_truth", "domain", "input_files", "qa_type")
SCORED_DOMAINS = ("math", "physics", "chem", "biomed", "instruct_pretrain", "long_context")
REFUSED_DOMAINS = {
    "instruct_follow": (
        "the peer scores instruction following with IFBench's checker imported from a git "
        "clone ($IFBENCH_PATH, instruct_follow/reward.py), and no maintained PyPI package "
        "reproduces it offline: if-verifiable 0.1.2 scores some instructions differently and, "
        "like nvidia-ifbench (which also pulls spaCy and LangChain), downloads NLTK data when "
        "imported. Remove these rows before importing (docs/tasks.md has a jq line for JSONL "
        "and for the rllm JSON), or grade them with your own IFBench checkout as a task "
        "folder's tests/run.sh"
    )
}

INSTRUCTION = """{problem}

Input files for this task (if any) are in {input_dir}/.
Write your final answer to {answer_file} (or pass it as `answer` to `submit`), then call `submit`.
"""


class UnsupportedDomainError(TaskError):
    """A well-formed row whose domain this project cannot score (``instruct_follow*``, or a
    domain the peer does not know either). ``sandpiper tasks import`` skips such rows and
    reports them, unless told to refuse the file (``--strict``)."""


def has_input_files(row: dict[str, Any]) -> bool:
    """Whether a row carries the peer's ``input_files`` (files for the sandbox), whatever
    its other fields are called: such a row is a task with files, never a bare prompt."""
    return row.get("input_files") not in (None, "", {})


def is_rllm_record(row: dict[str, Any]) -> bool:
    return isinstance(row.get("extra_info"), dict) and "reward_model" in row


def from_rllm(row: dict[str, Any]) -> dict[str, Any]:
    """The dataset row inside one rllm record (``extra_info`` + ``reward_model``)."""
    flat = dict(row["extra_info"])
    reward_model = row.get("reward_model") or {}
    if "ground_truth" not in flat and isinstance(reward_model, dict):
        flat["ground_truth"] = reward_model.get("ground_truth")
    return flat


def is_row(row: dict[str, Any]) -> bool:
    return "problem_statement" in row or is_rllm_record(row)


def task_fields(row: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate one row; returns instruction, reference and files (name -> text)."""
    if is_rllm_record(row):
        row = from_rllm(row)
    for name in ("problem_statement", "ground_truth", "domain"):
        if name not in row:
            raise TaskError(missing_field(where, f"field {name!r}", (name,), row))
    problem = row.get("problem_statement")
    if not isinstance(problem, str) or not problem.strip():
        raise TaskError(f"{where}: field 'problem_statement' is missing or empty")
    truth = row.get("ground_truth")
    if truth is None or str(truth).strip() == "":
        raise TaskError(f"{where}: field 'ground_truth' is missing or empty")
    domain = str(row.get("domain") or "").strip().lower()
    if not domain:
        raise TaskError(f"{where}: field 'domain' is missing (one of {', '.join(SCORED_DOMAINS)})")
    for refused, why in REFUSED_DOMAINS.items():
        if domain.startswith(refused):
            raise UnsupportedDomainError(f"{where}: domain {domain!r} is not supported: {why}")
    if not domain.startswith(SCORED_DOMAINS):
        raise UnsupportedDomainError(
            f"{where}: unknown domain {domain!r}; supported: {', '.join(SCORED_DOMAINS)}"
        )
    reference: dict[str, Any] = {
        "reward": "llm_in_sandbox",
        "answer": str(truth),
        "domain": domain,
        "answer_file": ANSWER_FILE,
    }
    if row.get("qa_type"):
        reference["qa_type"] = str(row["qa_type"])
    return {
        "id": row.get("id"),
        "instruction": INSTRUCTION.format(
            problem=problem.strip(), input_dir=INPUT_DIR, answer_file=ANSWER_FILE
        ),
        "reference": reference,
        "files": input_files(row.get("input_files"), where),
        "image": _image(row.get("docker_image"), where),
    }


def _image(value: Any, where: str) -> str | None:
    """``docker_image``, which the peer's ``LLMinSandboxEnv.from_dict`` takes from a record
    (default ``cdx123/llm-in-sandbox:v0.1``); here it must name a local podman image."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not value.strip():
        raise TaskError(f"{where}: field 'docker_image' must be an image name, got {value!r}")
    return value.strip()


def input_files(raw: Any, where: str) -> dict[str, str]:
    """``input_files`` as the peer accepts it: an object, or that object as a JSON string;
    entries whose content is null are skipped (as the peer does)."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise TaskError(
                f"{where}: field 'input_files' is a string but not JSON ({e})"
            ) from None
    if not isinstance(raw, dict):
        raise TaskError(f"{where}: field 'input_files' must map file names to their text")
    files = {}
    for name, text in raw.items():
        if text is None:
            continue
        files[safe_file_name(str(name), where)] = str(text)
    return files


def safe_file_name(name: str, where: str) -> str:
    """A relative file name inside the input folder (sub-folders allowed, no ``..``)."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or "\0" in name or name.endswith("/"):
        raise TaskError(
            f"{where}: input file name {name!r} must be a relative file name inside "
            f"{INPUT_DIR} (no leading '/', no '..')"
        )
    return str(path)


# ---- reward, as the peer's instruct_pretrain reward routes it ------------------------------
# The peer's rllm environment always scores with ``benchmark/instruct_pretrain/reward.py``,
# which routes by domain to its ``math``, ``chem`` and ``biomed`` scorers. Each function below
# reproduces one of them, decision for decision (tests/unit/test_llm_in_sandbox_reward.py
# holds the peer's cases).


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
