"""What makes a sandbox a sandbox: the ``podman run`` flags (:func:`container_argv`, all
isolation in one place, checked by ``sandpiper sandbox check``) and what is mounted into
every container: catatonit as init, and the supervisor's folder (:func:`mounted_files`).

Every bind source is a path on the machine whose podman runs the container; under
``sandbox.host_state_dir`` (a collector in a container driving the host's podman) all of them
are copies in that folder, which has the same path on both sides (:func:`files_root`).

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
"""Where :func:`mounted_files` keeps the copies that are bind-mounted into sandboxes
(without a ``sandbox.host_state_dir``; see :func:`files_root`)."""
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


def files_root(config: SandboxConfig) -> Path:
    """Where the bind-mounted copies live: ``<host_state_dir>/sandbox-files``, or
    :data:`MOUNTED_FILES_ROOT` on the podman host itself."""
    if config.host_state_dir is not None:
        return Path(config.host_state_dir) / "sandbox-files"
    return MOUNTED_FILES_ROOT


def _install(folder: Path, name: str, data: bytes, mode: int) -> Path:
    """``folder/name`` holding ``data`` with ``mode``, written by temp file and rename when
    missing or different (several collectors may install the same copy at once)."""
    path = folder / name
    try:
        same = path.read_bytes() == data and (path.stat().st_mode & 0o777) == mode
    except OSError:
        same = False
    if not same:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    return path


def _private_folder(root: Path, digest: str) -> Path:
    folder = root / digest
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def catatonit_source(config: SandboxConfig) -> str:
    """The bind source of the container's init: ``catatonit_path`` itself on the podman
    host, else a copy of it (read here) in ``<files_root>/<its hash>/catatonit``."""
    if config.host_state_dir is None:
        return os.path.abspath(config.catatonit_path)  # podman's working folder is elsewhere
    data = Path(config.catatonit_path).read_bytes()
    folder = _private_folder(files_root(config), content_digest({"catatonit": data}))
    return str(_install(folder, "catatonit", data, 0o755))


def mounted_files(root: Path | None = None) -> dict[str, Path]:
    """Host paths to bind-mount, by their path in the sandbox: the supervisor's folder, in
    ``root`` (:func:`files_root`; None = :data:`MOUNTED_FILES_ROOT`).

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
    folder = _private_folder(MOUNTED_FILES_ROOT if root is None else root, content_digest(files))
    copy = folder / SUPERVISOR_HOST_DIR.name
    copy.mkdir(mode=0o755, exist_ok=True)
    os.chmod(copy, 0o755)
    for name, data in files.items():
        _install(copy, name, data, 0o644)
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
    state_dir = config.host_state_dir
    if (parent := host_state.cgroup_parent(name, uid_base, state_dir)) is not None:
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
        f"{catatonit_source(config)}:{CATATONIT}:ro",
        *[
            arg
            for inside, host in mounted_files(files_root(config)).items()
            for arg in ("--volume", f"{host}:{inside}:ro")
        ],
        "--volume",  # the shell's socket (see supervisor/server.py: listen)
        f"{host_state.socket_dir(name, state_dir)}:{SOCKET_DIR}:rw",
        "--entrypoint",
        json.dumps([CATATONIT, "-P"]),
        config.image,
    ]
    return argv
