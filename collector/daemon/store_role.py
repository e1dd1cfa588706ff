"""What the collector process needs from the store, as Protocols (the learner's is
:class:`sandpiper.trainer.learner.LearnerStore`).

:class:`CollectorStore` is what the running :class:`~sandpiper.collector.daemon.core.Collector`
calls (slots, heartbeats, counts, the latest policy, the stop): ``sandpiper.testing.FakeStore``
implements it in memory for unit tests. :class:`CollectorHostStore` adds what the process's
start-up calls once (``launch``, ``eval``, ``run_setup``): registering the run, its tasks and
the collector, the writer on its spool, the store's id and the collectors' liveness (for the
janitor). ``sandpiper.store.Store`` implements both.
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


class CollectorStore(Protocol):
    """The part of ``store.Store`` the running collector calls."""

    def claim_slots(
        self, *, run_id: str, collector_id: str, tasks: Sequence[tuple[str, str]], ttl_s: float,
        n: int = ..., split: Split, only: Sequence[str] | None = ...,
    ) -> list[SlotLease]: ...  # fmt: skip

    def heartbeat_collector(
        self, collector_id: str, *, policy_version: int | None = ...
    ) -> bool: ...

    def stop_collector(self, collector_id: str) -> int: ...

    def group_counts(self, run_id: str) -> dict[GroupStatus, int]: ...

    def latest_policy(self, run_id: str) -> PolicyRecord | None: ...


class CollectorHostStore(CollectorStore, Protocol):
    """:class:`CollectorStore` plus what the collector process's start-up calls."""

    def init(self) -> None: ...

    def ensure_run(self, run: RunRecord) -> None: ...

    def upsert_tasks(self, tasks: Iterable[TaskRecord]) -> None: ...

    def register_collector(
        self, *, run_id: str, host: str | None = ..., collector_id: str | None = ...
    ) -> str: ...

    def store_id(self) -> str: ...

    def collector_liveness(self, *, ttl_s: float) -> dict[str, bool]: ...

    def default_spool_dir(self) -> str: ...

    def writer(
        self, *, flush_interval_s: float = ..., flush_max_episodes: int = ...,
        spool_dir: str | None = ...,
        on_outcome: Callable[[GroupRecord, WriteOutcome], None] | None = ...,
    ) -> GroupWriter: ...  # fmt: skip
