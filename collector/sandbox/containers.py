"""The host's view of sandbox containers: listing them by label, removing them, and the
per-container registry file (which episode and task a container serves).

Below both the pool (which starts and removes its own containers) and the janitor (which
judges other collectors' containers by the store's heartbeats), so neither imports the other.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sandpiper.collector.sandbox.podman import remove_containers_by_name, run_podman

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


async def remove_containers(filters: Mapping[str, str]) -> list[str]:
    """Remove every sandbox container matching ``filters``, and what the host kept for each
    (socket and cgroup folders); returns their names."""
    names = [c.name for c in await list_containers(filters)]
    if names:
        await remove_containers_by_name(names)
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
