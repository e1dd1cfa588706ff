"""The persistent shell that runs INSIDE each sandbox container (python3 stdlib only).

The host starts it once per container with ``podman exec -i CID python3 supervisor.py
--listen SOCKET`` and talks to it over that Unix socket (bind-mounted from the host, see
:func:`listen`; without ``--listen``, over stdin/stdout) with framed messages: one JSON
header line, then exactly
``len`` raw bytes of payload (binary-safe, so files of any content and size round-trip
byte-exact). Replies use the same framing; the reply header is the end marker and carries
the exit status.

Each command runs as ``bash -c PRELUDE+COMMAND`` in its own session and process group, as
the agent's uid (see :class:`Launcher`). Its stdout/stderr are read
here and capped at the source: the first and last ``cap/2`` bytes are kept and the total is
counted, so 1 GB of output never leaves the container. At the deadline this shell SIGKILLs
the whole process group (no ``timeout(1)`` in between: one exec less per command). The
agent's commands are started by :class:`Launcher`, a child of this shell that runs as the
agent's uid (so starting one costs no fork of this shell); a command that kills every
process of the agent (``kill -9 -1``) kills the launcher too and is reported as killed (137).

State semantics: the working directory and the exported environment persist from one command
to the next (bash runs with ``set -a``, so plain ``X=1`` assignments persist too); shell
functions, aliases and shell options do not. Background processes keep running, but output
they write after their command returned is not collected (redirect it to a file).

Users: the supervisor runs as container root (an unprivileged host uid) holding only the
capabilities it needs to manage the container (chown, DAC override, fowner, kill, setuid,
setgid, setpcap). Every agent command runs as ``AGENT_UID`` (started by the launcher, which has it)
with no capabilities and an empty bounding set, so the agent cannot trace, signal or borrow
the file descriptors of the supervisor; the agent-facing file operations (the editor, seed files) run
with the agent's file-system uid, so they have exactly the agent's rights. Grading
(``grader.py``) runs the tests as ``GRADER_UID``, a uid the agent never has.

This file must not import anything from the project: the container has only python3.
"""

import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import re
import selectors
import shutil
import signal
import socket
import stat as stat_module
import struct
import subprocess
import sys
import tarfile
import time

WORKSPACE = "/workspace"
GRADE_DIR = "/grade"
WIPE_DIRS = ("/workspace", "/tmp", "/dev/shm", "/dev/mqueue", GRADE_DIR, "/tests", "/logs")
MOUNT_MODES = {
    "/workspace": 0o1777, "/tmp": 0o1777, "/dev/shm": 0o1777, GRADE_DIR: 0o755,
    # open-instruct's paths (/tests, /logs/verifier): the grader fills them at submit
    "/tests": 0o755, "/logs": 0o755,
}  # fmt: skip
"""Writable mount points and the owner-root mode a reset restores."""
AGENT_UID = 1000
"""The uid every agent command runs as (never root, never the grader)."""
GRADER_UID = 1001
"""The uid the task's tests run as at submit; no agent process ever has it."""
PRIVILEGED = False
"""True in a sandbox as container root (set in ``main``); False when run outside one (unit
tests on the host), where commands run as the caller."""
OOM_CONTROL = "/sys/fs/cgroup/memory/memory.oom_control"
OOM_EVENTS_V2 = "/sys/fs/cgroup/memory.events"
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "PAGER": "cat",
    "GIT_PAGER": "cat",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}
