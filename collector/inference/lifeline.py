"""Children that die with their parent: a small wrapper that holds a lifeline to the parent.

A collector starts long-lived children (its vLLM servers) in a session of their own, so that
it can stop each one with everything that child started (vLLM's engine-core process, its
workers) by one process-group signal. A session of their own also means they outlive a
collector killed with SIGKILL: the server keeps its port, its memory and its CPU threads,
with nobody left to stop it. :func:`wrap` prevents that::

    argv, fds = lifeline.wrap(["python", "-m", "vllm...", ...])
    subprocess.Popen(argv, pass_fds=fds, start_new_session=True)

runs ``python -I lifeline.py FD -- python -m vllm...``: this file, run as a script (standard
library only), starts the real command as its child in its own process group and waits for
either of two things:

- the child exits: the wrapper exits the same way (same exit status, or killed by the same
  signal), so the caller's ``Popen.poll()`` reads the child's outcome;
- the lifeline breaks: ``FD`` is the read end of a pipe whose write end only the parent
  holds (never inherited: it is close-on-exec and passed to nobody). The kernel closes it when
  the parent process dies, however it dies, and the wrapper then reads end-of-file. It sends
  SIGTERM to its process group, gives the child :data:`GRACE_S` to stop, and SIGKILLs the
  group and every other descendant that is left.

Why a pipe and not only ``PR_SET_PDEATHSIG``: the death signal fires when the *thread* that
forked the child exits, not the process, and the collector starts its servers from worker
threads (``asyncio.to_thread``); a pipe's write end belongs to the process. The wrapper is
itself a subreaper (``PR_SET_CHILD_SUBREAPER``), so a grandchild that leaves the group
(``setsid``) and is orphaned is re-parented to it and still found by the final sweep; and
the child gets ``PR_SET_PDEATHSIG = SIGKILL`` with the wrapper's single thread as parent, so
a wrapper killed outright takes the child along.

With ``private_tmp`` the child gets a temporary folder of its own (``TMPDIR``), which the
wrapper removes once the child and its group are gone, however the parent died (the owner
removes it with :func:`remove_private_tmp` when it SIGKILLs the wrapper itself): vLLM leaves
its ZeroMQ sockets and its ``vllm_dist_*`` rendezvous file in ``TMPDIR`` and never removes
them (three sockets and a file per server start, in ``/tmp`` otherwise). Torch's kernel cache
stays shared: torch compiles into ``<temp folder>/torchinductor_<user>`` (its precompiled
headers always there, ``TORCHINDUCTOR_CACHE_DIR`` or not), so that name in the private folder
is a link to the shared one; a private copy made every vLLM start compile again with g++.

Signals sent to the wrapper alone (SIGTERM, SIGINT, SIGHUP) are passed on to the child.
Limits: a descendant that leaves the group *and* double-forks before the wrapper sees it is
re-parented to the wrapper (subreaper) and swept; one that moves to another PID namespace
or is started by another service (podman's conmon) is not a descendant and is not touched.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GRACE_S = 5.0
"""After the lifeline breaks: how long the child may take to stop on SIGTERM before the
whole group is SIGKILLed."""

PRIVATE_TMP = "--private-tmp"
"""The wrapper's option (before ``--``) that gives the child a ``TMPDIR`` of its own."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_pipe: tuple[int, int, int] | None = None
"""(owner pid, read end, write end) of this process's lifeline pipe."""
_lock = threading.Lock()


def _lifeline_fd() -> int:
    """The read end of this process's lifeline pipe. Made once per process (a forked child
    makes its own, so its children live as long as it, not as long as its parent); the write
    end stays open, close-on-exec (PEP 446) and passed to nobody, until the process dies."""
    global _pipe
    with _lock:
        if _pipe is None or _pipe[0] != os.getpid():
            _pipe = (os.getpid(), *os.pipe())
        return _pipe[1]


def wrap(argv: list[str], *, private_tmp: bool = False) -> tuple[list[str], tuple[int, ...]]:
    """``argv`` run under the lifeline wrapper, and the file descriptors ``Popen`` must pass
    (``pass_fds``). Start it with ``start_new_session=True``: the wrapper is then the leader
    of the group that :func:`os.killpg` on its pid reaches. ``private_tmp``: the child's
    ``TMPDIR`` is a new folder, removed when the child is gone (see the module docstring)."""
    fd = _lifeline_fd()
    wrapper = [sys.executable, "-I", str(Path(__file__).resolve()), str(fd)]
    if private_tmp:
        wrapper.append(PRIVATE_TMP)
    return [*wrapper, "--", *argv], (fd,)


def wrapped_command(cmdline: list[str]) -> list[str] | None:
    """The command a lifeline wrapper runs, from the wrapper's command line (None when
    ``cmdline`` is not a wrapper's)."""
    try:
        sep = cmdline.index("--")
    except ValueError:
        return None
    if not any(Path(arg).name == Path(__file__).name for arg in cmdline[1:sep]):
        return None
    return cmdline[sep + 1 :]


