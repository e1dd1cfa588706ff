"""List sandbox containers and remove those a crashed collector left behind.

Every container the pool starts carries ``sandpiper.managed=1`` and
``sandpiper.collector=<hostname:pid>``. A container is an orphan when its collector ran on
this host and that pid is gone (or is no longer a Python process started before it).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from collector.sandbox.podman import remove_containers_by_name, run_podman


@dataclass(frozen=True)
class ContainerInfo:
    """One sandbox container as ``podman ps`` reports it."""

    name: str
    state: str
    created_at: str
    labels: dict[str, str]

    @property
    def collector(self) -> str:
        return self.labels.get("sandpiper.collector", "")


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
        )
        for row in rows
    ]


def collector_alive(collector: str) -> bool:
    """True unless ``collector`` (hostname:pid) ran on this host and its pid is gone."""
    host, _, pid = collector.rpartition(":")
    if host != os.uname().nodename or not pid.isdigit():
        return True  # another host's collector: not ours to judge
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def remove_containers(filters: Mapping[str, str]) -> list[str]:
    """Remove every sandbox container matching ``filters``; returns their names."""
    names = [c.name for c in await list_containers(filters)]
    if names:
        await remove_containers_by_name(names)
    return names


async def gc(*, dry_run: bool = False) -> list[str]:
    """Remove the containers of collectors that are gone; returns their names."""
    orphans = [c.name for c in await list_containers() if not collector_alive(c.collector)]
    if orphans and not dry_run:
        await remove_containers_by_name(orphans)
        from collector.sandbox.pool import REGISTRY_DIR

        for name in orphans:
            (REGISTRY_DIR / f"{name}.json").unlink(missing_ok=True)
    return orphans


if __name__ == "__main__":
    print(asyncio.run(gc()))
