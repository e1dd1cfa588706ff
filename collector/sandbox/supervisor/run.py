"""Running one command: started as the right uid in its own session, its output read and
capped at the source, killed with its process group at the deadline.

Each command runs as ``bash -c PRELUDE+COMMAND`` (see :mod:`.state`). Its stdout/stderr are
read here and capped: the first and last ``cap/2`` bytes are kept and the total is counted,
so 1 GB of output never leaves the container. At the deadline this shell SIGKILLs the whole
process group (no ``timeout(1)`` in between: one exec less per command). The agent's
commands are started by the launcher (:func:`launch`, :mod:`.launcher`); the grader's by
this shell (:func:`spawn`)."""

import contextlib
import fcntl
import os
import selectors
import shutil
import signal
import subprocess
import time

from . import privileges
from .launcher import Launcher, current_launcher, ensure_launcher, real_uid, stop_launcher
from .privileges import AGENT_UID
from .procfs import oom_kills
from .state import BASE_ENV, PRELUDE, WORKSPACE, State, parse_state

QUIET_START_S = 0.02
"""How long a command runs before its pipes are read as it writes (see :func:`_pump`)."""
PIPE_BYTES = 256 * 1024
"""Pipe size asked for a command's stdout, stderr and state report: a quick command's output
waits there until it exits (more only makes it block until ``QUIET_START_S``). Not the
kernel's 1 MiB maximum: pipe capacity is counted per user (``pipe-user-pages-soft``, 64 MiB),
and the pipes of a command stay alive while a background process holds them, so an agent
that leaves such processes behind reaches the limit 4x later (after which new pipes are 2
pages: slower, never stuck)."""
DRAIN_AFTER_EXIT_S = 0.05
"""How long to keep reading pipes held open by background processes after the command."""
_TOOLS: dict[str, str] = {}
KILL_GRACE_S = 1.0
"""After the deadline's SIGKILL, how long the command's end may take to be reported before
the launcher (stopped by the agent) is killed as well."""


class Capper:
    """Keeps the head and tail of a stream, counting every byte."""

    def __init__(self, cap: int) -> None:
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap:  # trim rarely, not per chunk
                del self.tail[: len(self.tail) - self.tail_cap]

    def parts(self) -> tuple[bytes, bytes]:
        return bytes(self.head), bytes(self.tail[-self.tail_cap :] if self.tail_cap else b"")


def _tool(name: str) -> str:
    """The absolute path of an image tool, found in the image's own PATH (never the agent's)."""
    if name not in _TOOLS:
        _TOOLS[name] = shutil.which(name, path=BASE_ENV["PATH"]) or name
    return _TOOLS[name]


def command_shell() -> str:
    """The shell each agent command starts in: the image's ``bash-static`` where it has one,
    else ``bash``. The same bash (same version, same behaviour), linked statically: no
    loader, no relocations, ~0.25 ms less CPU per command (measured, 400 ``-c true`` each:
    1.04–1.14 vs 0.80–0.83 ms), a quarter of what a quick command costs in a sandbox. The
    agent's own ``bash`` is the image's dynamic one; ``$BASH`` names the static one."""
    if "bash-static" not in _TOOLS:
        _TOOLS["bash-static"] = shutil.which("bash-static", path=BASE_ENV["PATH"]) or _tool("bash")
    return _TOOLS["bash-static"]


def spawn(argv, *, env, cwd, timeout_s, cap, pass_fds=(), state_r=None, uid=AGENT_UID):
    """Run ``argv`` as ``uid`` in its own session until ``timeout_s``; read its output capped.

    Started from this shell (grading: the tests as the grader's uid, the code under test as
    the agent's), dropping to ``uid`` between fork and exec (``Popen(user=, group=,
    extra_groups=[])``: setting every uid to a non-zero one clears its capabilities, and
    ``privileges.settle`` emptied the bounding set, so nothing exec'd can regain one). The agent's own
    commands go through :func:`launch` instead.

    Returns (header, out, err, state_blob); header has exit_code, outcome, duration_ms."""
    ids = {"user": uid, "group": uid, "extra_groups": []} if privileges.PRIVILEGED else {}
    oom_before, started = oom_kills(), time.monotonic()
    out, err, state_blob = Capper(cap), Capper(cap), bytearray()
    (out_r, out_w), (err_r, err_w) = pipe(), pipe()
    sinks: list[tuple[int, Capper | bytearray]] = [(out_r, out), (err_r, err)]
    if state_r is not None:
        sinks.append((state_r, state_blob))
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out_w,
            stderr=err_w,
            cwd=cwd,
            env=env,
            pass_fds=pass_fds,
            start_new_session=True,
            **ids,
        )
    except OSError as e:
        for fd in (*pass_fds, out_w, err_w, *(fd for fd, _ in sinks)):
            os.close(fd)
        return _spawn_error(f"could not start the command: {e}", out, err, state_blob)
    for fd in (*pass_fds, out_w, err_w):
        os.close(fd)
    run = _Child(proc)
    timed_out = _pump(run, sinks, started, started + timeout_s)
    header = _ended(run.returncode, timed_out, started, timeout_s, oom_before)
    return header, out, err, state_blob


