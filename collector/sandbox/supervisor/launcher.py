"""The launcher: the agent's process that starts the agent's commands (see :class:`Launcher`).

One per sandbox at a time, kept in this module (:func:`ensure_launcher`,
:func:`current_launcher`, :func:`stop_launcher`)."""

import contextlib
import ctypes
import json
import mmap
import os
import signal
import socket
import struct
import subprocess

from . import privileges
from .procfs import read_small
from .state import WORKSPACE

PR_SET_PDEATHSIG = 1
LAUNCH_TIMEOUT_S = 2.0
"""How long handing a command to the launcher may block (it is the agent's own process)."""
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


def real_uid(pid: int) -> int | None:
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
    if privileges.PRIVILEGED:
        uid = privileges.AGENT_UID
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    # after the uid change, which clears it: die with this shell
    (privileges.LIBC or ctypes.CDLL(None, use_errno=True)).prctl(
        PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0
    )
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


def ensure_launcher() -> Launcher | None:
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


def current_launcher() -> Launcher | None:
    """The launcher started last, None after :func:`stop_launcher`."""
    return _LAUNCHER


def stop_launcher() -> None:
    """Kill the launcher and reap it (before killing the agent's processes on purpose: it is
    not the agent's, so it must not count as left behind)."""
    global _LAUNCHER
    if _LAUNCHER is not None:
        _LAUNCHER.kill()
        _LAUNCHER = None