# ---- the wrapper process --------------------------------------------------------------------


def _prctl(option: int, value: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def _child_setup(wrapper_pid: int) -> None:
    """In the child, before exec: die with the wrapper (whose only thread forked it)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != wrapper_pid:  # the wrapper died before the line above took effect
        os._exit(137)


def _descendants(root: int) -> list[int]:
    """Pids whose parent chain leads to ``root`` (read from /proc; racy by nature, so the
    sweep below runs it more than once)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: fields start after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        parent[int(entry)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parent.items() if pp == pid]
        found += kids
        frontier += kids
    return found


def _sweep() -> None:
    """SIGKILL the group and every descendant, until none is left (bounded)."""
    me = os.getpid()
    deadline = time.monotonic() + GRACE_S
    while True:
        left = _descendants(me)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # reap (we are their subreaper)
                pass
        except ChildProcessError:
            pass
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _scratch_prefix(wrapper_pid: int) -> str:
    return f"sandpiper-tmp-{wrapper_pid}-"


SOCKET_PATH_MAX = 107
"""Longest path of a Unix socket (``sun_path`` holds 108 bytes with its NUL)."""


def _scratch_base() -> str:
    """Where private ``TMPDIR`` folders go: the temp folder, or ``/tmp`` when it is so long
    that a socket in the folder (vLLM names them by a 36-character uuid) would not fit."""
    base = tempfile.gettempdir()
    longest = len(base) + len(_scratch_prefix(2**22)) + 8 + 1 + 36
    return base if longest <= SOCKET_PATH_MAX else "/tmp"


def _inductor_cache_name() -> str:
    """The name of torch's kernel cache folder in the temp folder (the rule of torch's
    ``default_cache_dir``)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)


def _make_private_tmp(wrapper_pid: int) -> str:
    """A new private ``TMPDIR`` whose kernel cache name links to the shared cache."""
    shared = os.path.join(tempfile.gettempdir(), _inductor_cache_name())
    scratch = tempfile.mkdtemp(prefix=_scratch_prefix(wrapper_pid), dir=_scratch_base())
    with contextlib.suppress(OSError):  # no shared cache: the child compiles into its own
        os.makedirs(shared, exist_ok=True)
        os.symlink(shared, os.path.join(scratch, _inductor_cache_name()))
    return scratch


def runs(pid: int) -> bool:
    """Whether process ``pid`` still runs: it exists and is not a zombie (a killed child
    whose parent has not reaped it yet holds no port, socket or memory any more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] != "Z"


def remove_private_tmp(wrapper_pid: int) -> None:
    """Remove the private ``TMPDIR`` of a wrapper that is gone. The wrapper removes it itself
    unless it was SIGKILLed (a group kill by its owner); the owner calls this afterwards.
    Nothing is removed while a process with that pid runs (a recycled pid's own folder)."""
    if runs(wrapper_pid):
        return
    for path in Path(_scratch_base()).glob(_scratch_prefix(wrapper_pid) + "*"):
        shutil.rmtree(path, ignore_errors=True)


def _remove_scratch(scratch: str | None) -> None:
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


def _on_lifeline_broken(child: subprocess.Popen, scratch: str | None) -> None:
    """The parent died: ask the child to stop (it stops what it started), give it
    :data:`GRACE_S`, then SIGKILL every descendant and the group, and exit."""
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while child.returncode is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the main thread's wait() sets returncode
    _sweep()
    _remove_scratch(scratch)
    try:
        os.killpg(os.getpgid(0), signal.SIGKILL)  # any group member not found above; us too
    finally:
        os._exit(137)


def main(args: list[str]) -> int:
    fd_arg, *rest = args or [""]
    private_tmp = rest[:1] == [PRIVATE_TMP]
    rest = rest[1:] if private_tmp else rest
    if not fd_arg.isdigit() or len(rest) < 2 or rest[0] != "--":
        sys.stderr.write(f"usage: lifeline.py FD [{PRIVATE_TMP}] -- COMMAND [ARG ...]\n")
        return 2
    fd = int(fd_arg)
    with contextlib.suppress(OSError):  # an old kernel: orphans that left the group are
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # not found by the final sweep
    me = os.getpid()
    scratch = _make_private_tmp(me) if private_tmp else None
    env = None if scratch is None else {**os.environ, "TMPDIR": scratch}
    child = subprocess.Popen(rest[1:], env=env, preexec_fn=lambda: _child_setup(me))

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for sig in _FORWARDED:
        signal.signal(sig, forward)

    def watch() -> None:
        try:
            while os.read(fd, 4096):  # nobody writes: this returns only at end-of-file
                pass
        except OSError:
            pass
        _on_lifeline_broken(child, scratch)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()
    code = child.wait()
    _sweep()  # what the child left behind: its group goes with it
    _remove_scratch(scratch)
    if code < 0:  # die of the same signal, so the parent's Popen reads the same status
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be handled
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