def launch(argv, state_at, *, env, cwd, timeout_s, cap):
    """:func:`spawn` for the agent's commands: started by the :class:`Launcher` (already the
    agent's uid: no fork of this shell). ``argv[state_at]`` is the state report's descriptor.

    A launcher that does not take the command (stopped or killed meanwhile) or cannot start
    it is replaced and the command tried once more: the agent can lower its own processes'
    limits (``prlimit`` on the launcher: no file descriptors, no processes), and a fresh
    launcher has the shell's."""
    for attempt in range(2):
        header, out, err, state_blob = _launch_once(argv, state_at, env, cwd, timeout_s, cap)
        if not header.get("spawn_error") or attempt:
            break
        stop_launcher()
    return header, out, err, state_blob


def _launch_once(argv, state_at, env, cwd, timeout_s, cap):
    oom_before, started = oom_kills(), time.monotonic()
    out, err, state_blob = Capper(cap), Capper(cap), bytearray()
    (out_r, out_w), (err_r, err_w), (state_r, state_w) = pipe(), pipe(), pipe()
    sinks: list[tuple[int, Capper | bytearray]] = [(out_r, out), (err_r, err)]
    sinks.append((state_r, state_blob))
    launcher = ensure_launcher()
    try:
        if launcher is None:
            raise OSError("no process can be started")
        launcher.launch(list(argv), state_at, env, cwd, (out_w, err_w, state_w))
    except OSError as e:
        for fd, _ in sinks:
            os.close(fd)
        return _spawn_error(f"could not start the command: {e}", out, err, state_blob)
    finally:
        for fd in (out_w, err_w, state_w):
            os.close(fd)
    run = _Launched(launcher)
    timed_out = _pump(run, sinks, started, started + timeout_s)
    if run.error is not None:
        return _spawn_error(f"could not start the command: {run.error}", out, err, state_blob)
    # the launcher died with the command's other processes: a ``kill -9 -1`` (SIGKILL)
    rc = -signal.SIGKILL if run.launcher_died else run.returncode
    return _ended(rc, timed_out, started, timeout_s, oom_before), out, err, state_blob


def _spawn_error(message: str, out: Capper, err: Capper, state_blob: bytearray):
    err.feed(message.encode())
    header = {"exit_code": None, "outcome": "ok", "duration_ms": 0.0, "spawn_error": True}
    return header, out, err, state_blob


def _ended(rc, timed_out: bool, started: float, timeout_s: float, oom_before: int) -> dict:
    """The header of a finished command: exit code as a shell reports it, and outcome."""
    duration_ms = (time.monotonic() - started) * 1000
    outcome = "ok"
    if timed_out or (rc in (-9, 137) and duration_ms >= timeout_s * 1000 - 5):
        outcome, rc = "timed_out", None
    elif rc in (-9, 137) and oom_kills() > oom_before >= 0:
        outcome = "oom_killed"
    if rc is not None and rc < 0:
        rc = 128 - rc  # report signals like a shell does (SIGKILL → 137)
    return {"exit_code": rc, "outcome": outcome, "duration_ms": duration_ms}


class _Child:
    """A command started by this shell, as :func:`_pump` watches it: its pidfd."""

    launcher_died = False
    error = None

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.exit_fd = os.pidfd_open(proc.pid)

    @property
    def returncode(self):
        return self.proc.returncode

    def pgid(self) -> int:
        return self.proc.pid

    def exited(self) -> bool:
        self.proc.wait()
        return True

    def abandon(self) -> None:
        pass  # the SIGKILL at the deadline always ends it

    def close(self) -> None:
        os.close(self.exit_fd)
        if self.proc.returncode is None:
            self.proc.wait()


class _Launched:
    """A command the launcher started, as :func:`_pump` watches it: the launcher's socket
    (its report when the command ends), or the command's pidfd once the launcher has died."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.exit_fd = launcher.sock.fileno()
        self.pidfd: int | None = None
        self.returncode: int | None = None
        self.error: str | None = None
        self.launcher_died = False
        self.pid = 0

    def pgid(self) -> int:
        """The command's pid, as the launcher wrote it, once it is known to be the agent's
        (this shell SIGKILLs its group: never one of another uid's)."""
        if not self.pid and not self.launcher_died:
            pid = self.launcher.command_pid()
            if pid > 1 and (not privileges.PRIVILEGED or real_uid(pid) == AGENT_UID):
                self.pid = pid
        return self.pid

    def exited(self) -> bool:
        """``exit_fd`` is readable: True when the command has ended; False when there is
        now another descriptor to watch (the launcher died: the command's own pidfd)."""
        if self.pidfd is not None:
            return True
        reply = self.launcher.result()
        if reply is not None:
            self.returncode, self.error = reply.get("rc"), reply.get("error")
            return True
        pid = self.pgid()
        self.launcher_died = True
        stop_launcher()
        if pid <= 0:
            return True  # it died before starting the command
        try:
            self.pidfd = self.exit_fd = os.pidfd_open(pid)
        except OSError:
            return True  # already gone
        return False

    def abandon(self) -> None:
        """The command outlived its SIGKILL by ``KILL_GRACE_S``: the launcher is stopped."""
        if self.pidfd is None and current_launcher() is self.launcher:
            os.kill(self.launcher.pid, signal.SIGKILL)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)


