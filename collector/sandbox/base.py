"""The sandbox contract: a small Protocol the agent loop and tools depend on.

``collector.sandbox.podman`` implements it with podman containers and a persistent shell;
unit tests use a fake. Failures of the *command* are data (``ExecOutcome``); failures of the
*sandbox itself* that make further use impossible raise ``SandboxError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Protocol, runtime_checkable


class ExecOutcome(StrEnum):
    OK = "ok"
    """The command finished (any exit code)."""
    TIMED_OUT = "timed_out"
    OOM_KILLED = "oom_killed"
    SANDBOX_DIED = "sandbox_died"
    """The container or its shell went away; the episode is an infra failure."""


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

    async def read_file(self, path: str) -> bytes: ...

    async def copy_in(self, host_dir: Path, container_dir: str) -> None: ...

    async def copy_out(self, container_dir: str, host_dir: Path) -> None: ...

    async def reset(self) -> None:
        """Wipe the workspace, kill stray processes, restart the shell."""
        ...

    async def close(self) -> None: ...
