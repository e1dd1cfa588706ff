"""The sandbox contract: a small Protocol the agent loop and tools depend on.

``collector.sandbox.client`` implements it with podman containers and a persistent shell;
unit tests use a fake. Failures of the *command* are data (``ExecOutcome``); failures of the
*sandbox itself* that make further use impossible raise ``SandboxError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol, runtime_checkable


class ExecOutcome(StrEnum):
    OK = "ok"
    """The command finished (any exit code)."""
    TIMED_OUT = "timed_out"
    OOM_KILLED = "oom_killed"
    SANDBOX_DIED = "sandbox_died"
    """The shell went away and could not be restarted while the container still runs: the
    agent's own commands broke its sandbox (graded as the policy's outcome)."""
    SANDBOX_LOST = "sandbox_lost"
    """The container is gone or stopped (host removal, podman failure): an infra failure."""


@dataclass(frozen=True, slots=True)
class ExecResult:
    stdout: str
    """Head + tail of stdout when longer than the cap (a marker shows what was cut)."""
    stderr: str
    exit_code: int | None
    """None when the command did not finish (timed out, sandbox died)."""
    outcome: ExecOutcome
    duration_ms: float
    stdout_bytes_total: int
    stderr_bytes_total: int

    @property
    def ok(self) -> bool:
        return self.outcome is ExecOutcome.OK and self.exit_code == 0


@dataclass(frozen=True, slots=True)
class GradeRequest:
    """What ``submit`` asks the sandbox to grade (see ``collector.sandbox.supervisor.grader``)."""

    answer: bytes
    """The submitted answer; the grader writes it to ``$ANSWER_FILE``."""
    tests_dir: Path | None
    command: str
    """The task's test command (trusted task configuration), run as the grader's uid."""
    timeout_s: float
    secret: str
    """Per-episode tag for ``tagged_line`` results (``$SANDPIPER_RESULT_TAG``)."""
    keep_agent_processes: bool = False
    """Task option: the tests may talk to what the agent left running (a server)."""
    subject_command: str | None = None
    """Task option: run the agent's code as the agent before the tests, outputs to
    ``$SUBJECT_OUT`` (the tests then judge outputs, never importing the agent's code)."""
    tests_dest: str | None = None
    """Where the tests must also be found (open-instruct's ``/tests``): filled by the grader,
    root-owned, like ``/grade/tests``; None = only ``$TESTS_DIR``."""
    python_safe_path: bool = True
    """``PYTHONSAFEPATH=1`` for the tests (the current folder is not on ``sys.path``, so a
    ``json.py`` in the workspace cannot shadow the stdlib). False for task formats whose
    tests import the agent's modules from the workspace by design (open-instruct)."""
    result_path: str | None = None
    """Where the tests write their result when the task's format names a path of its own
    (open-instruct's ``/logs/verifier/reward.txt``): the grader empties its folder before the
    tests run and reads it after, like ``$SANDPIPER_RESULT_FILE``; None = that file."""


@dataclass(frozen=True, slots=True)
class GradeResult:
    """The test run (``exec``) and the raw result the tests left where only they write."""

    exec: ExecResult
    result_text: str | None = None
    """Contents of ``$SANDPIPER_RESULT_FILE`` (None when absent or refused)."""
    result_error: str | None = None
    refused: tuple[str, ...] = ()
    """Workspace entries that were not plain files or folders (removed before the tests)."""
    error: str | None = None
    """The grader could not run the tests (e.g. an agent process that would not die)."""
    phases_ms: dict[str, float] = field(default_factory=dict)
    """Time of each grading step inside the sandbox (stop_agent, prepare, tests, result)."""


@runtime_checkable
class Sandbox(Protocol):
    """One isolated machine for one episode. cwd and environment persist across ``exec``."""

    @property
    def id(self) -> str: ...

    async def exec(
        self,
        command: str,
        *,
        timeout_s: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult: ...

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None: ...

    async def read_file(self, path: str, *, limit: int | None = None) -> bytes: ...

    async def copy_in(self, host_dir: Path, container_dir: str) -> None: ...

    async def copy_out(self, container_dir: str, host_dir: Path) -> None: ...

    async def reset(self) -> None:
        """Wipe the workspace, kill stray processes, restart the shell."""
        ...

    async def close(self) -> None: ...


class ToolSandbox(Sandbox, Protocol):
    """What the tools need beyond :class:`Sandbox`: the editor's file operations, the
    grader, and stopping every agent process. ``PodmanSandbox`` and the test fake
    (:class:`sandpiper.testing.FakeSandbox`) provide it."""

    async def probe(self, path: str) -> tuple[str, int]: ...

    async def stat(self, path: str) -> tuple[bool, bool]: ...

    async def read_lines(
        self, path: str, first: int, last: int, *, limit: int
    ) -> tuple[bytes, int, bool]: ...

    async def list_tree(self, path: str, depth: int = 2) -> list[str]: ...

    async def grade(self, request: GradeRequest) -> GradeResult: ...

    async def kill_all(self) -> None: ...


class SandboxSource(Protocol):
    """Where episodes get their sandbox: the episode loop (``run_pooled_episode``) and the
    collector take one per episode and give it back. ``ImagePools`` implements it, and the
    test fake (:class:`sandpiper.testing.FakePool`)."""

    async def acquire(
        self, *, episode_id: str, task_id: str, image: str | None = None
    ) -> ToolSandbox: ...

    async def release(self, sandbox: ToolSandbox, *, broken: bool = False) -> None:
        """Give ``sandbox`` back; ``broken`` replaces it instead of reusing it."""
        ...
