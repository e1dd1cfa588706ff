"""Task sources: JSONL prompts, task folders (Sandpiper and open-instruct); splits.

Sources the collector accepts (``collector.tasks`` in the config):

- **JSONL** — one task per line. Prompt tasks: ``prompt`` (or ``question`` / ``problem`` /
  ``instruction`` / ``messages``; text or a list of chat messages) and ``answer`` (or
  ``ground_truth`` / ``solution``), optional ``id``, ``reward`` (``math`` default, ``exact``,
  ``rouge``), ``banned_patterns``, ``split``. A line with ``data_dir`` points at a task folder
  (relative to the file; ``instruction``, ``system`` and ``image`` in that line replace the
  folder's own). An open-instruct dataset row (``env_config``) names an open-instruct folder
  next to the file. Peers' rows that need files in the sandbox (LLM-in-Sandbox-RL, TRL +
  Daytona, Aviato) are converted first by ``sandpiper tasks import``
  (:mod:`collector.task_import`).
- **Task folder** (one per task)::

      <task_id>/instruction.md   what the agent is asked
      <task_id>/files/           seed files, copied into /workspace before the episode
      <task_id>/tests/run.sh     test script; it reports in the declared result format
                                 (collector.tools.reward); tests/ reaches the sandbox only at
                                 submit, and runs as a uid the agent never has
      <task_id>/setup.sh         optional, run in /workspace before the episode
      <task_id>/task.toml        optional: image, reward, answer, banned_patterns,
                                 test_command, result_format, subject_command,
                                 tests_see_agent_processes, split

  or an open-instruct folder (``environment/seeds/``, ``tests/test.sh`` writing
  ``/logs/verifier/reward.txt``, ``image.txt``: :mod:`collector.task_formats.open_instruct`).
- **A folder of task folders**, or a folder with a ``tasks.jsonl`` index.

A task that cannot run as declared (``Task.check``) is not refused here: each of its episodes
is invalid with ``task_error`` (a task's failure is data). Splits are deterministic: a task
whose id hashes below ``validation_fraction`` is a validation task, unless it states its split.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sandpiper.errors import TaskError
from store.records import Split, TaskRecord

_PROMPT_KEYS = ("prompt", "question", "problem", "instruction", "messages")
_ANSWER_KEYS = ("answer", "ground_truth", "solution", "reference_answer")
_CONTEXT_KEYS = ("context", "documents", "input", "passage")
DEFAULT_TESTS_DEST = "/tmp/.sandpiper-tests"
_REFERENCE_KEYS = (
    "reward",
    "banned_patterns",
    "banned_penalty",
    "rouge_type",
    "answer_file",
    "domain",
    "qa_type",
    "result_format",
    # an external agent run per episode through the gateway (docs/gateway.md)
    "agent_command",
    "agent_timeout_s",
    "agent_env",
)


@dataclass(frozen=True, slots=True)
class Task:
    """A task as the collector runs it (the store keeps its :class:`TaskRecord`)."""

    task_id: str
    instruction: str
    reference: dict[str, Any]
    """Reward kind and data (see :mod:`collector.rewards`)."""
    source: str
    format: str
    split: Split = Split.TRAIN
    data_dir: Path | None = None
    """Task folder; None for prompt-only tasks."""
    image: str | None = None
    """Per-task sandbox image; None = the pool's default image."""
    test_command: str | None = None
    """Command that runs the tests; None = the toolbox's default for ``tests/``."""
    result_format: str = "result_file"
    """How the tests report (``result_file``, ``tagged_line``, ``exit_status``); see
    :mod:`collector.tools.reward`. Nothing else the tests print is read."""
    tests_see_agent_processes: bool = False
    """Keep what the agent left running (a server) alive for the tests; off by default."""
    subject_command: str | None = None
    """Runs the agent's code as the agent before the tests; its outputs go to
    ``$SUBJECT_OUT`` for the tests to judge (docs/security.md: tests and the agent's code)."""
    explicit_split: bool = field(default=False, compare=False)
    """True when the task file stated its split (the hash split then leaves it alone)."""
    files_subdir: str = "files"
    """Seed files inside the task folder (open-instruct: ``environment/seeds``)."""
    files_dest: str = "/workspace"
    """Where the seed files are copied in the sandbox before the episode."""
    test_script: str = "run.sh"
    """Entry point inside ``tests/`` when no ``test_command`` is given (open-instruct:
    ``test.sh``)."""
    tests_dest: str = DEFAULT_TESTS_DEST
    """Where ``tests/`` is copied at submit (``$TESTS_DIR``; open-instruct: ``/tests``)."""
    reward_file: str | None = None
    """File the test script writes its reward to (open-instruct:
    ``/logs/verifier/reward.txt``); None = the reward is parsed from the test output."""
    system_prompt: str | None = None
    """System message of the task's own prompt (chat-message rows); None = the run's."""

    @property
    def files_dir(self) -> Path | None:
        return _existing(self.data_dir, self.files_subdir)

    @property
    def resolved_test_command(self) -> str | None:
        """The command run at submit; None when the task has no tests."""
        if self.test_command:
            return self.test_command
        if self.tests_dir is None:
            return None
        return f'bash "$TESTS_DIR/{self.test_script}"'

    def check(self) -> None:
        """Raise ``TaskError`` when the task cannot be run as declared (checked at the start
        of every episode: a broken task is an invalid episode, not a 0)."""
        if self.reference.get("reward") != "tests" or self.test_command:
            return
        if self.tests_dir is None or not (self.tests_dir / self.test_script).is_file():
            raise TaskError(
                f"task {self.task_id}: its test script tests/{self.test_script} is missing"
            )

    @property
    def tests_dir(self) -> Path | None:
        return _existing(self.data_dir, "tests")

    @property
    def setup_script(self) -> Path | None:
        return _existing(self.data_dir, "setup.sh")

    def to_record(self) -> TaskRecord:
        return TaskRecord(
            task_id=self.task_id,
            source=self.source,
            format=self.format,
            instruction=self.instruction,
            reference=self.reference,
            data_uri=str(self.data_dir) if self.data_dir else None,
            split=self.split,
        )