def run_command(state: State, req: dict) -> tuple[dict, bytes]:
    timeout_s = float(req["timeout_s"])
    cap = int(req["cap"])
    cwd = req.get("cwd") or state.cwd
    if not os.path.isdir(cwd):
        cwd = WORKSPACE if os.path.isdir(WORKSPACE) else "/"
    clean = bool(req.get("clean_env"))
    env = dict(BASE_ENV) if clean else dict(state.env)
    overrides = req.get("env") or {}
    env.update(overrides)
    # by absolute path: Popen looks argv[0] up in the command's PATH, which the agent sets
    # (``export PATH=/nowhere`` must not leave every later command unable to start)
    argv = [command_shell(), "-c", PRELUDE, "bash", "STATE_FD", req["command"]]
    header, out, err, state_blob = launch(argv, 4, env=env, cwd=cwd, timeout_s=timeout_s, cap=cap)
    if clean or header.get("spawn_error"):  # a clean-environment run leaves the state alone
        return exec_reply(header, out, err)
    saved = {k: state.env.get(k) for k in overrides}
    parse_state(bytes(state_blob), state)
    for key, value in saved.items():  # per-call env does not persist
        if value is None:
            state.env.pop(key, None)
        else:
            state.env[key] = value
    return exec_reply(header, out, err)


def pipe() -> tuple[int, int]:
    """A pipe holding up to ``PIPE_BYTES`` (best effort; 64 KiB where the kernel refuses)."""
    r, w = os.pipe()
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return r, w


def _drain(fd: int, sink) -> bool:
    """Read what ``fd`` holds now (it is non-blocking) into ``sink``, at most one full pipe
    (a writer as fast as this reader, ``yes``, must not keep the caller from its deadline);
    True at end-of-file."""
    for _ in range(PIPE_BYTES // 65536):
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if not chunk:
            return True
        if isinstance(sink, bytearray):
            sink.extend(chunk)
        else:
            sink.feed(chunk)
    return False


def _pump(run, sinks, started, deadline) -> bool:
    """Read the command's pipes (``(fd, sink)`` pairs, closed here) until it exits (``run``:
    :class:`_Child` or :class:`_Launched`); at ``deadline`` SIGKILL its process group. True
    when it timed out.

    For ``QUIET_START_S`` only the command's exit wakes this shell: what it writes meanwhile
    waits in the pipes (``PIPE_BYTES`` each). A quick command thus costs one wake-up, where
    watching the pipes from the start cost one per write (bash's ``declare -px`` writes a
    line at a time: 10-20 wake-ups for ``true``, each a trip through the run queue of a
    busy host). A command that outlives it is read as it writes, as before."""
    sel = selectors.DefaultSelector()
    sel.register(run.exit_fd, selectors.EVENT_READ, None)
    for fd, _ in sinks:
        os.set_blocking(fd, False)
    watch_from = started + QUIET_START_S
    watching = False
    timed_out = False
    exited_at = None
    abandoned = False
    try:
        while True:
            now = time.monotonic()
            if exited_at is None and now >= deadline:
                _killpg(run.pgid())  # the whole group, as timeout(1) did (watchdog level 1)
                timed_out = True
                if now >= deadline + KILL_GRACE_S and not abandoned:
                    run.abandon()
                    abandoned = True
            if not watching and (exited_at is not None or now >= watch_from):
                for fd, sink in sinks:
                    sel.register(fd, selectors.EVENT_READ, sink)
                watching = True
            if exited_at is not None:
                wait = exited_at + DRAIN_AFTER_EXIT_S - now
                if not sel.get_map() or wait <= 0:
                    break
            else:
                wait = 0.5 if timed_out else min(deadline - now, 0.5)
                if not watching:
                    wait = min(wait, watch_from - now)
            for key, _ in sel.select(timeout=max(wait, 0.0)):
                if key.data is None:
                    sel.unregister(key.fileobj)
                    if run.exited():
                        exited_at = time.monotonic()
                    else:  # watch the command itself now
                        sel.register(run.exit_fd, selectors.EVENT_READ, None)
                elif _drain(key.fd, key.data):
                    sel.unregister(key.fileobj)
    finally:
        sel.close()
        run.close()
        for fd, _ in sinks:
            os.close(fd)
    return timed_out


def _killpg(pgid: int) -> None:
    if pgid <= 1:  # not started yet (0 would be this shell's own group)
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def exec_reply(header: dict, out: Capper, err: Capper) -> tuple[dict, bytes]:
    out_head, out_tail = out.parts()
    err_head, err_tail = err.parts()
    header.update(
        stdout_total=out.total,
        stderr_total=err.total,
        sizes=[len(out_head), len(out_tail), len(err_head), len(err_tail)],
    )
    return header, out_head + out_tail + err_head + err_tail
