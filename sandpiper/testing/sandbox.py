"""An in-process fake sandbox for unit tests: a host temp folder stands for the container.

Absolute sandbox paths map to ``root/<path>`` (``/workspace/a.py`` → ``root/workspace/a.py``).
``exec`` runs local ``bash -c`` in the mapped working directory, with absolute paths in
``env`` values mapped the same way, or calls a scripted ``handler``. It implements the same
extended API as :class:`~sandpiper.collector.sandbox.client.PodmanSandbox` (``stat``, ``probe``,
``read_file(limit=)``, ``read_lines``, ``list_tree``, ``kill_all``, ``grade``,
``copy_in(replace=)``, ``exec(clean_env=)``). No isolation at all: tests only.

The one fake of the sandbox Protocols (``Sandbox`` and ``ToolSandbox``). For tests of the
rollout loop rather than of the tools, ``scripted=True`` answers every command with
``ran: <command>`` (and ``cat``/``head -c`` of a file with its content) instead of running
bash; ``files`` reads and writes the sandbox's files by sandbox path; ``copied`` records
``copy_in`` calls; ``die()`` makes every later call raise ``SandboxError``. The folder is
removed by ``close()``, or when the fake is garbage-collected.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path

from sandpiper.collector.sandbox.base import ExecOutcome, ExecResult, GradeRequest, GradeResult
from sandpiper.errors import SandboxError

Handler = Callable[[str, Mapping[str, str]], ExecResult]


class FakeSandbox:
    """A temp-folder sandbox (see the module docstring)."""

    def __init__(
        self,
        sandbox_id: str | None = None,
        *,
        handler: Handler | None = None,
        scripted: bool = False,
        output_cap_bytes: int = 16_384,
    ) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="sandpiper-fake-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, ignore_errors=True)
        (self.root / "workspace").mkdir()
        (self.root / "tmp").mkdir()
        self._id = sandbox_id or f"fake-{self.root.name}"
        self.handler = handler
        self.scripted = scripted
        self.output_cap_bytes = output_cap_bytes
        self.commands: list[str] = []
        self.copied: list[tuple[Path, str]] = []
        self.killed = 0
        self.dead = False
        self.closed = False
        self.files: MutableMapping[str, bytes] = _Files(self)

    @property
    def id(self) -> str:
        return self._id

    def die(self) -> None:
        """Every later call raises ``SandboxError`` (the container died)."""
        self.dead = True

    def _check(self) -> None:
        if self.dead:
            raise SandboxError(f"sandbox {self._id} died")

    def host_path(self, path: str) -> Path:
        if not path.startswith("/"):
            raise ValueError(f"sandbox paths must be absolute: {path!r}")
        return self.root / path.lstrip("/")

    async def exec(
        self,
        command: str,
        *,
        timeout_s: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        clean_env: bool = False,
    ) -> ExecResult:
        self._check()
        self.commands.append(command)
        env = dict(env or {})
        if self.handler is not None:
            return self.handler(command, env)
        if self.scripted:
            return self._scripted(command)
        if command == "pwd":  # no persistent shell here: its folder is always /workspace
            return ExecResult("/workspace\n", "", 0, ExecOutcome.OK, 0.0, 11, 0)
        mapped = {k: str(self.host_path(v)) if v.startswith("/") else v for k, v in env.items()}
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", command,
            cwd=self.host_path(cwd or "/workspace"),
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **mapped},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s or 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return ExecResult("", "", None, ExecOutcome.TIMED_OUT, _ms(started), 0, 0)
        cap = self.output_cap_bytes
        return ExecResult(
            stdout=out[:cap].decode("utf-8", "replace"),
            stderr=err[:cap].decode("utf-8", "replace"),
            exit_code=proc.returncode,
            outcome=ExecOutcome.OK,
            duration_ms=_ms(started),
            stdout_bytes_total=len(out),
            stderr_bytes_total=len(err),
        )

    def _scripted(self, command: str) -> ExecResult:
        if command.startswith(("cat -- ", "head -c ")):
            path = command.split(" -- ", 1)[1].strip("'")
            if path in self.files:
                out = self.files[path].decode()
                return ExecResult(out, "", 0, ExecOutcome.OK, 0.1, len(out), 0)
            return ExecResult("", "no such file", 1, ExecOutcome.OK, 0.1, 0, 12)
        out = f"ran: {command}\n"
        return ExecResult(out, "", 0, ExecOutcome.OK, 0.1, len(out), 0)

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        self._check()
        target = self.host_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        existed = target.exists()
        target.write_bytes(data)
        if not existed:
            target.chmod(mode)

    async def read_file(self, path: str, *, limit: int | None = None) -> bytes:
        self._check()
        fd = _open_regular(self.host_path(path))
        with os.fdopen(fd, "rb") as f:
            return f.read() if limit is None else f.read(limit)

    async def read_lines(
        self, path: str, first: int, last: int, *, limit: int
    ) -> tuple[bytes, int, bool]:
        os.close(_open_regular(self.host_path(path)))
        lines = self.host_path(path).read_bytes().split(b"\n")
        stop = len(lines) if last == -1 else last
        selected = [line + b"\n" for line in lines[first - 1 : stop]]
        if stop >= len(lines) and selected:
            selected[-1] = selected[-1][:-1]
        data = b"".join(selected)
        return data[:limit], len(lines), len(data) > limit

    async def probe(self, path: str) -> tuple[str, int]:
        try:
            st = self.host_path(path).stat()
        except OSError:
            return "missing", 0
        for kind, test in _KINDS:
            if test(st.st_mode):
                return kind, st.st_size
        return "other", st.st_size

    async def stat(self, path: str) -> tuple[bool, bool]:
        target = self.host_path(path)
        return target.exists(), target.is_dir()

    async def list_tree(self, path: str, depth: int = 2) -> list[str]:
        found = [path]

        def walk(sub: str, level: int) -> None:
            if level > depth:
                return
            for name in sorted(os.listdir(self.host_path(sub))):
                if name.startswith("."):
                    continue
                full = f"{sub.rstrip('/')}/{name}"
                found.append(full)
                if self.host_path(full).is_dir():
                    walk(full, level + 1)

        walk(path, 1)
        return found

    async def copy_in(self, host_dir: Path, container_dir: str, *, replace: bool = False) -> None:
        self._check()
        self.copied.append((host_dir, container_dir))
        target = self.host_path(container_dir)
        if replace and target.exists():
            shutil.rmtree(target)
        shutil.copytree(host_dir, target, dirs_exist_ok=True)

    async def copy_out(self, container_dir: str, host_dir: Path) -> None:
        self._check()
        shutil.copytree(self.host_path(container_dir), host_dir, dirs_exist_ok=True)

    async def grade(self, request: GradeRequest) -> GradeResult:
        """The tests in ``/grade`` as the podman grader lays it out (no uids: no isolation)."""
        grade = self.host_path("/grade")
        shutil.rmtree(grade, ignore_errors=True)
        for sub in ("tests", "home", "tmp", "out"):
            (grade / sub).mkdir(parents=True)
        if request.tests_dir is not None:
            shutil.copytree(request.tests_dir, grade / "tests", dirs_exist_ok=True)
        (grade / "answer").write_bytes(request.answer)
        self.killed += 1
        env = {
            "TESTS_DIR": "/grade/tests",
            "ANSWER_FILE": "/grade/answer",
            "WORKSPACE": "/workspace",
            "HOME": "/grade/home",
            "TMPDIR": "/grade/tmp",
            "SANDPIPER_RESULT_FILE": "/grade/out/result.json",
            "SANDPIPER_RESULT_TAG": request.secret,
        }
        if request.tests_dest is not None and request.tests_dir is not None:
            dest = self.host_path(request.tests_dest)
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(request.tests_dir, dest)
            env["TESTS_DIR"] = request.tests_dest
        if request.result_path is not None:
            folder = self.host_path(request.result_path).parent
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
        result = await self.exec(request.command, timeout_s=request.timeout_s, env=env)
        result_file = grade / "out" / "result.json"
        if request.result_path is not None:
            result_file = self.host_path(request.result_path)
        if result_file.is_file() and not result_file.is_symlink():
            return GradeResult(result, result_text=result_file.read_text())
        return GradeResult(result, result_error="the tests wrote no result file")

    async def kill_all(self) -> None:
        self.killed += 1

    async def reset(self) -> None:
        self._check()
        for sub in ("workspace", "tmp"):
            shutil.rmtree(self.root / sub)
            (self.root / sub).mkdir()

    async def close(self) -> None:
        self.closed = True
        self._cleanup()


class _Files(MutableMapping[str, bytes]):
    """The sandbox's regular files by absolute sandbox path (``/workspace/a.py``)."""

    def __init__(self, box: FakeSandbox) -> None:
        self._box = box

    def __getitem__(self, path: str) -> bytes:
        target = self._box.host_path(path)
        if not target.is_file():
            raise KeyError(path)
        return target.read_bytes()

    def __setitem__(self, path: str, data: bytes) -> None:
        target = self._box.host_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    def __delitem__(self, path: str) -> None:
        try:
            self._box.host_path(path).unlink()
        except FileNotFoundError:
            raise KeyError(path) from None

    def __iter__(self) -> Iterator[str]:
        for p in sorted(self._box.root.rglob("*")):
            if p.is_file():
                yield "/" + p.relative_to(self._box.root).as_posix()

    def __len__(self) -> int:
        return sum(1 for _ in self)


_KINDS = (
    ("file", stat.S_ISREG),
    ("dir", stat.S_ISDIR),
    ("fifo", stat.S_ISFIFO),
    ("character device", stat.S_ISCHR),
    ("block device", stat.S_ISBLK),
    ("socket", stat.S_ISSOCK),
)


def _open_regular(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"not a regular file: {path}")
    return fd


def _ms(started: float) -> float:
    return (time.monotonic() - started) * 1000