def _existing(base: Path | None, name: str) -> Path | None:
    if base is None:
        return None
    path = base / name
    return path if path.exists() else None


# ---- loading ------------------------------------------------------------------------------


def load_tasks(
    source: str | Path, *, validation_fraction: float = 0.0, split_seed: int = 0
) -> list[Task]:
    """Load every task of ``source`` (JSONL file, task folder or folder of task folders)."""
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
        raise TaskError(f"no tasks found in {path}")
    _check_unique(tasks)
    return [assign_split(t, validation_fraction, split_seed) for t in tasks]


def _check_unique(tasks: list[Task]) -> None:
    seen: set[str] = set()
    for task in tasks:
        if task.task_id in seen:
            raise TaskError(f"duplicate task id {task.task_id!r}")
        seen.add(task.task_id)


def _load_jsonl(path: Path) -> Iterator[Task]:
    from collector.task_formats import open_instruct

    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise TaskError(f"{path}:{lineno}: expected a JSON object")
            where = f"{path}:{lineno}"
            if "data_dir" in row:
                task = _with_overrides(load_task_folder(path.parent / row["data_dir"]), row, where)
                yield _with_row_split(task, row, where)
            elif open_instruct.is_row(row):
                task = open_instruct.row_task(row, where, path.parent)
                yield _with_row_split(task, row, where)
            elif needs_import(row):
                raise TaskError(
                    f"{where}: a {needs_import(row)} row needs files in the sandbox; convert the "
                    f"file first: sandpiper tasks import {path} --out DIR"
                )
            else:
                yield task_from_row(row, source=path.name, where=where)


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
    from collector.task_formats import aviato, llm_in_sandbox, trl_daytona

    if aviato.is_row(row):
        return "Aviato code"
    if llm_in_sandbox.is_row(row):
        return "LLM-in-Sandbox"
    if trl_daytona.is_row(row):
        return "TRL + Daytona"
    return None


def task_from_row(row: dict[str, Any], *, source: str, where: str = "") -> Task:
    """A prompt-only task (math / QA) from one JSONL row. The prompt is a string, or a list
    of chat messages (OpenAI / Aviato style: system and user messages)."""
    instruction, system = _prompt(row, where)
    answer = _first(row, _ANSWER_KEYS)
    reference = {k: row[k] for k in _REFERENCE_KEYS if k in row}
    reference.setdefault("reward", "math")
    if answer is not None:
        reference["answer"] = str(answer)
    elif reference["reward"] not in ("tests", "none"):
        raise TaskError(missing_field(where, "reference answer", _ANSWER_KEYS, row))
    task_id = str(row.get("id") or row.get("task_id") or _content_id(instruction))
    task = Task(
        task_id=_safe_id(task_id, where),
        instruction=instruction,
        reference=reference,
        source=source,
        format=f"jsonl_{reference['reward']}",
        system_prompt=system,
    )
    return _with_row_split(task, row, where)


def _prompt(row: dict[str, Any], where: str) -> tuple[str, str | None]:
    """(instruction, system prompt or None) of a row."""
    prompt = _first(row, _PROMPT_KEYS)
    system = row.get("system") if isinstance(row.get("system"), str) else None
    if isinstance(prompt, list):
        return _chat_prompt(prompt, where)
    if not isinstance(prompt, str) or not prompt.strip():
        raise TaskError(missing_field(where, "prompt", _PROMPT_KEYS, row))
    return prompt, system


