"""Loading tasks: JSONL prompts, task folders (Sandpiper and open-instruct); splits.

Sources the collector accepts (``collector.tasks`` in the config):

- **JSONL** — one task per line. Prompt tasks: ``prompt`` (or ``question`` / ``problem`` /
  ``instruction`` / ``messages``; text or a list of chat messages) and ``answer`` (or
  ``ground_truth`` / ``solution``), optional ``id``, ``reward`` (``math`` default, ``exact``,
  ``rouge``), ``banned_patterns``, ``split``. A line with ``data_dir`` points at a task folder
  (relative to the file; ``instruction``, ``system`` and ``image`` in that line replace the
  folder's own). An open-instruct dataset row (``env_config``) names an open-instruct folder
  next to the file. Peers' rows that need files in the sandbox (LLM-in-Sandbox-RL, TRL +
  Daytona, Aviato) are converted first by ``sandpiper tasks import``
  (:mod:`sandpiper.collector.tasks.importer`).
- **Task folder** (one per task)::

      <task_id>/instruction.md   what the agent is asked
      <task_id>/files/           seed files, copied into /workspace before the episode
      <task_id>/tests/run.sh     test script; it reports in the declared result format
                                 (rewards/result_formats.py); tests/ reaches the sandbox only
                                 at submit, and runs as a uid the agent never has
      <task_id>/setup.sh         optional, run in /workspace before the episode
      <task_id>/task.toml        optional: image, reward, answer, banned_patterns,
                                 test_command, result_format, subject_command,
                                 tests_see_agent_processes, split

  or an open-instruct folder (``environment/seeds/``, ``tests/test.sh`` writing
  ``/logs/verifier/reward.txt``, ``image.txt``:
  :mod:`sandpiper.collector.tasks.formats.open_instruct`).
- **A folder of task folders**, or a folder with a ``tasks.jsonl`` index.

A task that cannot run as declared (``Task.check``) is not refused here: each of its episodes
is invalid with ``task_error`` (a task's failure is data). Splits are deterministic: a task
whose id hashes below ``validation_fraction`` is a validation task, unless it states its split.
"""

from __future__ import annotations

import contextlib
import tomllib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from sandpiper.collector.rewards.reference import PYTHON_PREFIX, REFERENCE_KEYS, task_reference
from sandpiper.collector.tasks.formats import aviato, llm_in_sandbox, open_instruct, trl_daytona
from sandpiper.collector.tasks.model import (
    ANSWER_KEYS,
    Task,
    assign_split,
    check_unique,
    content_id,
    first_of,
    missing_field,
    read_records,
    row_prompt,
    safe_id,
    with_row_split,
)
from sandpiper.errors import TaskError


def load_tasks(
    source: str | Path,
    *,
    validation_fraction: float = 0.0,
    split_seed: int = 0,
    reward_function: str | None = None,
) -> list[Task]:
    """Load every task of ``source`` (JSONL file, task folder or folder of task folders).
    ``reward_function`` (``python:MODULE:FUNCTION``, the run's ``collector.reward_function``)
    replaces every task's own ``reward``."""
    if reward_function is not None:
        with _REWARD_OVERRIDE.set_to(reward_function):
            return load_tasks(source, validation_fraction=validation_fraction,
                              split_seed=split_seed)  # fmt: skip
    path = Path(source)
    if not path.exists():
        raise TaskError(f"task source not found: {path}")
    if path.is_file():
        tasks = list(_load_jsonl(path))
    elif (path / "instruction.md").is_file():
        tasks = [load_task_folder(path)]
    elif (path / "tasks.jsonl").is_file():
        tasks = list(_load_jsonl(path / "tasks.jsonl"))
    else:
        dirs = sorted(p for p in path.iterdir() if (p / "instruction.md").is_file())
        tasks = [load_task_folder(p) for p in dirs]
    if not tasks:
        raise TaskError(
            f"no tasks found in {path}: give a JSONL file of task rows, a task folder "
            "(instruction.md) or a folder of task folders"
        )
    check_unique(tasks)
    return [assign_split(t, validation_fraction, split_seed) for t in tasks]


