"""``Store``: the one object collector, learner and analysis use to reach the trajectory store.

It keeps the engine, the schema and its migrations, the transactions, runs and tasks, the
write path (``writer``, ``write_groups``) and the stats, and composes the rooms that hold
the rest beside their SQL, each through the Store's transactions (``backends.Connections``):
``store.slots`` (collectors and task slots, ``slots.py``), ``store.claims`` (the learner's
claims and the reads of groups by run, ``claims.py``), ``store.policy_versions``
(``policies.py``), ``store.leases`` (``leases.py``) and ``store.dead_letters`` (``dead.py``).

Every method is one short transaction (on DuckDB: lock, open, run, close — see
``store/locking.py``). The learner's claim protocol:

1. ``store.claims.claim`` marks READY groups older than ``current_version - max_lag`` as
   ``dropped_stale`` (committed even when no batch is returned, so stale groups never block
   the collector's backpressure), then claims the oldest READY groups under a lease.
2. The learner trains, writes a checkpoint, and calls
   ``store.policy_versions.register(..., claim_id=…)``, which inserts the policy and the
   learner step and marks the claimed groups ``consumed`` in ONE transaction: a crash before
   it leaves the claim to be re-taken (by the same learner at once, by another one after the
   lease), a crash after it never retrains them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from sandpiper.errors import DuplicateGroupError, StoreError
from sandpiper.store import migrations, schema
from sandpiper.store.backends import DuckDBBackend, make_backend
from sandpiper.store.claims import Claims
from sandpiper.store.dead import DeadLetters
from sandpiper.store.leases import Leases
from sandpiper.store.policies import PolicyVersions
from sandpiper.store.records import (
    GroupRecord,
    RunRecord,
    TaskRecord,
    TrainGroup,
    WriteReport,
    utcnow,
)
from sandpiper.store.slots import Slots

if TYPE_CHECKING:
    from collections.abc import Sequence

    from sandpiper.store.to_arrow import GroupRows
    from sandpiper.store.writer import GroupWriter, OnOutcome

T = schema


class Store:
    """A DuckDB file (``duckdb:///path``) or a PostgreSQL database (``postgresql+psycopg://``)."""

    def __init__(self, url: str, *, lock_timeout_s: float = 60.0) -> None:
        self.url = url
        self.lock_timeout_s = lock_timeout_s
        self.backend = make_backend(url, lock_timeout_s=lock_timeout_s)
        self._checked = False
        self.leases = Leases(self)
        """The run's learner lease (``store/leases.py``)."""
        self.policy_versions = PolicyVersions(self)
        """Registered policy versions and learner steps (``store/policies.py``)."""
        self.slots = Slots(self)
        """Collectors (registry, heartbeats) and their task slots (``store/slots.py``)."""
        self.claims = Claims(self)
        """The learner's claims; groups and episodes by run (``store/claims.py``)."""
        self.dead_letters = DeadLetters(self, write=self.write_groups_report)
        """Groups set aside, listed and retried (``store/dead.py``)."""

    @property
    def is_duckdb(self) -> bool:
        return isinstance(self.backend, DuckDBBackend)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # ---- schema ----------------------------------------------------------------------

    def init(self) -> None:
        """Create the schema if the store has none (idempotent); refuses other versions."""
        self.backend.prepare()
        with self.backend.write() as conn:
            self.backend.lock_schema(conn)
            version = migrations.read_version(conn)
            if version == 0:
                migrations.apply(conn)
            else:
                migrations.check(version, self.url)
        self._checked = True

    def migrate(self) -> list[int]:
        """Apply pending migrations in one transaction; returns the versions applied."""
        self.backend.prepare()
        with self.backend.write() as conn:
            self.backend.lock_schema(conn)
            applied = migrations.apply(conn)
        self._checked = True
        return applied

    def store_id(self) -> str:
        """A random id given to the store when it was created (labels its sandboxes)."""
        meta = schema.schema_meta
        with self.connect_readonly() as conn:
            row = conn.execute(sa.select(meta.c.value).where(meta.c.key == "store_id")).first()
        if row is None:
            raise StoreError(
                f"the store at {self.url} has no store_id; run `sandpiper store migrate`"
            )
        return str(row[0])

    def schema_version(self) -> int:
        with self.backend.read() as conn:
            return migrations.read_version(conn)

    def _check(self, conn: sa.Connection) -> None:
        if not self._checked:
            migrations.check(migrations.read_version(conn), self.url)
            self._checked = True

    @contextmanager
    def transaction(self) -> Iterator[sa.Connection]:
        """One write transaction (committed on exit, rolled back on an exception), serialised
        with every other writer of this store (the DuckDB file lock; a PostgreSQL transaction).
        The store's modules (claims, leases, collectors, ingest) write through it."""
        with self.backend.write() as conn:
            self._check(conn)
            yield conn

    @contextmanager
    def connect_readonly(self) -> Iterator[sa.Connection]:
        """A read-only SQLAlchemy connection; keep it short (it holds the DuckDB lock)."""
        with self.backend.read() as conn:
            self._check(conn)
            yield conn

    # ---- runs and tasks ---------------------------------------------------------------

    def ensure_run(self, run: RunRecord) -> None:
        """Register the run unless it exists (the first process's record stays). One
        ``INSERT … ON CONFLICT DO NOTHING``: a check-then-insert raced between collectors
        starting at once on PostgreSQL and one died with a unique violation."""
        with self.transaction() as conn:
            conn.execute(
                postgresql.insert(T.runs)
                .values(
                    run_id=run.run_id,
                    config_json=_json_value(run.config_json),
                    code_version=run.code_version,
                    created_at=run.created_at,
                )
                .on_conflict_do_nothing(index_elements=[T.runs.c.run_id])
            )

    def upsert_tasks(self, tasks: Iterable[TaskRecord]) -> None:
        """Insert or replace tasks by ``task_id``."""
        rows = [
            {
                "task_id": t.task_id,
                "source": t.source,
                "format": t.format,
                "instruction": t.instruction,
                "reference": t.reference,
                "data_uri": t.data_uri,
                "split": str(t.split),
            }
            for t in tasks
        ]
        if not rows:
            return
        # One upsert, not delete-then-insert: two collectors starting at once on PostgreSQL
        # both deleted, then the second insert hit the first one's rows.
        insert = postgresql.insert(T.tasks)
        upsert = insert.on_conflict_do_update(
            index_elements=[T.tasks.c.task_id],
            set_={c.name: insert.excluded[c.name] for c in T.tasks.c if c.name != "task_id"},
        )
        with self.transaction() as conn:
            conn.execute(upsert, rows)

    # ---- writing groups ------------------------------------------------------------------

    def writer(
        self,
        *,
        flush_interval_s: float = 1.5,
        flush_max_episodes: int = 2000,
        spool_dir: str | None = None,
        on_outcome: OnOutcome | None = None,
    ) -> GroupWriter:
        """A :class:`~sandpiper.store.writer.GroupWriter` (durable spool + background batch commits)."""
        from sandpiper.store.writer import GroupWriter

        return GroupWriter(
            self,
            flush_interval_s=flush_interval_s,
            flush_max_episodes=flush_max_episodes,
            spool_dir=spool_dir,
            on_outcome=on_outcome,
        )

    def default_spool_dir(self) -> str:
        """``<db file>.spool`` for DuckDB; a per-URL folder in ~/.cache for PostgreSQL."""
        if isinstance(self.backend, DuckDBBackend):
            return str(self.backend.path) + ".spool"
        import hashlib
        from pathlib import Path

        key = hashlib.sha1(self.url.encode()).hexdigest()[:12]
        return str(Path.home() / ".cache" / "sandpiper" / "spool" / key)

    def write_groups(self, groups: list[GroupRecord]) -> int:
        """Commit whole groups in one transaction; returns how many were newly stored.

        Episodes with unusable sampler output (non-finite logprobs or versions on sampled
        tokens) are stored invalid, see :mod:`sandpiper.store.validation`.

        Re-sending a stored group (same episodes) is a no-op; a group id stored with other
        episodes, or a group whose slot was re-issued, raises :class:`DuplicateGroupError`
        (the rest of the batch is stored). The collector's writer uses
        :meth:`write_groups_report` instead, which reports every group's outcome."""
        report = self.write_groups_report(groups)
        if report.rejected:
            raise DuplicateGroupError(_rejected_message(report))
        return report.n_stored

    def write_groups_report(self, groups: Sequence[GroupRecord | GroupRows]) -> WriteReport:
        """Commit whole groups in one transaction (Arrow bulk insert): see ``store.ingest``.
        A group is a record, or the rows the writer converted once at ``put`` and spooled
        (``to_arrow.GroupRows``, inserted as they are)."""
        from sandpiper.store import ingest

        prepared = ingest.prepare(groups)  # Arrow conversion (of records) before taking the store
        with self.transaction() as conn:
            return ingest.write(conn, prepared)

    # ---- for the writer's dead letters (store/dead.py): no group may stop the others ------

    def ping(self) -> None:
        """One tiny real write (``schema_meta['pinged_at']``): raises when the store cannot
        take writes now (down, locked past the timeout, out of disk). The writer asks this
        before setting a group aside, so that an outage never turns good groups into dead
        letters."""
        meta = T.schema_meta
        insert = postgresql.insert(meta).values(key="pinged_at", value=utcnow().isoformat())
        with self.transaction() as conn:
            conn.execute(
                insert.on_conflict_do_update(
                    index_elements=[meta.c.key], set_={"value": insert.excluded.value}
                )
            )

    def record_dead_group(
        self,
        *,
        group_id: str,
        run_id: str,
        source: str,
        error: str,
        spool: bytes | None = None,
        collector_id: str | None = None,
    ) -> None:
        """See :meth:`DeadLetters.record <sandpiper.store.dead.DeadLetters.record>` (the
        group writer's ``WriterStore`` calls it here)."""
        self.dead_letters.record(group_id=group_id, run_id=run_id, source=source, error=error,
                                 spool=spool, collector_id=collector_id)  # fmt: skip

    def export_parquet(self, out_dir: str | Path) -> dict[str, int]:
        """Write the store as Parquet under ``out_dir`` (see ``store/export.py``); returns
        rows written per table."""
        from sandpiper.store.export import export_parquet

        return export_parquet(self.connect_readonly, out_dir)

    def stats(self) -> dict[str, Any]:
        """Row counts per table, groups per status, schema version (and file size on DuckDB)."""
        out: dict[str, Any] = {"url": self.url}
        with self.connect_readonly() as conn:
            out["schema_version"] = migrations.read_version(conn)
            out["rows"] = {
                t.name: int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one())
                for t in schema.metadata.sorted_tables
            }
            gs = T.group_states
            counts = conn.execute(sa.select(gs.c.status, sa.func.count()).group_by(gs.c.status))
            out["groups_by_status"] = {s: int(n) for s, n in counts}
            out["dead_groups"] = int(
                conn.execute(sa.select(sa.func.count()).select_from(T.dead_groups)).scalar_one()
            )
        if isinstance(self.backend, DuckDBBackend):
            out["file_bytes"] = self.backend.path.stat().st_size
        return out

    def close(self) -> None:
        self.backend.dispose()


def _rejected_message(report: WriteReport) -> str:
    bad = sorted(report.rejected.items())
    shown = ", ".join(f"{g} ({o})" for g, o in bad[:5])
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return (
        f"{len(bad)} group(s) refused: {shown}{more}. 'duplicate': the id is stored with other "
        "episodes (another collector produced it); 'superseded': its task slot was re-issued "
        "after its collector's heartbeat lapsed"
    )


def _json_value(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


__all__ = ["Store", "TrainGroup"]
