"""Leaving nothing of an episode: killing every process of a uid (or every process but
init and this shell), removing SysV IPC objects, wiping the writable mounts and restoring
their modes. Used by ``reset``, ``kill_all`` and the grader."""

import contextlib
import os
import shutil
import signal
import subprocess
import time

from . import privileges
from .launcher import stop_launcher
from .privileges import AGENT_UID, GRADER_UID
from .state import BASE_ENV

GRADE_DIR = "/grade"
WIPE_DIRS = ("/workspace", "/tmp", "/dev/shm", "/dev/mqueue", GRADE_DIR, "/tests", "/logs")
MOUNT_MODES = {
    "/workspace": 0o1777, "/tmp": 0o1777, "/dev/shm": 0o1777, GRADE_DIR: 0o755,
    # open-instruct's paths (/tests, /logs/verifier): the grader fills them at submit
    "/tests": 0o755, "/logs": 0o755,
}  # fmt: skip
"""Writable mount points and the owner-root mode a reset restores."""


def reap() -> None:
    """Collect every child that has ended (no zombies left behind)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def kill_everything_else() -> None:
    """SIGKILL every process this uid can signal except us and init (kill -9 -1)."""
    if not privileges.inside_sandbox():
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
    if not privileges.PRIVILEGED:
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
    if privileges.PRIVILEGED and _has_ipc(uid):
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


def reset_all() -> None:
    """Leave nothing of the episode: processes, files, IPC objects, modes of mount points."""
    kill_everything_else()
    for uid in (AGENT_UID, GRADER_UID):
        remove_ipc(uid)
    for path in WIPE_DIRS:
        wipe(path)
    if privileges.PRIVILEGED:
        for path, mode in MOUNT_MODES.items():
            with contextlib.suppress(OSError):
                os.chown(path, 0, 0)
                os.chmod(path, mode)


def wipe(path: str) -> None:
    """Remove everything inside ``path`` (the folder itself stays)."""
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
