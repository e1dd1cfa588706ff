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
``instruct_pretrain`` reward does
(:mod:`sandpiper.collector.rewards.llm_in_sandbox_scores`).
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath
from typing import Any

from sandpiper.collector.tasks.model import missing_field
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
    """An rllm record of this peer: a verl row whose ``extra_info`` holds the peer's row
    (other verl rows are prompt rows: ``loading.task_from_row``)."""
    extra = row.get("extra_info")
    return isinstance(extra, dict) and "problem_statement" in extra and "reward_model" in row


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