class _Override:
    """The run's reward function while its tasks load (one loader call at a time)."""

    value: str | None = None

    @contextlib.contextmanager
    def set_to(self, value: str) -> Iterator[None]:
        previous, self.value = self.value, value
        try:
            yield
        finally:
            self.value = previous


_REWARD_OVERRIDE = _Override()


def _load_jsonl(path: Path) -> Iterator[Task]:
    for where, row in read_records(path):
        if "data_dir" in row:
            task = _with_overrides(load_task_folder(path.parent / row["data_dir"]), row, where)
            yield with_row_split(task, row, where)
        elif open_instruct.is_row(row):
            task = open_instruct.row_task(row, where, path.parent)
            yield with_row_split(task, row, where)
        elif needs_import(row):
            raise TaskError(
                f"{where}: a {needs_import(row)} row needs files in the sandbox; convert the "
                f"file first: sandpiper tasks import {path} --out DIR"
            )
        else:
            yield task_from_row(row, source=path.name, where=where)


TASK_TOML_KEYS = {
    "id": "Task id (default: the folder's name); letters, digits, `.`, `_`, `-`.",
    "image": "Sandbox image of this task (default: the run's `sandbox.image`).",
    "test_command": "Command run at submit, in the workspace, as the tests' uid (default: "
    '`bash "$TESTS_DIR/run.sh"` when `tests/` exists).',
    "result_format": "How the tests report their reward: `result_file` (default: JSON "
    '`{"reward": x}` or `{"passed": n, "total": m}` in `$SANDPIPER_RESULT_FILE`), '
    "`tagged_line`, `reward_file`, `exit_status` (rewards/result_formats.py).",
    "subject_command": "Runs the agent's code as the agent before the tests; what it writes "
    "to `$SUBJECT_OUT` is frozen read-only for the tests (docs/security.md).",
    "tests_see_agent_processes": "`true`: what the agent left running stays alive for the "
    "tests, which then run on a plain copy of the workspace (default `false`: every agent "
    "process is killed first).",
    "split": "`train` or `validation`; states the split (the hash split leaves it alone).",
    "format": "A label shown by `tasks list` (default `folder`).",
}
"""Keys of a ``task.toml`` read here, besides the reward reference's (``REFERENCE_KEYS``);
docs/tasks.md is generated from both (:mod:`sandpiper.collector.tasks.doc`)."""

OVERRIDE_KEYS = ("instruction", "system", "image")
"""Fields of an index row with ``data_dir`` that replace the folder's own (an open-instruct
dataset row's prompt and per-sample image, kept by ``sandpiper tasks import``)."""


def _with_overrides(task: Task, row: dict[str, Any], where: str) -> Task:
    changes = {}
    for key, name in zip(OVERRIDE_KEYS, ("instruction", "system_prompt", "image"), strict=True):
        if key in row:
            if not isinstance(row[key], str) or not row[key].strip():
                raise TaskError(f"{where}: field {key!r} must be non-empty text")
            changes[name] = row[key]
    return replace(task, **changes) if changes else task


def needs_import(row: dict[str, Any]) -> str | None:
    """The peer format of a row that must be converted to a task folder first, if any."""
    if aviato.is_row(row):
        return "Aviato code"
    if llm_in_sandbox.is_row(row):
        return "LLM-in-Sandbox"
    if trl_daytona.is_row(row):
        return "TRL + Daytona"
    if llm_in_sandbox.has_input_files(row):  # its files would be dropped, silently
        return "document (input_files)"
    return None


def is_verl_row(row: dict[str, Any]) -> bool:
    """verl's standard row: ``prompt``, ``data_source``, ``reward_model.ground_truth``,
    ``extra_info``."""
    model = row.get("reward_model")
    return "data_source" in row and isinstance(model, dict) and "ground_truth" in model


