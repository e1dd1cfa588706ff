"""What the host keeps for each sandbox container besides the container itself: its own
top-level cgroup folders and the folder of its shell's Unix socket.

Both are made before ``podman run`` and must go with the container. Every removal goes
through ``podman.remove_containers_by_name``, which calls :func:`forget`; what a crashed
collector left behind goes at the next pool start (``containers.sweep_stale_host_state``, which
asks podman which containers still exist and calls :func:`sweep`). This module only touches
the host's file systems; it never calls podman.

``state_dir`` (``sandbox.host_state_dir``) is where the socket folders live when the
collector runs in a container and drives the host's podman: a folder at the same path inside
and outside, since podman resolves bind sources on its own machine. None = this machine's
temp folder. Every caller passes the configured value (there is no default, so no call can
silently pick a folder podman cannot see).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_V1_ROOT = Path("/sys/fs/cgroup")
PODMAN_V1_PARENT = CGROUP_V1_ROOT / "cpu" / "libpod_parent"
SOCKET_DIR = "/.sandpiper/sock"
"""Where a container sees its host folder of :func:`socket_dir` (mode 0700, container root's)."""
SOCKET_NAME = "s"
MAX_SOCKET_ROOT_CHARS = 48
"""Longest temp folder used for sockets: + ``/sandpiper-sockets/sandpiper-<12 hex>/s`` (43)."""


def cgroup_parent(name: str, uid_base: int | None, state_dir: str | None) -> str | None:
    """A top-level cgroup of its own for container ``name`` (root podman on cgroup v1), or
    None to leave podman's default. Always None under a ``state_dir``: the collector then
    runs in a container whose ``/sys/fs/cgroup`` is its own, not the tree podman places
    sandboxes in, so it cannot make or weigh their cgroups.

    Why: podman's default parent, ``libpod_parent``, is ONE sibling of every process of the
    host's root cgroup with the default weight (``cpu.shares`` 1024). Under load all the
    sandboxes together got the CPU share of a single host process: with the bench's own 16
    ``podman exec`` clients and event loop runnable, 16 busy sandboxes shared ~1/18 of the
    CPU, which was the shell's tail at 16 sandboxes (and with 40 runnable host processes
    from other work, the whole pool ran ~21 commands/s at any concurrency). Each container
    in its own top-level cgroup weighs a fixed share, :data:`SANDBOX_CPU_SHARES`.
    """
    if state_dir is not None or uid_base is None or not PODMAN_V1_PARENT.is_dir():
        return None  # rootless/systemd/cgroup v2: podman's own placement, weights per unit
    return f"/{name}"


SANDBOX_CPU_SHARES = 256
"""``cpu.shares`` of each sandbox's top-level cgroup: a quarter of a host process's (1024).

Why below a host process: every command of every sandbox passes through one host process,
the collector (its event loop sends the command and reads the reply), and through vLLM's
for the next turn. Weighing each sandbox like a host process gave that one process
1/(N+1) of the CPU when N sandboxes were busy, however much it had to do for them. With
16 sandboxes in ``bench/sandbox_bench.py`` the p99 a command adds over bare ``bash`` fell
from 11.5–57.5 ms (1024) to 11.8–17.0 ms (256), and a busy host process against four
sandboxes burning both cores got 0.98 of a core instead of 0.43. Between sandboxes nothing
changes (all weigh the same), and with the host idle they get all the CPU, as before; a
host running its own busy work (a learner, vLLM on CPU) now gets more of the CPU than the
agents' commands when the two compete (docs/sandbox.md, CPU weight)."""


def make_cgroup_parent(name: str, uid_base: int | None, state_dir: str | None) -> None:
    """Create the ``cpu`` folder of :func:`cgroup_parent` with :data:`SANDBOX_CPU_SHARES`
    (``podman run`` uses an existing parent as it is; its own ``--cpu-shares`` would set
    the container's cgroup, the only child of this one, where a weight changes nothing)."""
    if cgroup_parent(name, uid_base, state_dir) is None:
        return
    path = CGROUP_V1_ROOT / "cpu" / name
    try:
        path.mkdir(exist_ok=True)
        (path / "cpu.shares").write_text(str(SANDBOX_CPU_SHARES))
    except OSError as e:  # podman makes the folder itself, at the default weight
        log.warning("cannot set the CPU weight of sandbox %s (%s): it weighs 1024", name, e)


def remove_cgroup_parent(name: str) -> bool:
    """Remove the (empty) cgroup folders of :func:`cgroup_parent` in every controller;
    True while some are left (a cgroup with processes cannot be removed). Safe against
    another collector on this host removing the same folders at the same time (two pool
    starts sweep together; a folder can go between listing and removal)."""
    left = False
    if not PODMAN_V1_PARENT.is_dir():
        return False
    for controller in CGROUP_V1_ROOT.iterdir():
        top = controller / name
        try:
            subs = sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True)
        except FileNotFoundError:
            continue  # not there, or removed meanwhile by another collector's sweep
        for sub in subs:
            with contextlib.suppress(OSError):
                sub.rmdir()
        try:
            top.rmdir()
        except FileNotFoundError:
            pass  # gone: another collector on this host removed it first
        except OSError:
            left = True
    return left


