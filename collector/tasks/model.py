"""The task as the collector runs it (:class:`Task`) and the primitives every task source
shares: the field names a row may use, prompt parsing, ids, splits and loud messages for a
missing field.

The bottom of the task modules: the peer formats (:mod:`sandpiper.collector.tasks.formats`),
the loader (:mod:`sandpiper.collector.tasks.loading`) and the importer
(:mod:`sandpiper.collector.tasks.importer`) build on it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sandpiper.collector.rewards.reference import BrokenReference, TaskReference, task_reference
from sandpiper.errors import TaskError
from sandpiper.store.records import Split, TaskRecord

PROMPT_KEYS = ("prompt", "question", "problem", "instruction", "messages")
ANSWER_KEYS = ("answer", "ground_truth", "solution", "reference_answer")
CONTEXT_KEYS = ("context", "documents", "input", "passage")
DEFAULT_TESTS_DEST = "/tmp/.sandpiper-tests"


@dataclass(frozen=True, slots=True)
class Task:
    """A task as the collector runs it (the store keeps its :class:`TaskRecord`)."""

    task_id: str
    instruction: str
    reference: TaskReference
    """Reward kind and data (:mod:`sandpiper.collector.rewards.reference`); a dict of a task file's
    keys is parsed into it on construction."""
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
    :mod:`sandpiper.collector.rewards.result_formats`. Nothing else the tests print is read."""
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

    def __post_init__(self) -> None:
        if isinstance(self.reference, Mapping):
            parsed = task_reference(self.reference, where=f"task {self.task_id}")
            object.__setattr__(self, "reference", parsed)

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
        if isinstance(self.reference, BrokenReference):
            raise TaskError(self.reference.error)
        if self.reference.reward != "tests" or self.test_command:
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
            reference=self.reference.as_dict(),
            data_uri=str(self.data_dir) if self.data_dir else None,
            split=self.split,
        )


def read_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, record) of each row of a JSONL file or a JSON array file; locations are
    ``path:line`` (JSONL) or ``path: record N`` (array), 1-based. JSONL is read line by line.
    The one reader of peers' row files: the collector's loader and ``sandpiper tasks import``."""
    with path.open(encoding="utf-8") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith("["):
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                raise TaskError(f"{path}: invalid JSON array ({e.msg}, line {e.lineno})") from None
            rows: Iterable[tuple[str, Any]] = (
                (f"{path}: record {n}", r) for n, r in enumerate(records, 1)
            )
        else:
            rows = _jsonl_rows(path, f)
        for where, record in rows:
            if not isinstance(record, dict):
                raise TaskError(f"{where}: expected a JSON object")
            yield where, record


def _jsonl_rows(path: Path, lines: Iterable[str]) -> Iterator[tuple[str, Any]]:
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(
                f"{path}:{lineno}: invalid JSON at column {e.colno} ({e.msg}); a JSONL file holds "
                "one JSON object a line"
            ) from None


def _existing(base: Path | None, name: str) -> Path | None:
    if base is None:
        return None
    path = base / name
    return path if path.exists() else None


# ---- rows --------------------------------------------------------------------------------


def check_unique(tasks: list[Task]) -> None:
    seen: set[str] = set()
    for task in tasks:
        if task.task_id in seen:
            raise TaskError(f"duplicate task id {task.task_id!r}")
        seen.add(task.task_id)


def row_prompt(row: dict[str, Any], where: str) -> tuple[str, str | None]:
    """(instruction, system prompt or None) of a row."""
    prompt = first_of(row, PROMPT_KEYS)
    system = row.get("system") if isinstance(row.get("system"), str) else None
    if isinstance(prompt, list):
        return _chat_prompt(prompt, where)
    if not isinstance(prompt, str) or not prompt.strip():
        raise TaskError(missing_field(where, "prompt", PROMPT_KEYS, row))
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


def with_row_split(task: Task, row: dict[str, Any], where: str) -> Task:
    if "split" not in row:
        return task
    try:
        return replace(task, split=Split(row["split"]), explicit_split=True)
    except ValueError:
        raise TaskError(f"{where}: split must be 'train' or 'validation'") from None


def first_of(row: dict[str, Any], keys: Iterable[str]) -> Any:
    return next((row[k] for k in keys if row.get(k) is not None), None)


def content_id(text: str) -> str:
    return "t-" + hashlib.sha256(text.encode()).hexdigest()[:12]


_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def safe_id(task_id: str, where: str) -> str:
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
