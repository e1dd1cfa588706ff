"""The supervisor's server: serves the host's framed requests one at a time.

Framing: one JSON header line, then exactly ``len`` raw bytes of payload (binary-safe, so
files of any content and size round-trip byte-exact). Replies use the same framing; the
reply header is the end marker and carries the exit status. An error in a request is
reported as data (``error``, ``message``) and the shell keeps serving."""

import contextlib
import json
import os
import signal
import sys
import time

from . import privileges
from .files import AGENT_FILE_OPS
from .launcher import current_launcher, ensure_launcher
from .procfs import oom_kills
from .reset import kill_everything_else, reap, reset_all
from .run import run_command
from .state import WORKSPACE, State

ACCEPT_TIMEOUT_S = 60.0
"""How long a ``--listen`` shell waits for the host to connect before it exits."""


def handle(state: State, req: dict, payload: bytes) -> tuple[dict, bytes]:
    """One request's reply (header, payload); raises on a request it cannot serve."""
    op = req["op"]
    if op == "exec":
        return run_command(state, req)
    if op in AGENT_FILE_OPS:
        with privileges.agent_fs():
            return AGENT_FILE_OPS[op](req, payload)
    if op == "grade":
        from . import grader  # on the first submit only

        return grader.grade(req, payload)
    if op == "reset":
        reset_all()
        state.reset()
        return {}, b""
    if op == "kill_all":
        kill_everything_else()
        return {}, b""
    if op == "ping":
        return {
            "pid": os.getpid(),
            "oom_kills": oom_kills(),
            "privileged": privileges.PRIVILEGED,
        }, b""
    raise ValueError(f"unknown op {op!r}")


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
    announce_ready(socket=path)
    while True:
        conn = _accept_while_the_host_lives(server)
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        peer_pid = struct.unpack("3i", creds)[0]
        if peer_pid == 0 or not privileges.PRIVILEGED:
            break
        conn.close()  # a process of this container (it could not reach the folder anyway)
    os.unlink(path)
    server.close()
    conn.settimeout(None)
    return conn.makefile("rb"), conn.makefile("wb")


def _accept_while_the_host_lives(server):
    """The next connection; exit when the host never comes (:data:`ACCEPT_TIMEOUT_S`) or is
    gone: its end of the ``podman exec`` stdin pipe closed. A collector killed between
    starting this shell and connecting to it left the shell (and its ``podman exec`` on the
    host) waiting out the whole timeout."""
    import select

    stdin = sys.stdin.buffer.fileno()
    deadline = time.monotonic() + ACCEPT_TIMEOUT_S
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([server, stdin], [], [], left)
        if server in ready:
            return server.accept()[0]
        if stdin in ready and not os.read(stdin, 1 << 16):
            break  # end of file: the host process that started this shell died
    sys.exit(1)


def main() -> None:
    """Serve until the host closes the connection (``--listen SOCKET``: over that socket;
    else over stdin/stdout). ``--takeover``: kill every process but init first (a previous
    shell may be hung)."""
    if "--takeover" in sys.argv:  # a previous shell may be hung: make room
        kill_everything_else()
    privileges.settle()
    os.chdir(WORKSPACE if os.path.isdir(WORKSPACE) else "/")
    if privileges.PRIVILEGED:
        os.setgroups([])  # no supplementary groups reach the agent-facing file operations
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    state = State()
    ensure_launcher()  # before the first command (a fork of this shell: ~1-2 ms, once)
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
        if current_launcher() is None:  # gone with a reset, a grade or a kill -9 -1:
            ensure_launcher()  # the next command should not wait for a new one (not this reply)