def socket_root(state_dir: str | None) -> Path:
    """The host folder holding one folder per container for its shell's socket:
    ``<state_dir>/sockets``, else under the temp folder, or ``/tmp`` when ``TMPDIR`` is so
    long that the socket's path would pass the 107 bytes a Unix socket address holds
    (``state_dir``'s length is bounded by its config field)."""
    if state_dir is not None:
        return Path(state_dir) / "sockets"
    tmp = Path(tempfile.gettempdir())
    if len(str(tmp)) > MAX_SOCKET_ROOT_CHARS:
        tmp = Path("/tmp")
    return tmp / "sandpiper-sockets"


def socket_dir(name: str, state_dir: str | None) -> Path:
    """Container ``name``'s socket folder on the host."""
    return socket_root(state_dir) / name


def make_socket_dir(name: str, uid_base: int | None, state_dir: str | None) -> Path:
    """Create :func:`socket_dir` owned by the container's root (host uid ``uid_base``), mode
    0700: its shell can bind there, no agent uid of the container can enter it."""
    socket_root(state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    path = socket_dir(name, state_dir)
    path.mkdir(mode=0o700)
    if uid_base is not None:
        os.chown(path, uid_base, uid_base)
    return path


async def forget(name: str, state_dir: str | None) -> None:
    """Remove what the host holds for the removed container ``name``: its socket folder and
    its cgroup folders (waiting up to 3 s for its conmon, which may outlive the removal for
    a moment; what is left then goes at the next :func:`sweep`)."""
    shutil.rmtree(socket_dir(name, state_dir), ignore_errors=True)
    for _ in range(30):
        if not remove_cgroup_parent(name):
            return
        await asyncio.sleep(0.1)
    log.warning("cgroup /%s is still in use; left in place", name)


def names_on_host(state_dir: str | None) -> set[str]:
    """The containers this host keeps cgroup or socket folders for."""
    names = set()
    if PODMAN_V1_PARENT.is_dir():
        names = {p.name for p in CGROUP_V1_ROOT.glob("*/sandpiper-*") if p.is_dir()}
    sockets = socket_root(state_dir)
    if sockets.is_dir():
        names |= {p.name for p in sockets.iterdir() if p.name.startswith("sandpiper-")}
    return names


def sweep(known: set[str], *, min_age_s: float, state_dir: str | None) -> int:
    """Remove the folders of every container not in ``known`` (those podman still has);
    returns how many. Only empty cgroups can be removed, so a live container's never is; a
    container whose socket folder is younger than ``min_age_s`` is left whole, since another
    collector on this host makes its container's folders before ``podman ps`` lists it."""
    removed = 0
    old = time.time() - min_age_s
    for name in sorted(names_on_host(state_dir) - known):
        path = socket_dir(name, state_dir)
        try:
            if path.stat().st_mtime >= old:
                continue  # being made (its socket folder comes first, then its cgroup's)
        except FileNotFoundError:
            pass  # no socket folder (or another collector's sweep removed it just now)
        left = remove_cgroup_parent(name)
        shutil.rmtree(path, ignore_errors=True)
        removed += not left
    return removed
