"""List sandbox containers and remove those that collectors which are gone left behind.

Every container a collector's pool starts carries ``sandpiper.managed=1``,
``sandpiper.collector=<registered collector id>`` (``host:pid:start:random``, unique per
process) and ``sandpiper.store=<store id>`` (the random id of the store it registered in).
Whether a container is an orphan is decided by the **store's heartbeats**, never by pids
(collectors may run in other PID namespaces — compose replicas — or on other hosts, and pids
are reused):

- labelled with another store's id: not ours to judge, kept;
- its collector is registered in this store: removed once that collector is not live
  (stopped, or its heartbeat older than ``collector.heartbeat_ttl_s`` by the store's clock);
- its collector is unknown to this store (a pool outside a collector, a store that was wiped,
  a label of an older version): removed only when the container is older than ``grace_s``;
- a container of ``sandpiper sandbox check`` (``sandpiper.purpose=check``): kept until the
  time its ``sandpiper.expires`` label names (the check bounds itself by it), then removed:
  a check killed mid-run leaves its container for minutes, not for ``grace_s``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from enum import StrEnum

from sandpiper.collector.sandbox.containers import (  # noqa: F401 (re-exported: the janitor's API)
    COLLECTOR_LABEL,
    EXPIRES_LABEL,
    PURPOSE_LABEL,
    STORE_LABEL,
    ContainerInfo,
    list_containers,
    remove_containers,
    remove_containers_by_name,
)

GRACE_S = 3600.0
"""Containers of collectors unknown to the store are kept at least this long."""


class Verdict(StrEnum):
    """What the janitor makes of one container."""

    LIVE = "live"
    """Its collector is registered and live: kept."""
    DEAD = "dead"
    """Its collector is registered and its heartbeat lapsed (or it stopped): removed."""
    UNKNOWN_YOUNG = "unknown"
    """Collector unknown to this store, container younger than the grace period: kept."""
    UNKNOWN_OLD = "unknown, old"
    """Collector unknown to this store, container older than the grace period: removed."""
    OTHER_STORE = "other store"
    """Labelled with another store: kept."""
    CHECK_RUNNING = "sandbox check"
    """A ``sandpiper sandbox check`` container before its expiry: kept."""
    CHECK_EXPIRED = "sandbox check, expired"
    """A ``sandpiper sandbox check`` container past its expiry (the check was killed): removed."""

    @property
    def orphan(self) -> bool:
        return self in (Verdict.DEAD, Verdict.UNKNOWN_OLD, Verdict.CHECK_EXPIRED)


def judge(
    container: ContainerInfo,
    *,
    store_id: str,
    live: Mapping[str, bool],
    grace_s: float,
    now_s: float | None = None,
) -> Verdict:
    """The janitor's decision for one container (see the module docstring)."""
    now = time.time() if now_s is None else now_s
    if container.labels.get(PURPOSE_LABEL) == "check" and COLLECTOR_LABEL not in container.labels:
        try:
            expires = float(container.labels.get(EXPIRES_LABEL, ""))
        except ValueError:  # an older version's check container: by its age
            expires = container.created_s + grace_s
        return Verdict.CHECK_EXPIRED if now > expires else Verdict.CHECK_RUNNING
    label_store = container.labels.get(STORE_LABEL)
    if label_store is not None and label_store != store_id:
        return Verdict.OTHER_STORE
    if container.collector in live:
        return Verdict.LIVE if live[container.collector] else Verdict.DEAD
    age_s = now - container.created_s
    return Verdict.UNKNOWN_OLD if container.created_s and age_s > grace_s else Verdict.UNKNOWN_YOUNG


async def verdicts(
    store, *, ttl_s: float, grace_s: float = GRACE_S, filters: Mapping[str, str] | None = None
) -> list[tuple[ContainerInfo, Verdict]]:
    """Every sandbox container (matching ``filters``) with the janitor's verdict."""
    store_id = await asyncio.to_thread(store.store_id)
    live = await asyncio.to_thread(store.slots.liveness, ttl_s=ttl_s)
    return [
        (c, judge(c, store_id=store_id, live=live, grace_s=grace_s))
        for c in await list_containers(filters)
    ]


async def gc(
    store,
    *,
    ttl_s: float,
    grace_s: float = GRACE_S,
    state_dir: str | None,
    filters: Mapping[str, str] | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Remove the containers of collectors that are gone (by ``store``'s heartbeats), and
    what the host kept for each under ``state_dir`` (``sandbox.host_state_dir``)."""
    judged = await verdicts(store, ttl_s=ttl_s, grace_s=grace_s, filters=filters)
    orphans = [c.name for c, v in judged if v.orphan]
    if orphans and not dry_run:
        await remove_containers_by_name(orphans, state_dir=state_dir)  # registry entries too
    return orphans
