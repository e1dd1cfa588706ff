"""What the collector process needs from the store, as Protocols (the learner's is
:class:`sandpiper.trainer.store_api.LearnerStore`), named by the store's rooms.

:class:`CollectorStore` is what the running :class:`~sandpiper.collector.daemon.core.Collector`
calls: ``store.slots`` (claims, heartbeats, the stop), ``store.claims.group_counts`` and
``store.policy_versions.latest``; ``sandpiper.testing.FakeStore`` implements it in memory for
unit tests. :class:`CollectorHostStore` adds what the process's start-up calls once
(``launch``, ``eval``, ``run_setup``): registering the run, its tasks and the collector
(``store.slots.register``), the writer on its spool, the store's id and the collectors'
liveness (``store.slots.liveness``, for the janitor). ``sandpiper.store.Store`` implements
both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from sandpiper.store.records import (
    GroupRecord,
    GroupStatus,
    PolicyRecord,
    RunRecord,
    SlotLease,
    Split,
    TaskRecord,
    WriteOutcome,
)

if TYPE_CHECKING:
    from sandpiper.store.writer import GroupWriter


class CollectorSlots(Protocol):
    """The part of ``store.slots`` (``store/slots.py:Slots``) the running collector calls."""

    def claim(
        self, *, run_id: str, collector_id: str, tasks: Sequence[tuple[str, str]], ttl_s: float,
        n: int = ..., split: Split, only: Sequence[str] | None = ...,
    ) -> list[SlotLease]: ...  # fmt: skip

    def heartbeat(self, collector_id: str, *, policy_version: int | None = ...) -> bool: ...

    def stop(self, collector_id: str) -> int: ...


class HostSlots(CollectorSlots, Protocol):
    """:class:`CollectorSlots` plus what the collector process's start-up calls."""

    def register(
        self, *, run_id: str, host: str | None = ..., collector_id: str | None = ...
    ) -> str: ...

    def liveness(self, *, ttl_s: float) -> dict[str, bool]: ...


class GroupCounts(Protocol):
    """The part of ``store.claims`` (``store/claims.py:Claims``) the collector reads."""

    def group_counts(self, run_id: str) -> dict[GroupStatus, int]: ...


class LatestPolicy(Protocol):
    """The part of ``store.policy_versions`` (``store/policies.py:PolicyVersions``) the
    collector reads."""

    def latest(self, run_id: str) -> PolicyRecord | None: ...


class CollectorStore(Protocol):
    """The part of ``store.Store`` the running collector calls, by room."""

    @property
    def slots(self) -> CollectorSlots: ...

    @property
    def claims(self) -> GroupCounts: ...

    @property
    def policy_versions(self) -> LatestPolicy: ...


class CollectorHostStore(CollectorStore, Protocol):
    """:class:`CollectorStore` plus what the collector process's start-up calls."""

    @property
    def slots(self) -> HostSlots: ...

    def init(self) -> None: ...

    def ensure_run(self, run: RunRecord) -> None: ...

    def upsert_tasks(self, tasks: Iterable[TaskRecord]) -> None: ...

    def store_id(self) -> str: ...

    def default_spool_dir(self) -> str: ...

    def writer(
        self, *, flush_interval_s: float = ..., flush_max_episodes: int = ...,
        spool_dir: str | None = ...,
        on_outcome: Callable[[GroupRecord, WriteOutcome], None] | None = ...,
    ) -> GroupWriter: ...  # fmt: skip