def _chat_prompt(messages: list[Any], where: str) -> tuple[str, str | None]:
    system, user = [], []
    for i, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            raise TaskError(f"{where}: prompt message {i} must be an object with text 'content'")
        content = _message_text(message.get("content"), f"{where}: prompt message {i}")
        role = message.get("role")
        if role in ("system", "developer"):  # OpenAI's newer name for the system role
            system.append(content)
        elif role == "user":
            user.append(content)
        else:
            raise TaskError(
                f"{where}: prompt message {i} has role {role!r}; a task prompt may hold only "
                "'system' and 'user' messages (the agent writes the assistant turns)"
            )
    if not "".join(user).strip():
        raise TaskError(f"{where}: the prompt messages hold no user message")
    return "\n\n".join(user), ("\n\n".join(system) if system else None)


def _message_text(content: Any, where: str) -> str:
    """A message's text: a string, or OpenAI's list of content parts (``{"type": "text",
    "text": ...}``, joined); other parts (images, audio) cannot reach a text agent."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content, 1):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise TaskError(f"{where}: content part {j} is {kind!r}; only text parts are read")
            if not isinstance(part.get("text"), str):
                raise TaskError(f"{where}: content part {j} has no 'text'")
            texts.append(part["text"])
        return "\n".join(texts)
    raise TaskError(f"{where} must be an object with text 'content'")


def missing_field(where: str, what: str, supported: Iterable[str], row: dict[str, Any]) -> str:
    """'no prompt (one of …)' plus the row's field nearest to a supported name, if any."""
    supported = tuple(supported)
    message = f"{where}: no {what} (one of {', '.join(supported)})"
    for key in row:
        close = difflib.get_close_matches(str(key), supported, n=1, cutoff=0.6)
        if close:
            return f"{message}; the row has {key!r}: did you mean {close[0]!r}?"
    return f"{message}; the row has {', '.join(map(repr, row)) or 'no fields'}"


def _with_row_split(task: Task, row: dict[str, Any], where: str) -> Task:
    if "split" not in row:
        return task
    try:
        return replace(task, split=Split(row["split"]), explicit_split=True)
    except ValueError:
        raise TaskError(f"{where}: split must be 'train' or 'validation'") from None


def load_task_folder(folder: str | Path) -> Task:
    """One task folder (see the module docstring for the layout)."""
    from collector.task_formats import open_instruct

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
    reference = {k: meta[k] for k in (*_REFERENCE_KEYS, "answer") if k in meta}
    reference.setdefault("reward", "tests" if has_tests else "exact")
    if reference["reward"] == "tests" and not has_tests:
        raise TaskError(f"{folder}: reward 'tests' needs a tests/ folder")
    task = Task(
        task_id=_safe_id(str(meta.get("id", folder.name)), str(folder)),
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
    return _with_row_split(task, meta, str(folder))


def _result_format(meta: dict[str, Any], where: str) -> str:
    from collector.tools.reward import DEFAULT_RESULT_FORMAT, RESULT_FORMATS

    value = meta.get("result_format", DEFAULT_RESULT_FORMAT)
    if value not in RESULT_FORMATS:
        raise TaskError(f"{where}: result_format {value!r} must be one of {RESULT_FORMATS}")
    return str(value)


def _first(row: dict[str, Any], keys: Iterable[str]) -> Any:
    return next((row[k] for k in keys if row.get(k) is not None), None)


def _content_id(text: str) -> str:
    return "t-" + hashlib.sha256(text.encode()).hexdigest()[:12]


_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _safe_id(task_id: str, where: str) -> str:
    # Ids become part of group ids (``run/task/seq``) and folder names: no slashes.
    if not _ID_RE.match(task_id):
        raise TaskError(f"{where}: task id {task_id!r} must match {_ID_RE.pattern}")
    return task_id


# ---- splits -------------------------------------------------------------------------------


def split_of(task_id: str, validation_fraction: float, seed: int = 0) -> Split:
    """Deterministic split: the same id, fraction and seed always give the same split."""
    digest = hashlib.sha256(f"{seed}:{task_id}".encode()).digest()
    position = int.from_bytes(digest[:8], "big") / 2**64
    return Split.VALIDATION if position < validation_fraction else Split.TRAIN


def assign_split(task: Task, validation_fraction: float, seed: int = 0) -> Task:
    if task.explicit_split or validation_fraction <= 0:
        return task
    return replace(task, split=split_of(task.task_id, validation_fraction, seed))


# ---- conversion and import (collector.task_import) ---------------------------------------


def import_tasks(source: str | Path, out_dir: str | Path, **kwargs: Any) -> list[Task]:
    """See :func:`collector.task_import.import_tasks`."""
    from collector.task_import import import_tasks as run

    return run(source, out_dir, **kwargs)


def convert_llm_in_sandbox(rows: Iterable[dict[str, Any]], out_dir: str | Path) -> list[Task]:
    """See :func:`collector.task_import.convert_llm_in_sandbox`."""
    from collector.task_import import convert_llm_in_sandbox as run

    return run(rows, out_dir)
