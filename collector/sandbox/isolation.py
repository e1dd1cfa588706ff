"""What makes a sandbox a sandbox: the ``podman run`` flags (:func:`container_argv`, all
isolation in one place, checked by ``sandpiper sandbox check``) and what is mounted into
every container: catatonit as init, and the supervisor's folder (:func:`mounted_files`).

The supervisor holds only :data:`SUPERVISOR_CAPS` and runs the agent's commands as an
unprivileged uid with none of them (see ``supervisor/privileges.py``); no network, a
read-only root, size-capped tmpfs mounts, memory, CPU, pids and SysV IPC limits, and no
container log kept on the host.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from sandpiper.collector.sandbox import host_state
from sandpiper.collector.sandbox.host_state import SOCKET_DIR
from sandpiper.collector.sandbox.uids import UIDMAP_SIZE
from sandpiper.config import SandboxConfig

SUPERVISOR_HOST_DIR = Path(__file__).with_name("supervisor")
"""The in-container program's folder in this checkout (standard library only)."""
SUPERVISOR_DIR = "/.sandpiper/supervisor"
"""Where that folder is mounted in a sandbox (``supervisor.privileges.INSTALL_DIR``)."""
SUPERVISOR_MAIN = f"{SUPERVISOR_DIR}/__main__.py"
"""What ``python3 -I`` runs to start the supervisor (see ``supervisor/__main__.py``)."""
MOUNTED_FILES_ROOT = Path.home() / ".cache" / "sandpiper" / "sandbox-files"
"""Where :func:`mounted_files` keeps the copies that are bind-mounted into sandboxes."""
SUPERVISOR_CAPS = "CHOWN,DAC_OVERRIDE,FOWNER,KILL,SETUID,SETGID,SETPCAP"
"""Held by the supervisor (container root, an unprivileged host uid) only: it runs the
agent's commands as an unprivileged uid with none of them (see ``supervisor/privileges.py``)."""
CATATONIT = "/.sandpiper/catatonit"
IPC_SYSCTLS = {
    "kernel.shm_rmid_forced": 1,  # a segment goes with the last process attached to it
    "kernel.shmall": 4096,  # pages: 16 MiB of SysV shared memory in all
    "kernel.shmmax": 16 * 1024 * 1024,
    "kernel.msgmni": 64,  # message queues (each at most msgmnb = 16 KiB by default)
}
"""Per-container (IPC namespace) limits of SysV IPC, set at creation."""


def supervisor_files() -> dict[str, bytes]:
    """Every module of the supervisor's folder, by file name (``*.py``; no byte-code caches)."""
    return {path.name: path.read_bytes() for path in sorted(SUPERVISOR_HOST_DIR.glob("*.py"))}


def content_digest(files: Mapping[str, bytes]) -> str:
    """A hash of every file's name and bytes (a file added, removed or renamed changes it)."""
    digest = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def mounted_files() -> dict[str, Path]:
    """Host paths to bind-mount, by their path in the sandbox: the supervisor's folder.

    A copy of the checkout's folder in ``<MOUNTED_FILES_ROOT>/<content hash>/supervisor/``,
    not the checkout's own: a bind mount's source path is visible inside the container
    (``/proc/self/mountinfo``), and the checkout's path tells the agent where the project
    lives on the host and who runs it. The hash covers every file of the folder
    (:func:`content_digest`), so collectors of different versions on one host never share a
    copy; the hash's folder is made 0700 (only this user can change what every sandbox runs
    as root; the copy inside is 0755, readable by container root under any uid map), each
    file is written by temp file and rename, and checked on every call (a copy that differs
    is replaced)."""
    files = supervisor_files()
    folder = MOUNTED_FILES_ROOT / content_digest(files)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    copy = folder / SUPERVISOR_HOST_DIR.name
    copy.mkdir(mode=0o755, exist_ok=True)
    os.chmod(copy, 0o755)
    for name, data in files.items():
        path = copy / name
        try:
            same = path.read_bytes() == data
        except OSError:
            same = False
        if not same:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
    return {SUPERVISOR_DIR: copy}


def container_argv(
    config: SandboxConfig, *, name: str, labels: Mapping[str, str], uid_base: int | None
) -> list[str]:
    """The ``podman run`` arguments that make a sandbox container (all isolation flags)."""
    argv = ["run", "-d", "--name", name, "--hostname", "sandbox"]
    for key, value in labels.items():
        argv += ["--label", f"{key}={value}"]
    if uid_base is not None:
        span = f"0:{uid_base}:{UIDMAP_SIZE}"
        argv += ["--uidmap", span, "--gidmap", span]
    if (parent := host_state.cgroup_parent(name, uid_base)) is not None:
        argv += ["--cgroup-parent", parent]
    workspace_opts = f"rw,size={config.workspace_size_mb}m,mode=1777,exec,nosuid,nodev"
    argv += [
        # nothing the container's init writes is kept on the host (conmon's k8s-file log
        # grows without bound); the supervisor's replies travel over its own exec pipe
        "--log-driver=none",
        # SysV IPC outlives its processes and is charged to the container's memory: an
        # agent's segments could leave no room for the supervisor (see docs/security.md)
        *[f"--sysctl={key}={value}" for key, value in IPC_SYSCTLS.items()],
        "--network=none",
        "--cap-drop=all",
        f"--cap-add={SUPERVISOR_CAPS}",
        "--security-opt=no-new-privileges",
        "--read-only",
        "--read-only-tmpfs=false",
        "--tmpfs",
        f"/workspace:{workspace_opts}",
        "--tmpfs",
        f"/tmp:rw,size={config.tmp_size_mb}m,mode=1777,exec,nosuid,nodev",
        "--tmpfs",  # only root writes here: tests, answer, the grader's home and result
        f"/grade:rw,size={config.workspace_size_mb}m,mode=0755,exec,nosuid,nodev",
        # open-instruct's paths (its test.sh uses /tests and /logs/verifier): root-owned,
        # filled by the grader at submit (collector/sandbox/supervisor/grader.py), wiped on reset
        "--tmpfs",
        f"/tests:rw,size={config.tmp_size_mb}m,mode=0755,exec,nosuid,nodev",
        "--tmpfs",
        "/logs:rw,size=16m,mode=0755,nosuid,nodev",
        "--shm-size=16m",
        f"--memory={config.memory_mb}m",
        f"--memory-swap={config.memory_mb}m",
        f"--cpus={config.cpus}",
        f"--pids-limit={config.pids_limit}",
        "--volume",
        f"{os.path.abspath(config.catatonit_path)}:{CATATONIT}:ro",  # podman runs elsewhere
        *[
            arg
            for inside, host in mounted_files().items()
            for arg in ("--volume", f"{host}:{inside}:ro")
        ],
        "--volume",  # the shell's socket (see supervisor/server.py: listen)
        f"{host_state.socket_dir(name)}:{SOCKET_DIR}:rw",
        "--entrypoint",
        json.dumps([CATATONIT, "-P"]),
        config.image,
    ]
    return argv