# Runs before the command inside bash: state is reported on the state pipe at exit (the
# working directory, then ``declare -px``: builtins only, no fork; a ``$(compgen -e)`` loop
# cost 0.6 ms of CPU per command, half of what bash itself costs); the command's processes
# volunteer to be the OOM killer's first choice.
PRELUDE = r"""
echo 1000 > /proc/self/oom_score_adj 2>/dev/null
__sp_report() {
  __sp_rc=$?
  { builtin printf '%s\0' "$PWD"; builtin declare -px; } >&"$__sp_fd" 2>/dev/null
  exit $__sp_rc
}
trap __sp_report EXIT
set -a
__sp_fd=$1; __sp_cmd=$2; shift 2
eval "$__sp_cmd"
"""
_DECLARED = re.compile(
    rb"declare -[a-zA-Z]+ ([A-Za-z_][A-Za-z0-9_]*)"
    rb"""(?:=("(?:[^"\\]|\\.)*"|\$'(?:[^'\\]|\\.)*'))?""",
    re.S,
)
"""One line of bash's ``declare -px`` for a scalar: a name, then its value double-quoted
(``\\`` before ``"``, ``\\``, ``$`` and a backquote) or, when it holds a byte the locale
cannot print (a newline always), ANSI-C quoted (``$'...'``), so a value never spans lines;
an exported variable without a value has no ``=``. Arrays (``=(...)``) are never passed to a
program's environment and are skipped."""
_ANSI_C = {
    b"a": b"\a", b"b": b"\b", b"e": b"\x1b", b"E": b"\x1b", b"f": b"\f", b"n": b"\n",
    b"r": b"\r", b"t": b"\t", b"v": b"\v",
}  # fmt: skip


def _ansi_c_escape(m: "re.Match[bytes]") -> bytes:
    code = m.group(1)
    if code[:1] in b"01234567":
        return bytes([int(code, 8) & 0xFF])
    if code[:1] == b"x":
        return bytes([int(code[1:], 16)])
    return _ANSI_C.get(code, code)  # \\ \' \" and anything else: the character itself


def declared_value(quoted: bytes) -> bytes:
    """The bytes of one value as ``declare -p`` quoted it."""
    if quoted.startswith(b"$'"):
        return re.sub(rb"\\([0-7]{1,3}|x[0-9A-Fa-f]{1,2}|.)", _ansi_c_escape, quoted[2:-1],
                      flags=re.S)  # fmt: skip
    return re.sub(rb'\\([\\"$`])', rb"\1", quoted[1:-1])


MAX_TREE_ENTRIES = 5000
MAX_TREE_BYTES = 256 * 1024
"""A folder listing stops here too: the reply header is one line the host reads bounded."""
"""A directory view lists at most this many paths (the reply stays small)."""
MAX_SCAN_BYTES = 1 << 30
"""A line-range read scans at most this much of a file (any real file on the tmpfs fits)."""
ACCEPT_TIMEOUT_S = 60.0
"""How long a ``--listen`` shell waits for the host to connect before it exits."""
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
PR_SET_PDEATHSIG = 1


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


class State:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.cwd = WORKSPACE
        self.env = dict(BASE_ENV)


