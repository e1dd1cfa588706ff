"""The sandbox client: :class:`PodmanSandbox`, the host's side of one sandbox container
(the :class:`~sandpiper.collector.sandbox.base.Sandbox` Protocol), talking to the
supervisor that runs inside it.

Driven through the podman CLI from asyncio. Each container runs catatonit (bind-mounted from
the host, ``-P``) as pid 1, so init survives ``kill -9 -1``; a persistent shell — the
stdlib-only ``supervisor/`` folder, bind-mounted read-only and started once with
``podman exec -i`` and reached over a Unix socket in a host folder bind-mounted into the
container (:func:`.host_state.socket_dir`; the exec's pipes only announce it) — runs every command
framed (JSON header + raw payload; the reply header is the end marker with the exit status).
See ``supervisor/__init__.py`` for the state semantics.

Watchdog ladder when a command overruns:
1. inside: the shell SIGKILLs the command's process group at the deadline;
2. host: no reply ``WATCHDOG_GRACE_S`` after the deadline → kill the shell client and start a
   new shell with ``--takeover`` (SIGKILLs everything but init; the workspace survives);
3. host: the shell cannot be restarted → the container is replaced. The outcome is
   ``sandbox_lost`` (infra, the episode is invalid) when the container itself is gone or
   stopped and was not OOM-killed — the agent, an unprivileged uid, cannot stop init or
   remove its container, so the host did; otherwise ``sandbox_died`` (the agent's commands
   broke its sandbox, e.g. exhausted its pids: graded as the policy's outcome).

The container's isolation flags are built by :func:`.isolation.container_argv`; the podman
CLI calls by :mod:`.containers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import tarfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sandpiper.collector.sandbox import host_state
from sandpiper.collector.sandbox.base import ExecOutcome, ExecResult, GradeRequest, GradeResult
from sandpiper.collector.sandbox.containers import (
    START_TIMEOUT_S,
    podman_cwd,
    remove_containers_by_name,
    run_podman,
)
from sandpiper.collector.sandbox.host_state import SOCKET_DIR, SOCKET_NAME
from sandpiper.collector.sandbox.isolation import SUPERVISOR_MAIN, container_argv
from sandpiper.config import SandboxConfig
from sandpiper.errors import SandboxError, SandboxLostError

log = logging.getLogger(__name__)

WATCHDOG_GRACE_S = 5.0
"""Host-side slack after a command's deadline before the shell is presumed hung."""
MAX_FRAME_BYTES = 512 * 1024 * 1024
"""Largest reply payload accepted from a shell (a file read or a tar of a folder)."""


