"""Who the supervisor and the processes it starts are: the agent's and the grader's uids,
whether this shell runs privileged (container root in a sandbox), and the privilege drops
that hold for everything started from it.

:data:`PRIVILEGED` and :data:`LIBC` are set once by :func:`settle` at start-up; the other
modules read them as ``privileges.PRIVILEGED`` when they need them (never copy them at
import: they change after)."""

import contextlib
import ctypes
import errno
import os

AGENT_UID = 1000
"""The uid every agent command runs as (never root, never the grader)."""
GRADER_UID = 1001
"""The uid the task's tests run as at submit; no agent process ever has it."""
PRIVILEGED = False
"""True in a sandbox as container root (set by :func:`settle`); False when run outside one
(unit tests on the host), where commands run as the caller."""
INSTALL_DIR = "/.sandpiper/supervisor"
"""Where the host mounts this folder in a sandbox (``isolation.SUPERVISOR_DIR``)."""
LIBC = None
"""The C library (``setfsuid``, ``prctl``), loaded by :func:`settle` when privileged."""


def inside_sandbox() -> bool:
    """True in a sandbox container (pid 1 is catatonit, this folder mounted at
    /.sandpiper/supervisor): kill -1 is only safe there."""
    if os.path.dirname(os.path.abspath(__file__)) != INSTALL_DIR:
        return False
    try:
        with open("/proc/1/comm") as f:
            return f.read().strip() == "catatonit"
    except OSError:
        return False


def settle() -> None:
    """Decide whether this shell is privileged; if so, load libc and empty the bounding set
    before any command runs."""
    global PRIVILEGED, LIBC
    PRIVILEGED = os.geteuid() == 0 and inside_sandbox()
    if PRIVILEGED:
        LIBC = ctypes.CDLL(None, use_errno=True)
        drop_bounding_set()


@contextlib.contextmanager
def agent_fs():
    """File operations inside run with the agent's file-system uid and gid: exactly its
    rights (root's DAC capabilities leave the effective set while the fsuid is not 0)."""
    if not PRIVILEGED or LIBC is None:
        yield
        return
    LIBC.setfsgid(AGENT_UID)
    LIBC.setfsuid(AGENT_UID)
    if LIBC.setfsuid(AGENT_UID) != AGENT_UID:  # returns the current fsuid
        raise PermissionError("could not switch to the agent's file-system uid")
    try:
        yield
    finally:
        LIBC.setfsuid(0)
        LIBC.setfsgid(0)


def drop_bounding_set() -> None:
    """Empty this process's capability bounding set: no program started from here (all run
    as non-root uids) can gain a capability at exec, whatever its file capabilities. The
    supervisor keeps the capabilities it already holds."""
    pr_capbset_drop = 24
    if LIBC is None:  # loaded by settle() before any command runs
        raise OSError("libc is not loaded: cannot drop the capability bounding set")
    for cap in range(64):
        if LIBC.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            if err == errno.EINVAL:  # past the last capability this kernel knows
                return
            raise OSError(err, f"could not drop capability {cap} from the bounding set")