def read_small(path: str) -> str:
    """A small kernel file (``/proc``, cgroup) in three system calls; ``open()`` makes
    seven (stat, isatty, seek...), and these are read several times per command."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536).decode()
    finally:
        os.close(fd)


def oom_kills() -> int:
    for path in (OOM_CONTROL, OOM_EVENTS_V2):
        try:
            text = read_small(path)
        except OSError:
            continue
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    return -1


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


LAUNCH_TIMEOUT_S = 2.0
"""How long handing a command to the launcher may block (it is the agent's own process)."""
KILL_GRACE_S = 1.0
"""After the deadline's SIGKILL, how long the command's end may take to be reported before
the launcher (stopped by the agent) is killed as well."""
_LAUNCHER: "Launcher | None" = None
LAUNCHER_TITLE = b"sandpiper-launcher"


class Launcher:
    """Starts the agent's commands: a child of this shell, forked once and never exec'd,
    running as the agent's uid. Commands are handed over on a socket pair (the request,
    with the command's pipe ends passed as descriptors); the launcher writes the command's
    pid into a page shared with this shell and, when the command ends, sends back its exit
    status.

    Why: ``Popen(user=...)`` forks, since CPython will not ``vfork`` while changing uids.
    Measured in a sandbox container (bench/sandbox_bench.py, round 4), that fork cost this
    shell 1.0 ms more CPU per command and the child 0.6 ms more, about half of all the CPU a
    ``true`` took. The launcher already has the agent's uid, so its ``Popen`` vforks.

    What the agent can do to it (docs/security.md): it is the agent's own process, so the
    agent can kill or stop it, as it can its own commands. It cannot trace it, read its memory
    or take its descriptors: a process that changed its uid without an exec is not dumpable.
    It holds nothing of this shell's: every other descriptor is closed, and setting every uid
    to a non-zero one cleared its capabilities. If the launcher dies during a command (a
    ``kill -9 -1`` kills it with every other process of the agent, as it killed the sentinel
    that did this job before), that command is reported killed (137), and the next command
    gets a new launcher. If it is stopped, a new one replaces it before the next command; a
    launcher stopped during a command lets that command run to its deadline, then both die.
    """

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.page = mmap.mmap(-1, mmap.PAGESIZE)  # anonymous and MAP_SHARED: shared after fork
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the launcher
            try:
                ours.close()
                _serve_launches(theirs, self.page, parent)
            finally:
                os._exit(0)
        theirs.close()
        ours.settimeout(LAUNCH_TIMEOUT_S)
        self.pid, self.sock = pid, ours

    def ready(self) -> bool:
        """Alive and not stopped (``/proc/PID/stat`` state)."""
        try:
            state = read_small(f"/proc/{self.pid}/stat").rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return False
        return state in ("S", "R", "D")

    def launch(self, argv: list, state_at: int, env: dict, cwd: str, fds: tuple) -> None:
        """Hand a command over; ``argv[state_at]`` becomes the state report's descriptor
        number in the launcher. Raises OSError when the launcher does not take it."""
        struct.pack_into("q", self.page, 0, 0)
        body = json.dumps({"argv": argv, "state_at": state_at, "env": env, "cwd": cwd}).encode()
        socket.send_fds(self.sock, [struct.pack("I", len(body))], list(fds))
        self.sock.sendall(body)

    def command_pid(self) -> int:
        """The running command's pid (its process group), 0 until it has started."""
        return struct.unpack_from("q", self.page, 0)[0]

    def result(self) -> dict | None:
        """The launcher's report on the command (``rc`` or ``error``); None if it died."""
        try:
            (n,) = struct.unpack("I", _recv_exactly(self.sock, 4))
            return json.loads(_recv_exactly(self.sock, n))
        except (OSError, ValueError, EOFError):
            return None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self.sock.close()
        self.page.close()


def _real_uid(pid: int) -> int | None:
    try:
        return int(read_small(f"/proc/{pid}/status").split("\nUid:")[1].split()[0])
    except (OSError, IndexError, ValueError):
        return None


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the peer closed the socket")
        data += chunk
    return data


def _serve_launches(sock: socket.socket, page: mmap.mmap, parent: int) -> None:
    """The launcher's loop (in the forked child): drop to the agent's uid, then start one
    command per request and report its exit status."""
    keep = sock.fileno()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, keep)  # the host's connection, the previous command's pipes, ...
    os.closerange(keep + 1, max(keep + 2, os.sysconf("SC_OPEN_MAX")))
    _set_command_line(LAUNCHER_TITLE)
    if PRIVILEGED:
        os.setgroups([])
        os.setresgid(AGENT_UID, AGENT_UID, AGENT_UID)
        os.setresuid(AGENT_UID, AGENT_UID, AGENT_UID)
    # after the uid change, which clears it: die with this shell
    (_LIBC or ctypes.CDLL(None, use_errno=True)).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        return  # the shell died before that
    sock.settimeout(None)
    while True:
        try:
            head, fds, _, _ = socket.recv_fds(sock, 4, 3)
        except OSError:
            return
        if not head:
            return
        try:
            head += _recv_exactly(sock, 4 - len(head))
            req = json.loads(_recv_exactly(sock, struct.unpack("I", head)[0]))
            reply = _launch_one(req, fds, page)
        except EOFError:
            return
        except Exception as e:  # reported as a command that could not start
            reply = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        msg = json.dumps(reply).encode()
        sock.sendall(struct.pack("I", len(msg)) + msg)