class PodmanSandbox:
    """One container plus its persistent shell. Create with :meth:`create`."""

    def __init__(self, config: SandboxConfig, name: str, labels: dict[str, str]) -> None:
        self.config = config
        self.name = name
        self.labels = labels
        self._shell: asyncio.subprocess.Process | None = None
        """The ``podman exec`` running the shell; its pipes only announce it."""
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        """The shell's socket: every request and reply."""
        self._lock = asyncio.Lock()
        self._dead = False
        self._desynced = False
        """True while a request's reply has not been read completely."""
        self.restarts = 0
        self.lost = False
        """Set when the sandbox is dead because its container is gone or stopped (not by
        the agent's doing): its failures are then ``sandbox_lost``, not ``sandbox_died``."""
        self.uid_slot: int | None = None
        """The pool's uid range this container runs in (set by the pool that made it)."""

    # -- lifecycle ---------------------------------------------------------------------------
    @classmethod
    async def create(
        cls, config: SandboxConfig, *, labels: Mapping[str, str], uid_base: int | None
    ) -> PodmanSandbox:
        name = f"sandpiper-{uuid.uuid4().hex[:12]}"
        all_labels = {**labels, "sandpiper.managed": "1"}
        if uid_base is not None:
            all_labels["sandpiper.uid_base"] = str(uid_base)
        box = cls(config, name, all_labels)
        try:
            host_state.make_socket_dir(name, uid_base, config.host_state_dir)
            host_state.make_cgroup_parent(name, uid_base, config.host_state_dir)
            argv = container_argv(config, name=name, labels=all_labels, uid_base=uid_base)
            run = asyncio.ensure_future(run_podman(*argv))
            try:
                await asyncio.shield(run)
            except asyncio.CancelledError:
                # let `podman run` finish: a client killed between runc's create and start
                # left a `runc init` (and its conmon) that no removal reaches
                with contextlib.suppress(Exception):
                    await run
                raise
            await box._start_shell(takeover=False)
        except BaseException:
            await box.close()
            raise
        return box

    @property
    def id(self) -> str:
        return self.name

    @property
    def alive(self) -> bool:
        return not self._dead

    async def close(self) -> None:
        """Stop the shell and remove the container (idempotent)."""
        self._dead = True
        await self._kill_shell()
        try:
            await remove_containers_by_name([self.name], state_dir=self.config.host_state_dir)
        except SandboxError as e:  # `sandpiper sandbox gc` will find it (collector label)
            log.warning("could not remove %s: %s", self.name, e)

    async def _start_shell(self, *, takeover: bool) -> None:
        argv = ["podman", "exec", "-i", self.name, "python3", "-I", SUPERVISOR_MAIN]
        argv += ["--listen", f"{SOCKET_DIR}/{SOCKET_NAME}"]
        if takeover:
            argv.append("--takeover")
        self._shell = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            limit=1 << 20,
            cwd=podman_cwd(),  # conmon's OOM marker lands there, not in the user's folder
        )
        try:
            assert self._shell.stdout is not None
            line = await asyncio.wait_for(self._shell.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            line = b""
        if not line.startswith(b'{"ready"'):
            await self._kill_shell()
            raise SandboxError(f"the shell of sandbox {self.name} did not start")
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_unix_connection(
                    str(host_state.socket_dir(self.name, self.config.host_state_dir) / SOCKET_NAME),
                    limit=1 << 20,
                ),
                START_TIMEOUT_S,
            )
        except (OSError, TimeoutError) as e:
            await self._kill_shell()
            raise SandboxError(f"could not reach the shell of sandbox {self.name}: {e}") from e

    async def _kill_shell(self) -> None:
        # every step that frees something first, then the waits: a close cancelled at a
        # wait (the pool closing) must not leave a connection or a client process behind
        writer, self._reader, self._writer = self._writer, None, None
        shell, self._shell = self._shell, None
        if writer is not None:
            writer.close()  # the shell reads end-of-file and exits
        if shell is not None:
            if shell.stdin is not None:
                shell.stdin.close()  # else the transport outlives the event loop
            if shell.returncode is None:
                shell.kill()
        if writer is not None:
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if shell is not None:
            await shell.wait()

    # -- framing -----------------------------------------------------------------------------
    async def _call(
        self, req: dict[str, Any], payload: bytes = b"", *, timeout_s: float = 60.0
    ) -> tuple[dict[str, Any], bytes]:
        """Send one framed request; raise ``TimeoutError`` or ``ConnectionError``.

        A call interrupted half-way (cancelled, or a reply cut short) leaves a reply in the
        pipe that would be read as the answer to the next request, so the next call first
        restarts the shell.
        """
        if self._desynced and not await self._recover():
            raise ConnectionError("the sandbox shell could not be restarted")
        shell, reader, writer = self._shell, self._reader, self._writer
        if shell is None or shell.returncode is not None or self._dead:
            raise ConnectionError("the sandbox shell is not running")
        if reader is None or writer is None:
            raise ConnectionError("the sandbox shell is not connected")
        req["len"] = len(payload)
        self._desynced = True  # until the whole reply has been read
        try:
            writer.write(json.dumps(req).encode() + b"\n")
            if payload:
                writer.write(payload)
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), timeout_s)
            if not line:
                raise ConnectionError("the sandbox shell exited")
            header = json.loads(line)
            size = int(header.get("len", 0))
            if size > MAX_FRAME_BYTES:
                raise ConnectionError(f"reply of {size} bytes exceeds the frame limit")
            data = await asyncio.wait_for(reader.readexactly(size), timeout_s)
        except (BrokenPipeError, ConnectionResetError, asyncio.IncompleteReadError) as e:
            raise ConnectionError(f"the sandbox shell went away: {e}") from e
        except (ValueError, asyncio.LimitOverrunError) as e:
            raise ConnectionError(f"garbled reply from the sandbox shell: {e}") from e
        self._desynced = False
        return header, data

    async def _op(self, req: dict[str, Any], payload: bytes = b"") -> tuple[dict, bytes]:
        """A non-exec operation: errors inside become ``OSError``; a dead shell → SandboxError."""
        async with self._lock:
            try:
                header, data = await self._call(req, payload)
            except (TimeoutError, ConnectionError) as e:
                if not await self._recover():
                    raise self._dead_error(e) from e
                try:
                    header, data = await self._call(req, payload)
                except (TimeoutError, ConnectionError) as e2:
                    # the same request broke a fresh shell too (a reply over the line
                    # limit, a path the shell cannot answer): a failed call, not a dead box
                    raise OSError(f"the sandbox could not answer this request: {e2}") from e2
        if "error" in header:
            raise _as_os_error(header["error"], header.get("message", ""), req.get("path"))
        return header, data

    async def _recover(self) -> bool:
        """Watchdog levels 2 and 3: restart the shell; else mark the sandbox dead."""
        await self._kill_shell()
        if self._dead:
            return False
        try:
            await self._start_shell(takeover=True)
            self.restarts += 1
            self._desynced = False
            return True
        except SandboxError:
            self._dead = True
            self.lost = await self._container_lost()
            log.warning("sandbox %s: shell restart failed (%s); it will be replaced",
                        self.name, "container lost" if self.lost else "container running")  # fmt: skip
            return False

    async def _container_lost(self) -> bool:
        """True when the container is gone, or stopped without an OOM kill (the host's
        doing: the agent cannot stop init); False while it runs or after an OOM kill."""
        try:
            out = await run_podman(
                "container", "inspect", "--format", "{{.State.Running}} {{.State.OOMKilled}}",
                self.name, timeout_s=30,
            )  # fmt: skip
        except SandboxError:
            return True  # gone, or podman itself failed: not the agent's doing
        running, _, oom_killed = out.decode().strip().partition(" ")
        return running != "true" and oom_killed != "true"

    def _dead_error(self, cause: BaseException) -> SandboxError:
        kind = SandboxLostError if self.lost else SandboxError
        return kind(f"sandbox {self.name}: {cause}")

    def _dead_outcome(self) -> ExecOutcome:
        return ExecOutcome.SANDBOX_LOST if self.lost else ExecOutcome.SANDBOX_DIED

    # -- Sandbox Protocol ----------------------------------------------------------------------
    async def exec(
        self,
        command: str,
        *,
        timeout_s: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        clean_env: bool = False,
    ) -> ExecResult:
        """Run ``command`` in the persistent shell (see ``supervisor/__init__.py`` for state rules).

        ``env`` adds variables for this call only. ``clean_env`` runs with the image's base
        environment instead of the shell's, and leaves the shell's state untouched.
        """
        timeout_s = self.config.exec_timeout_s if timeout_s is None else timeout_s
        req = {
            "op": "exec",
            "command": command,
            "timeout_s": timeout_s,
            "cap": self.config.output_cap_bytes,
            "cwd": cwd,
            "env": dict(env or {}),
            "clean_env": clean_env,
        }
        started = time.monotonic()
        async with self._lock:
            try:
                header, data = await self._call(req, timeout_s=timeout_s + WATCHDOG_GRACE_S)
            except TimeoutError:
                recovered = await self._recover()
                outcome = ExecOutcome.TIMED_OUT if recovered else self._dead_outcome()
                return _failed(outcome, started, "the shell did not answer; it was restarted")
            except ConnectionError as e:
                # The command may have killed the shell (kill -9 -1): init survived, so a new
                # shell is started and the command is reported as killed, with a fresh state.
                if await self._recover():
                    note = f"[sandpiper: the shell was killed ({e}); restarted with a fresh state]"
                    return _failed(ExecOutcome.OK, started, note, exit_code=137)
                return _failed(self._dead_outcome(), started, str(e))
        if "error" in header:
            return _failed(ExecOutcome.OK, started, header.get("message", ""), exit_code=126)
        return _exec_result(header, data)

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write ``data`` byte-exact; parents are created; ``mode`` applies to new files."""
        _check_abs(path)
        await self._op({"op": "write", "path": path, "mode": mode}, data)

    async def read_file(self, path: str, *, limit: int | None = None) -> bytes:
        """The bytes of a regular file, at most ``limit`` of them (read bounded in the
        container); FIFOs and devices raise ``OSError`` without blocking."""
        _check_abs(path)
        req: dict[str, Any] = {"op": "read", "path": path}
        if limit is not None:
            req["limit"] = limit
        return (await self._op(req))[1]

    async def read_lines(
        self, path: str, first: int, last: int, *, limit: int
    ) -> tuple[bytes, int, bool]:
        """(lines ``first``..``last`` joined as ``split("\\n")`` would, at most ``limit``
        bytes; the file's line count; whether the selection was cut). Streamed in the
        container: only the selection crosses to the host."""
        _check_abs(path)
        req = {"op": "lines", "path": path, "first": first, "last": last, "limit": limit}
        header, data = await self._op(req)
        return data, int(header["n_lines"]), bool(header["truncated"])

    async def probe(self, path: str) -> tuple[str, int]:
        """(kind, size) of ``path``: kind is ``missing``, ``file``, ``dir``, ``fifo``,
        ``character device``, ``block device``, ``socket`` or ``other``."""
        _check_abs(path)
        header, _ = await self._op({"op": "stat", "path": path})
        return str(header.get("kind", "missing")), int(header.get("size", 0))

    async def stat(self, path: str) -> tuple[bool, bool]:
        """(exists, is_dir) of ``path`` inside the sandbox."""
        _check_abs(path)
        header, _ = await self._op({"op": "stat", "path": path})
        return bool(header["exists"]), bool(header["is_dir"])

    async def list_tree(self, path: str, depth: int = 2) -> list[str]:
        """``path`` and the entries up to ``depth`` levels below it, hidden ones skipped."""
        _check_abs(path)
        header, _ = await self._op({"op": "tree", "path": path, "depth": depth})
        return list(header["paths"])

    async def copy_in(self, host_dir: Path, container_dir: str, *, replace: bool = False) -> None:
        """Copy a host folder's files into ``container_dir`` (regular files and folders)."""
        _check_abs(container_dir)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(str(host_dir), arcname=".")
        req = {"op": "untar", "dest": container_dir, "replace": replace}
        await self._op(req, buf.getvalue())

    async def copy_out(self, container_dir: str, host_dir: Path) -> None:
        _check_abs(container_dir)
        _, data = await self._op({"op": "tar", "src": container_dir})
        host_dir.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(host_dir, filter="data")

    async def grade(self, request: GradeRequest) -> GradeResult:
        """Run the task's tests out of the agent's reach (see ``supervisor/grader.py``)."""
        buf = io.BytesIO()
        if request.tests_dir is not None:
            with tarfile.open(fileobj=buf, mode="w") as tar:
                tar.add(str(request.tests_dir), arcname=".")
        req = {
            "op": "grade",
            "answer_len": len(request.answer),
            "command": request.command,
            "timeout_s": request.timeout_s,
            "cap": self.config.output_cap_bytes,
            "secret": request.secret,
            "keep_agent_processes": request.keep_agent_processes,
            "subject_command": request.subject_command,
            "tests_dest": request.tests_dest,
            "result_path": request.result_path,
            "python_safe_path": request.python_safe_path,
        }
        started = time.monotonic()
        async with self._lock:
            try:
                header, data = await self._call(
                    req, request.answer + buf.getvalue(),
                    timeout_s=request.timeout_s + WATCHDOG_GRACE_S + 30,
                )  # fmt: skip
            except TimeoutError:
                recovered = await self._recover()
                outcome = ExecOutcome.TIMED_OUT if recovered else self._dead_outcome()
                return GradeResult(_failed(outcome, started, "the grader did not answer"))
            except ConnectionError as e:
                await self._recover()
                return GradeResult(_failed(self._dead_outcome(), started, str(e)))
        if "error" in header:
            message = f"{header['error']}: {header.get('message', '')}"
            return GradeResult(_failed(ExecOutcome.OK, started, message), error=message)
        return GradeResult(
            _exec_result(header, data),
            result_text=header.get("result"),
            result_error=header.get("result_error"),
            refused=tuple(header.get("refused", ())),
            phases_ms=dict(header.get("phases_ms", {})),
        )

    async def reset(self) -> None:
        """Kill every process but init; wipe /workspace, /tmp, /dev/shm, /dev/mqueue, /grade
        and SysV IPC objects; restore the mount points' modes; reset the shell state."""
        await self._op({"op": "reset"})

    async def kill_all(self) -> None:
        """SIGKILL every process in the container except init and the shell."""
        await self._op({"op": "kill_all"})

    async def ping(self) -> dict[str, Any]:
        return (await self._op({"op": "ping"}))[0]


def _check_abs(path: str) -> None:
    if not path.startswith("/") or "\0" in path:
        raise ValueError(f"sandbox paths must be absolute: {path!r}")


def _as_os_error(kind: str, message: str, path: str | None) -> OSError:
    by_name = {
        "FileNotFoundError": FileNotFoundError,
        "IsADirectoryError": IsADirectoryError,
        "NotADirectoryError": NotADirectoryError,
        "PermissionError": PermissionError,
        "FileExistsError": FileExistsError,
    }
    return by_name.get(kind, OSError)(f"{kind}: {message}" if path is None else message)


def _failed(
    outcome: ExecOutcome, started: float, message: str, *, exit_code: int | None = None
) -> ExecResult:
    return ExecResult(
        stdout="",
        stderr=message,
        exit_code=exit_code,
        outcome=outcome,
        duration_ms=(time.monotonic() - started) * 1000,
        stdout_bytes_total=0,
        stderr_bytes_total=len(message.encode()),
    )


def join_capped(head: bytes, tail: bytes, total: int) -> str:
    """Head + tail as text, with a marker saying how many bytes were cut in between."""
    omitted = total - len(head) - len(tail)
    if omitted <= 0:
        return (head + tail).decode("utf-8", "replace")
    marker = f"\n[... {omitted} bytes of output omitted ...]\n"
    return head.decode("utf-8", "replace") + marker + tail.decode("utf-8", "replace")


def _exec_result(header: dict[str, Any], data: bytes) -> ExecResult:
    sizes = header["sizes"]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    chunks = [data[offsets[i] : offsets[i + 1]] for i in range(4)]
    return ExecResult(
        stdout=join_capped(chunks[0], chunks[1], header["stdout_total"]),
        stderr=join_capped(chunks[2], chunks[3], header["stderr_total"]),
        exit_code=header["exit_code"],
        outcome=ExecOutcome(header["outcome"]),
        duration_ms=float(header["duration_ms"]),
        stdout_bytes_total=int(header["stdout_total"]),
        stderr_bytes_total=int(header["stderr_total"]),
    )