def task_from_row(row: dict[str, Any], *, source: str, where: str = "") -> Task:
    """A prompt-only task (math / QA) from one JSONL row. The prompt is a string, or a list
    of chat messages (OpenAI / Aviato style: system and user messages). A verl row's answer
    is its ``reward_model.ground_truth``. With ``reward = "python:MODULE:FUNCTION"`` (or the
    run's ``reward_function``) the reference keeps the row's prompt and other fields for the
    function (:mod:`sandpiper.collector.rewards.custom`)."""
    instruction, system = row_prompt(row, where)
    if _REWARD_OVERRIDE.value is not None:
        row = {**row, "reward": _REWARD_OVERRIDE.value}
    answer = first_of(row, ANSWER_KEYS)
    if answer is None and is_verl_row(row):
        answer = row["reward_model"]["ground_truth"]
    fields = {
        k: row[k] for k in REFERENCE_KEYS if k in row and k not in ("answer", "row", "prompt")
    }
    fields.setdefault("reward", "math")
    if str(fields["reward"]).startswith(PYTHON_PREFIX):
        fields.pop("answer", None)
        fields["prompt"] = (
            row["prompt"] if isinstance(row.get("prompt"), str | list) else instruction
        )
        fields["row"] = {k: v for k, v in row.items() if k != "prompt"}
    elif answer is not None:
        fields["answer"] = str(answer)
    elif fields["reward"] not in ("tests", "none", "reasoning_gym"):
        raise TaskError(missing_field(where, "reference answer", ANSWER_KEYS, row))
    reference = task_reference(fields, where=where)
    task_id = str(row.get("id") or row.get("task_id") or content_id(instruction))
    task = Task(
        task_id=safe_id(task_id, where),
        instruction=instruction,
        reference=reference,
        source=source,
        format=f"jsonl_{reference.reward}",
        system_prompt=system,
    )
    return with_row_split(task, row, where)


def load_task_folder(folder: str | Path) -> Task:
    """One task folder (see the module docstring for the layout)."""
    folder = Path(folder).resolve()
    instruction_file = folder / "instruction.md"
    if not instruction_file.is_file():
        raise TaskError(f"{folder}: no instruction.md")
    if open_instruct.is_folder(folder):
        return open_instruct.folder_task(folder)
    meta: dict[str, Any] = {}
    if (folder / "task.toml").is_file():
        try:
            meta = tomllib.loads((folder / "task.toml").read_text())
        except tomllib.TOMLDecodeError as e:
            raise TaskError(f"{folder}/task.toml: {e}") from None
    has_tests = (folder / "tests").is_dir()
    if _REWARD_OVERRIDE.value is not None:
        meta = {**meta, "reward": _REWARD_OVERRIDE.value}
    keys = {k: meta[k] for k in REFERENCE_KEYS if k in meta and k not in ("row", "prompt")}
    if str(meta.get("reward", "")).startswith(PYTHON_PREFIX):  # the function's row: task.toml
        keys["prompt"] = instruction_file.read_text()
        keys["row"] = {k: v for k, v in meta.items() if k != "prompt"}
    reference = task_reference(
        keys,
        default_kind="tests" if has_tests else "exact",
        where=f"{folder}/task.toml",
    )
    if reference.reward == "tests" and not has_tests:
        raise TaskError(f"{folder}: reward 'tests' needs a tests/ folder")
    task = Task(
        task_id=safe_id(str(meta.get("id", folder.name)), str(folder)),
        instruction=instruction_file.read_text(),
        reference=reference,
        source=folder.parent.name,
        format=str(meta.get("format", "folder")),
        data_dir=folder,
        image=meta.get("image"),
        test_command=meta.get("test_command"),
        result_format=_result_format(meta, str(folder)),
        tests_see_agent_processes=bool(meta.get("tests_see_agent_processes", False)),
        subject_command=meta.get("subject_command"),
    )
    return with_row_split(task, meta, str(folder))


def _result_format(meta: dict[str, Any], where: str) -> str:
    from sandpiper.collector.rewards.result_formats import DEFAULT_RESULT_FORMAT, RESULT_FORMATS

    value = meta.get("result_format", DEFAULT_RESULT_FORMAT)
    if value not in RESULT_FORMATS:
        raise TaskError(f"{where}: result_format {value!r} must be one of {RESULT_FORMATS}")
    return str(value)