def _set_command_line(title: bytes) -> None:
    """Show ``title`` as this process's command line (``/proc/PID/cmdline``, ``ps -o args``,
    ``pkill -f``): the launcher is a fork of the shell and would show the shell's, so an agent
    aiming at "the supervisor" by name would hit its own launcher instead. The arguments'
    memory is overwritten in place (``/proc/self/stat`` fields 48 and 49 give where it is)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = read_small("/proc/self/stat").rpartition(")")[2].split()
        start, end = int(fields[45]), int(fields[46])
        text = title[: end - start - 1]
        ctypes.memset(start, 0, end - start)
        ctypes.memmove(start, text, len(text))


def _launch_one(req: dict, fds: list, page: mmap.mmap) -> dict:
    out_w, err_w, state_w = fds
    argv = req["argv"]
    argv[req["state_at"]] = str(state_w)
    kw = {"stdin": subprocess.DEVNULL, "stdout": out_w, "stderr": err_w, "env": req["env"],
          "pass_fds": (state_w,), "start_new_session": True}  # fmt: skip
    try:
        proc = subprocess.Popen(argv, cwd=req["cwd"], **kw)
    except PermissionError:  # a folder the agent made unenterable: start where it can
        proc = subprocess.Popen(argv, cwd=WORKSPACE if os.path.isdir(WORKSPACE) else "/", **kw)
    for fd in fds:
        os.close(fd)
    fds.clear()
    struct.pack_into("q", page, 0, proc.pid)
    return {"rc": proc.wait()}


def _launcher() -> Launcher | None:
    """The launcher, started if it is not running (first command, after a reset or a
    ``kill -9 -1``) or replaced if it is stopped; None if none can start (pids exhausted:
    the command could not start either)."""
    global _LAUNCHER
    if _LAUNCHER is not None and not _LAUNCHER.ready():
        stop_launcher()
    if _LAUNCHER is None:
        with contextlib.suppress(OSError):
            _LAUNCHER = Launcher()
    return _LAUNCHER


def stop_launcher() -> None:
    """Kill the launcher and reap it (before killing the agent's processes on purpose: it is
    not the agent's, so it must not count as left behind)."""
    global _LAUNCHER
    if _LAUNCHER is not None:
        _LAUNCHER.kill()
        _LAUNCHER = None


def reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def parse_state(blob: bytes, state: State) -> None:
    cwd, sep, declared = blob.partition(b"\0")
    if not sep or declared[-1:] not in (b"", b"\n"):
        return  # killed before (or while) reporting: keep the previous state
    env = {}
    for line in declared[:-1].split(b"\n") if declared else ():
        m = _DECLARED.fullmatch(line)
        if m is None:
            continue  # an array
        name, quoted = m.groups()
        if quoted is not None and not name.startswith(b"__sp_"):
            env[name.decode()] = declared_value(quoted).decode("utf-8", "surrogateescape")
    state.cwd = cwd.decode("utf-8", "surrogateescape")
    state.env = env


def spawn(argv, *, env, cwd, timeout_s, cap, pass_fds=(), state_r=None, uid=AGENT_UID):
    """Run ``argv`` as ``uid`` in its own session until ``timeout_s``; read its output capped.

    Started from this shell (grading: the tests as the grader's uid, the code under test as
    the agent's), dropping to ``uid`` between fork and exec (``Popen(user=, group=,
    extra_groups=[])``: setting every uid to a non-zero one clears its capabilities, and
    ``main`` emptied the bounding set, so nothing exec'd can regain one). The agent's own
    commands go through :func:`launch` instead.

    Returns (header, out, err, state_blob); header has exit_code, outcome, duration_ms."""
    ids = {"user": uid, "group": uid, "extra_groups": []} if PRIVILEGED else {}
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
    launcher = _launcher()
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
            if pid > 1 and (not PRIVILEGED or _real_uid(pid) == AGENT_UID):
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
        if self.pidfd is None and _LAUNCHER is self.launcher:
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
        return _exec_reply(header, out, err)
    saved = {k: state.env.get(k) for k in overrides}
    parse_state(bytes(state_blob), state)
    for key, value in saved.items():  # per-call env does not persist
        if value is None:
            state.env.pop(key, None)
        else:
            state.env[key] = value
    return _exec_reply(header, out, err)


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


def _exec_reply(header: dict, out: Capper, err: Capper) -> tuple[dict, bytes]:
    out_head, out_tail = out.parts()
    err_head, err_tail = err.parts()
    header.update(
        stdout_total=out.total,
        stderr_total=err.total,
        sizes=[len(out_head), len(out_tail), len(err_head), len(err_tail)],
    )
    return header, out_head + out_tail + err_head + err_tail


def inside_sandbox() -> bool:
    """True in a sandbox container (pid 1 is catatonit, this file mounted at
    /.sandpiper): kill -1 is only safe there."""
    if os.path.abspath(__file__) != "/.sandpiper/supervisor.py":
        return False
    try:
        with open("/proc/1/comm") as f:
            return f.read().strip() == "catatonit"
    except OSError:
        return False


def kill_everything_else() -> None:
    """SIGKILL every process this uid can signal except us and init (kill -9 -1)."""
    if not inside_sandbox():
        raise RuntimeError("refusing kill -1 outside a sandbox container")
    stop_launcher()
    for attempt in range(200):  # a fork bomb keeps forking while we kill
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            break
        reap()
        # short first: the killed die within moments
        time.sleep(min(0.005, 0.0002 * 2**attempt))
    reap()


def uid_processes(uid: int) -> list[int]:
    """Pids of live (not zombie) processes whose real or effective uid is ``uid``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        uids = fields.get("Uid", "").split()
        if fields.get("State", "").strip().startswith("Z") or not uids:
            continue
        if int(uids[0]) == uid or int(uids[1]) == uid:
            found.append(int(name))
    return found


def kill_uid(uid: int) -> int:
    """SIGKILL every process of ``uid`` (stopped ones too); return how many survived.

    A child that becomes ``uid`` sends ``kill(-1)``, which reaches exactly that uid's
    processes in one call even while they fork; it closes every descriptor first, so it
    holds nothing worth stealing in the moment it shares the uid."""
    if not PRIVILEGED:
        return 0
    if uid == AGENT_UID:
        stop_launcher()
    for _ in range(3):
        if not uid_processes(uid):  # only the supervisor starts this uid: none can appear
            return 0
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                os.closerange(0, 65536)
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                for _ in range(200):  # a fork bomb keeps forking while we kill
                    try:
                        os.kill(-1, signal.SIGKILL)
                    except ProcessLookupError:
                        break
                    if not [p for p in uid_processes(uid) if p != os.getpid()]:
                        break  # only zombies are left (kill(-1) "reaches" those too)
                    time.sleep(0.002)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        reap()
        for _ in range(50):  # SIGKILL is asynchronous: wait until they are gone
            if not uid_processes(uid):
                return 0
            time.sleep(0.005)
            reap()
    return len(uid_processes(uid))


def remove_ipc(uid: int) -> None:
    """Remove SysV shared memory, queues and semaphores ``uid`` created (``ipcrm -a``)."""
    if PRIVILEGED and _has_ipc(uid):
        # dropped between fork and exec like ``spawn``: with the bounding set emptied at
        # start, an exec'd ``setpriv`` would hold no CAP_SETUID and ipcrm would not run as uid
        subprocess.run(["ipcrm", "-a"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=False, env=BASE_ENV, user=uid, group=uid,
                       extra_groups=[])  # fmt: skip


def _has_ipc(uid: int) -> bool:
    """Whether ``uid`` owns a SysV IPC object (cheap: no process started when none)."""
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header = f.readline().split()
                col = header.index("uid")
                if any(int(line.split()[col]) == uid for line in f if line.strip()):
                    return True
        except (OSError, ValueError, IndexError):
            return True  # cannot tell: remove to be safe
    return False


_LIBC = None


@contextlib.contextmanager
def agent_fs():
    """File operations inside run with the agent's file-system uid and gid: exactly its
    rights (root's DAC capabilities leave the effective set while the fsuid is not 0)."""
    if not PRIVILEGED or _LIBC is None:
        yield
        return
    _LIBC.setfsgid(AGENT_UID)
    _LIBC.setfsuid(AGENT_UID)
    if _LIBC.setfsuid(AGENT_UID) != AGENT_UID:  # returns the current fsuid
        raise PermissionError("could not switch to the agent's file-system uid")
    try:
        yield
    finally:
        _LIBC.setfsuid(0)
        _LIBC.setfsgid(0)


def reset_all() -> None:
    """Leave nothing of the episode: processes, files, IPC objects, modes of mount points."""
    kill_everything_else()
    for uid in (AGENT_UID, GRADER_UID):
        remove_ipc(uid)
    for path in WIPE_DIRS:
        wipe(path)
    if PRIVILEGED:
        for path, mode in MOUNT_MODES.items():
            with contextlib.suppress(OSError):
                os.chown(path, 0, 0)
                os.chmod(path, mode)


def wipe(path: str) -> None:
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        full = os.path.join(path, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(full)


def write_file(req: dict, data: bytes) -> dict:
    path = req["path"]
    existed = os.path.exists(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    # O_NONBLOCK: a FIFO put where a file was expected fails at once instead of blocking.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, 0o600)
    with os.fdopen(fd, "wb") as f:
        if not stat_module.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"not a regular file: {path}")
        f.write(data)
    if not existed:
        os.chmod(path, int(req.get("mode", 0o644)))
    return {}


def open_regular(path: str) -> int:
    """A read descriptor of a regular file; FIFOs and devices are refused without blocking."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat_module.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"not a regular file: {path}")
    return fd


def read_file(req: dict) -> tuple[dict, bytes]:
    """At most ``limit`` bytes of a regular file (all of it without a limit)."""
    fd = open_regular(req["path"])
    limit = req.get("limit")
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        data = f.read() if limit is None else f.read(int(limit))
    return {"size": size}, data


def read_lines(req: dict) -> tuple[dict, bytes]:
    """Lines ``first``..``last`` (1-based, ``last`` -1 = to the end; lines as
    ``split("\\n")`` makes them, each with its newline) of a regular file, at most ``limit``
    bytes, and the file's line count. The file is streamed: only the selection is kept."""
    first, last, limit = int(req["first"]), int(req["last"]), int(req["limit"])
    fd = open_regular(req["path"])
    out, line, truncated, scanned = bytearray(), 1, False, 0
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 16), b""):
            scanned += len(chunk)
            if scanned > MAX_SCAN_BYTES:  # a sparse 1 TB file would keep the shell busy
                raise OSError(errno.EFBIG, f"more than {MAX_SCAN_BYTES} bytes to scan by line")
            newlines = chunk.count(b"\n")
            if line + newlines < first or (last != -1 and line > last):
                line += newlines  # nothing selected in this chunk: count it and move on
                continue
            start = 0
            while True:
                newline = chunk.find(b"\n", start)
                end = len(chunk) if newline < 0 else newline + 1
                if line >= first and (last == -1 or line <= last):
                    piece, room = chunk[start:end], max(limit - len(out), 0)
                    out += piece[:room]
                    truncated = truncated or len(piece) > room
                if newline < 0:
                    break
                line, start = line + 1, newline + 1
    return {"n_lines": line, "truncated": truncated}, bytes(out)


def untar(req: dict, data: bytes) -> dict:
    """Extract regular files and directories only; reject absolute paths and ``..``."""
    import io

    dest = req["dest"]
    if req.get("replace"):
        shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if member.name.startswith("/") or ".." in parts:
                raise ValueError(f"unsafe path in archive: {member.name!r}")
            target = os.path.join(dest, *[p for p in parts if p not in ("", ".")])
            if member.isdir():
                os.makedirs(target, exist_ok=True)
            elif member.isfile():
                os.makedirs(os.path.dirname(target), exist_ok=True)
                src = tar.extractfile(member)
                assert src is not None  # a regular file member always has data
                with open(target, "wb") as f:
                    shutil.copyfileobj(src, f)
                os.chmod(target, member.mode & 0o777)
    return {}


def make_tar(req: dict) -> tuple[dict, bytes]:
    import io

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(req["src"], arcname=".")
    return {}, buf.getvalue()


def stat(req: dict) -> dict:
    path = req["path"]
    try:
        st = os.stat(path)
    except OSError:
        return {"exists": False, "is_dir": False, "kind": "missing", "size": 0}
    mode = st.st_mode
    kind = next((k for k, test in _KINDS if test(mode)), "other")
    return {"exists": True, "is_dir": kind == "dir", "kind": kind, "size": st.st_size}


_KINDS = (
    ("file", stat_module.S_ISREG),
    ("dir", stat_module.S_ISDIR),
    ("fifo", stat_module.S_ISFIFO),
    ("character device", stat_module.S_ISCHR),
    ("block device", stat_module.S_ISBLK),
    ("socket", stat_module.S_ISSOCK),
)


def list_tree(req: dict) -> dict:
    """Paths up to ``depth`` levels below ``path``, hidden entries (and their contents) skipped."""
    root, depth = req["path"], int(req.get("depth", 2))
    found, size = [root], [len(root)]

    def walk(path: str, level: int) -> None:
        if level > depth:
            return
        try:
            names = sorted(os.listdir(path))
        except OSError:
            return
        for name in names:
            if name.startswith("."):
                continue
            if len(found) >= MAX_TREE_ENTRIES or size[0] >= MAX_TREE_BYTES:
                return
            full = os.path.join(path, name)
            found.append(full)
            size[0] += len(full) + 1
            if os.path.isdir(full) and not os.path.islink(full):
                walk(full, level + 1)

    walk(root, 1)
    return {"paths": found}


AGENT_FILE_OPS = {
    "write": lambda req, payload: (write_file(req, payload), b""),
    "read": lambda req, payload: read_file(req),
    "lines": lambda req, payload: read_lines(req),
    "untar": lambda req, payload: (untar(req, payload), b""),
    "tar": lambda req, payload: make_tar(req),
    "stat": lambda req, payload: (stat(req), b""),
    "tree": lambda req, payload: (list_tree(req), b""),
}
"""Operations on the agent's files; they run with the agent's file-system uid."""


def handle(state: State, req: dict, payload: bytes) -> tuple[dict, bytes]:
    op = req["op"]
    if op == "exec":
        return run_command(state, req)
    if op in AGENT_FILE_OPS:
        with agent_fs():
            return AGENT_FILE_OPS[op](req, payload)
    if op == "grade":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import grader  # a sibling file, mounted read-only next to this one

        return grader.grade(sys.modules[__name__], req, payload)
    if op == "reset":
        reset_all()
        state.reset()
        return {}, b""
    if op == "kill_all":
        kill_everything_else()
        return {}, b""
    if op == "ping":
        return {"pid": os.getpid(), "oom_kills": oom_kills(), "privileged": PRIVILEGED}, b""
    raise ValueError(f"unknown op {op!r}")


def drop_bounding_set() -> None:
    """Empty this process's capability bounding set: no program started from here (all run
    as non-root uids) can gain a capability at exec, whatever its file capabilities. The
    supervisor keeps the capabilities it already holds."""
    pr_capbset_drop = 24
    if _LIBC is None:  # loaded by main() before any command runs
        raise OSError("libc is not loaded: cannot drop the capability bounding set")
    for cap in range(64):
        if _LIBC.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            if err == errno.EINVAL:  # past the last capability this kernel knows
                return
            raise OSError(err, f"could not drop capability {cap} from the bounding set")


def announce_ready(**extra: str) -> None:
    """The line the host waits for on this process's stdout before its first request."""
    line = json.dumps({"ready": True, "pid": os.getpid(), **extra}).encode() + b"\n"
    sys.stdout.buffer.write(line)
    sys.stdout.buffer.flush()


def listen(path: str):
    """Serve the host over a Unix socket at ``path`` instead of this process's stdio.

    The socket lies in a folder bind-mounted from the host (``host_state.socket_dir``), owned by
    container root with mode 0700: no agent uid can reach it. ``ready`` is announced on
    stdout (the ``podman exec`` pipe, unused after that) once the socket listens; the first
    peer from OUTSIDE this container is served (``SO_PEERCRED`` reports pid 0 for a process
    of another pid namespace, the host's collector), and the socket file is unlinked at once,
    so nothing can connect later. Why: every request and reply over ``podman exec``'s stdio
    crossed two relay processes (the podman client and conmon) each way: four extra
    wake-ups per command, which under saturation each wait on a run queue (see
    bench/sandbox_bench.py). Returns the connection's (reader, writer) files."""
    import socket
    import struct

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o600)
    server.listen(4)
    server.settimeout(ACCEPT_TIMEOUT_S)
    announce_ready(socket=path)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            sys.exit(1)  # the host never came: nothing to serve
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        peer_pid = struct.unpack("3i", creds)[0]
        if peer_pid == 0 or not PRIVILEGED:
            break
        conn.close()  # a process of this container (it could not reach the folder anyway)
    os.unlink(path)
    server.close()
    conn.settimeout(None)
    return conn.makefile("rb"), conn.makefile("wb")


