"""The host's view of sandbox containers: the podman CLI (:func:`run_podman`, every call
made from a private folder), listing containers by label, removing them with what the host
kept for each (socket and cgroup folders), and the per-container registry file (which
episode and task a container serves).

Below the sandbox client, the pool (which starts and removes its own containers) and the
janitor (which judges other collectors' containers by the store's heartbeats), so none of
them imports another for these.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sandpiper.collector.sandbox import host_state
from sandpiper.errors import SandboxError

log = logging.getLogger(__name__)

COLLECTOR_LABEL = "sandpiper.collector"
STORE_LABEL = "sandpiper.store"
PURPOSE_LABEL = "sandpiper.purpose"
"""``check``: a container of ``sandpiper sandbox check`` (no collector owns it)."""
EXPIRES_LABEL = "sandpiper.expires"
"""Unix time after which a check container is an orphan: its check is over by then, done
or killed (the check bounds itself by that time)."""
REGISTRY_DIR = Path(tempfile.gettempdir()) / "sandpiper-sandboxes"
"""Host-side ``<container>.json`` files: which episode and task each container serves."""
START_TIMEOUT_S = 60.0
"""How long a sandbox's start may take (its shell's ready line, then its socket); host
state younger than twice this may belong to a container being made."""


def podman_cwd() -> str:
    """The working directory of every podman client Sandpiper starts.

    conmon 2.1 (Debian 12's, under podman 4.3) writes an empty ``oom`` marker into ITS
    working directory when a process of a ``podman exec`` session is OOM-killed, and it
    inherits the client's: an agent's memory hog left ``oom`` in whatever folder the
    collector (or ``sandpiper sandbox check``, or pytest) was started from — the user's
    checkout. This private folder takes it instead."""
    path = Path(tempfile.gettempdir()) / "sandpiper-podman"
    path.mkdir(mode=0o700, exist_ok=True)
    return str(path)


async def run_podman(*args: str, stdin: bytes | None = None, timeout_s: float = 120.0) -> bytes:
    """Run one podman CLI call; raise :class:`SandboxError` with its stderr on failure."""
    proc = await asyncio.create_subprocess_exec(
        "podman",
        *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=podman_cwd(),
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_s)
    except TimeoutError:
        await _reap(proc)
        raise SandboxError(f"podman {args[0]} timed out after {timeout_s:.0f} s") from None
    except asyncio.CancelledError:
        await _reap(proc)  # never leave a podman client running behind a cancelled task
        raise
    if proc.returncode != 0:
        raise SandboxError(f"podman {' '.join(args[:2])} failed: {err.decode()[-2000:].strip()}")
    return out


async def remove_containers_by_name(
    names: list[str], *, state_dir: str | None, attempts: int = 4
) -> None:
    """``podman rm -f``, retried (on podman 4.3 a removal racing another podman call can
    fail with "unlinkat …/userdata/shm: device or resource busy"), then what the host kept
    for each container (:func:`.host_state.forget`; ``state_dir`` is
    ``sandbox.host_state_dir``) and its registry entry. Every removal goes through here."""
    for attempt in range(attempts):
        try:
            await run_podman("rm", "-f", "-t", "0", "--ignore", *names)
            break
        except SandboxError:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.2 * 2**attempt)
    await asyncio.gather(*(host_state.forget(name, state_dir) for name in names))
    for name in names:
        remove_registry(name)


async def _reap(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
    await proc.wait()


async def sweep_stale_host_state(state_dir: str | None) -> int:
    """Remove the cgroup and socket folders (:mod:`.host_state`) and the registry entries of
    containers podman no longer has (removed by ``sandbox gc``, their collector killed, or
    their conmon outlived the removal); returns how many containers' folders went."""
    registered = _registered_names()
    if not host_state.names_on_host(state_dir) and not registered:
        return 0
    known = set((await run_podman("ps", "-a", "--format", "{{.Names}}")).decode().split())
    min_age_s = 2 * START_TIMEOUT_S  # another collector on this host may be making one
    for name in registered - known:
        with contextlib.suppress(OSError):
            if (REGISTRY_DIR / f"{name}.json").stat().st_mtime < time.time() - min_age_s:
                remove_registry(name)
    return host_state.sweep(known, min_age_s=min_age_s, state_dir=state_dir)


def _registered_names() -> set[str]:
    try:
        return {p.stem for p in REGISTRY_DIR.glob("sandpiper-*.json")}
    except OSError:
        return set()


def collector_id() -> str:
    """``hostname:pid`` of this process (the ``sandpiper.collector`` label)."""
    return f"{os.uname().nodename}:{os.getpid()}"


@dataclass(frozen=True)
class ContainerInfo:
    """One sandbox container as ``podman ps`` reports it."""

    name: str
    state: str
    created_at: str
    labels: dict[str, str]
    created_s: float = 0.0
    """Creation time, Unix seconds (0 when podman did not say)."""

    @property
    def collector(self) -> str:
        return self.labels.get(COLLECTOR_LABEL, "")


async def list_containers(filters: Mapping[str, str] | None = None) -> list[ContainerInfo]:
    """Sandbox containers (``sandpiper.managed=1``) matching all ``filters`` labels."""
    args = ["ps", "-a", "--format", "json", "--filter", "label=sandpiper.managed=1"]
    for key, value in (filters or {}).items():
        args += ["--filter", f"label={key}={value}"]
    rows = json.loads((await run_podman(*args)).decode() or "[]")
    return [
        ContainerInfo(
            name=(row.get("Names") or [row.get("Id", "")[:12]])[0],
            state=row.get("State", ""),
            created_at=str(row.get("CreatedAt", "")),
            labels=row.get("Labels") or {},
            created_s=float(row.get("Created") or 0),
        )
        for row in rows
    ]


async def remove_containers(filters: Mapping[str, str], *, state_dir: str | None) -> list[str]:
    """Remove every sandbox container matching ``filters``, and what the host kept for each
    (socket and cgroup folders, under ``state_dir``: ``sandbox.host_state_dir``); returns
    their names."""
    names = [c.name for c in await list_containers(filters)]
    if names:
        await remove_containers_by_name(names, state_dir=state_dir)
    return names


def write_registry(name: str, *, episode_id: str | None, task_id: str | None) -> None:
    path = REGISTRY_DIR / f"{name}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"episode": episode_id, "task": task_id}))
        os.replace(tmp, path)
    except OSError as e:  # informational only; never fail an episode for it
        log.debug("registry write failed: %s", e)


def remove_registry(name: str) -> None:
    with contextlib.suppress(OSError):
        (REGISTRY_DIR / f"{name}.json").unlink()


def read_registry(name: str) -> dict[str, str | None]:
    try:
        return json.loads((REGISTRY_DIR / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}