def main() -> None:
    global PRIVILEGED, _LIBC
    if "--takeover" in sys.argv:  # a previous shell may be hung: make room
        kill_everything_else()
    PRIVILEGED = os.geteuid() == 0 and inside_sandbox()
    if PRIVILEGED:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        drop_bounding_set()
    os.chdir(WORKSPACE if os.path.isdir(WORKSPACE) else "/")
    if PRIVILEGED:
        os.setgroups([])  # no supplementary groups reach the agent-facing file operations
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    state = State()
    _launcher()  # before the first command (a fork of this shell: ~1-2 ms, once)
    if "--listen" in sys.argv:
        stdin, stdout = listen(sys.argv[sys.argv.index("--listen") + 1])
    else:
        stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
        announce_ready()
    while True:
        line = stdin.readline()
        if not line:
            return
        req = json.loads(line)
        payload = stdin.read(req.get("len", 0)) if req.get("len") else b""
        try:
            header, out = handle(state, req, payload)
        except Exception as e:  # reported to the host as data; the shell keeps serving
            header, out = {"error": type(e).__name__, "message": str(e)}, b""
        reap()
        header["len"] = len(out)
        stdout.write(json.dumps(header).encode() + b"\n")
        stdout.write(out)
        stdout.flush()
        if _LAUNCHER is None:  # gone with a reset, a grade or a kill -9 -1:
            _launcher()  # the next command should not wait for a new one (not this reply)


if __name__ == "__main__":
    main()
