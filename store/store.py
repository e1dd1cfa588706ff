"""``Store``: the one object collector, learner and analysis use to reach the trajectory store.

Every method is one short transaction (on DuckDB: lock, open, run, close — see
``store/locking.py``). The learner's claim protocol:

1. ``claim_batch`` marks READY groups older than ``current_version - max_lag`` as
   ``dropped_stale`` (committed even when no batch is returned, so stale groups never block
   the collector's backpressure), then claims the oldest READY groups under a lease.
2. The learner trains, writes a checkpoint, and calls ``register_policy(..., claim_id=…)``,
   which inserts the policy and the learner step and marks the claimed groups ``consumed``
   in ONE transaction: a crash before it leaves the claim to be re-taken (by the same
   learner at once, by another one after the lease), a crash after it never retrains them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from sandpiper.errors import DuplicateGroupError, StoreError
from sandpiper.store import backends, leases, migrations, schema
from sandpiper.store.backends import DuckDBBackend, make_backend
from sandpiper.store.claims import claim_groups, load_episodes
from sandpiper.store.policies import PolicyVersions
from sandpiper.store.records import (
    CollectorRecord,
    Fence,
    GroupRecord,
    GroupStatus,
    LeaseRecord,
    PolicyRecord,
    RunRecord,
    SlotLease,
    Split,
    TaskRecord,
    TrainBatch,
    TrainEpisode,
    TrainGroup,
    WriteOutcome,
    WriteReport,
    utcnow,
)

if TYPE_CHECKING:
    from sandpiper.store.writer import GroupWriter, OnOutcome

T = schema


class Store:
    """A DuckDB file (``duckdb:///path``) or a PostgreSQL database (``postgresql+psycopg://``)."""

    def __init__(self, url: str, *, lock_timeout_s: float = 60.0) -> None:
        self.url = url
        self.lock_timeout_s = lock_timeout_s
        self.backend = make_backend(url, lock_timeout_s=lock_timeout_s)
        self._checked = False
        self.leases = leases.Leases(self)
        """The run's learner lease (``store/leases.py``)."""
        self.policy_versions = PolicyVersions(self)
        """Registered policy versions and learner steps (``store/policies.py``)."""

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

    # ---- runs, tasks, policies ---------------------------------------------------------

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

    # ---- policies (store/policies.py: PolicyVersions, composed as ``policy_versions``) ---

    def register_policy(
        self,
        policy: PolicyRecord,
        *,
        claim_id: str | None = None,
        metrics: dict | None = None,
        fence: Fence | None = None,
    ) -> None:
        """See :meth:`PolicyVersions.register <sandpiper.store.policies.PolicyVersions.register>`."""
        self.policy_versions.register(policy, claim_id=claim_id, metrics=metrics, fence=fence)

    def latest_policy(self, run_id: str) -> PolicyRecord | None:
        return self.policy_versions.latest(run_id)

    def policies(self, run_id: str) -> list[PolicyRecord]:
        """Every registered version of ``run_id``, oldest first."""
        return self.policy_versions.all(run_id)

    def oldest_version_in_flight(self, run_id: str) -> int | None:
        """Oldest policy version sampled by a group not consumed yet (READY or CLAIMED)."""
        return self.policy_versions.oldest_in_flight(run_id)

    # ---- learner leadership (store/leases.py: Leases, composed as ``leases``) -------------

    def acquire_lease(self, *, run_id: str, learner_id: str, lease_s: float) -> LeaseRecord:
        """Take or renew the run's learner lease; ``.held`` says whether the caller has it."""
        return self.leases.acquire(run_id=run_id, learner_id=learner_id, lease_s=lease_s)

    def renew_lease(self, fence: Fence, *, lease_s: float) -> LeaseRecord:
        return self.leases.renew(fence, lease_s=lease_s)

    def release_lease(self, fence: Fence) -> None:
        self.leases.release(fence)

    def current_lease(self, run_id: str) -> LeaseRecord | None:
        return self.leases.current(run_id)

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

    def write_groups_report(self, groups: list[GroupRecord]) -> WriteReport:
        """Commit whole groups in one transaction (Arrow bulk insert): see ``store.ingest``."""
        from sandpiper.store import ingest

        prepared = ingest.prepare(groups)  # Arrow conversion before taking the store
        with self.transaction() as conn:
            return ingest.write(conn, prepared)

    # ---- dead letters (store/dead.py): no group may stop the others ------------------------

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
        """List a group in ``dead_groups`` (again: one more attempt, the latest error)."""
        from sandpiper.store import dead

        with self.transaction() as conn:
            dead.record(
                conn, group_id=group_id, run_id=run_id, source=source, error=error,
                now=utcnow(), spool=spool, collector_id=collector_id,
            )  # fmt: skip

    def export_parquet(self, out_dir: str | Path) -> dict[str, int]:
        """Write the store as Parquet under ``out_dir`` (see ``store/export.py``); returns
        rows written per table."""
        from sandpiper.store.export import export_parquet

        return export_parquet(self.connect_readonly, out_dir)

    def dead_groups(self, run_id: str | None = None) -> list[Any]:
        """The dead letters (oldest first), as :class:`~sandpiper.store.dead.DeadGroup`."""
        from sandpiper.store import dead

        with self.connect_readonly() as conn:
            return dead.listed(conn, run_id)

    def retry_dead(
        self, *, run_id: str | None = None, group_ids: Sequence[str] | None = None
    ) -> dict[str, str]:
        """Re-submit dead letters (after a fix): a writer's group is written again from its
        spool bytes, a learner's group is made READY again. Returns group_id → outcome
        (``stored``, ``replayed``, ``ready``, or ``failed: <error>`` — still listed)."""
        from sandpiper.store import dead, spool

        wanted = [
            d for d in self.dead_groups(run_id) if group_ids is None or d.group_id in group_ids
        ]
        out: dict[str, str] = {}
        for d in wanted:
            try:
                if d.source == dead.LEARNER:
                    with self.transaction() as conn:
                        dead.give_back_to_learner(conn, d.group_id, now=utcnow())
                    out[d.group_id] = "ready"
                    continue
                with self.connect_readonly() as conn:
                    data = dead.spool_of(conn, d.group_id)
                if data is None:
                    raise StoreError("no spool bytes were kept for it")
                outcome = self.write_groups_report([spool.decode(data)]).outcomes[d.group_id]
                if outcome not in (WriteOutcome.STORED, WriteOutcome.REPLAYED):
                    raise StoreError(f"refused by the store: {outcome}")
                with self.transaction() as conn:
                    dead.remove(conn, d.group_id)
                out[d.group_id] = str(outcome)
            except Exception as e:  # stays listed with its new error; the others go on
                error = dead.short_error(e)
                self.record_dead_group(group_id=d.group_id, run_id=d.run_id, source=d.source,
                                       error=error, collector_id=d.collector_id)  # fmt: skip
                out[d.group_id] = f"failed: {error}"
        return out

    # ---- collectors and task slots (store/slots.py; docs/scaleout.md) ------------------

    def register_collector(
        self, *, run_id: str, host: str | None = None, collector_id: str | None = None
    ) -> str:
        """Register this process as a collector of ``run_id``; returns its unique id."""
        from sandpiper.store import slots

        with self.transaction() as conn:
            return slots.register(conn, run_id=run_id, host=host, collector_id=collector_id)

    def heartbeat_collector(self, collector_id: str, *, policy_version: int | None = None) -> bool:
        """Renew its heartbeat (and announce the policy version it serves or is about to
        load); False if the store holds it as stopped (or does not know it)."""
        from sandpiper.store import slots

        with self.transaction() as conn:
            return slots.heartbeat(conn, collector_id, policy_version=policy_version)

    def collector_policy_versions(self, *, run_id: str, within_s: float) -> set[int]:
        """Versions that collectors of ``run_id`` with a heartbeat younger than ``within_s``
        serve or are loading (checkpoint retention keeps them)."""
        from sandpiper.store import slots

        with self.connect_readonly() as conn:
            return slots.referenced_versions(conn, run_id=run_id, within_s=within_s)

    def stop_collector(self, collector_id: str) -> int:
        """Mark it stopped and free its leased slots at once; returns the slots freed."""
        from sandpiper.store import slots

        with self.transaction() as conn:
            return slots.stop(conn, collector_id)

    def collectors(self, run_id: str | None = None) -> list[CollectorRecord]:
        from sandpiper.store import slots

        with self.connect_readonly() as conn:
            return slots.collectors(conn, run_id=run_id)

    def collector_liveness(self, *, ttl_s: float) -> dict[str, bool]:
        """Every registered collector id -> live (heartbeat younger than ``ttl_s``, running)."""
        from sandpiper.store import slots

        with self.connect_readonly() as conn:
            return slots.liveness(conn, ttl_s=ttl_s)[1]

    def claim_slots(
        self,
        *,
        run_id: str,
        collector_id: str,
        tasks: Sequence[tuple[str, str]],
        ttl_s: float,
        n: int = 1,
        split: Split = Split.TRAIN,
        only: Sequence[str] | None = None,
    ) -> list[SlotLease]:
        """The next ``n`` task slots for this collector (``tasks``: its ``(task_id, rank)``)."""
        from sandpiper.store import slots

        with self.transaction() as conn:
            leases = slots.claim_slots(
                conn, run_id=run_id, collector_id=collector_id, tasks=tasks, split=split,
                only=only, ttl_s=ttl_s, n=n,
            )  # fmt: skip
        if not leases:  # after the commit: the heartbeat, reaping and new rounds stay
            raise StoreError(f"could not claim a task slot of run {run_id!r} (contention)")
        return leases

    def claim_slot(self, **kwargs: Any) -> SlotLease:
        """:meth:`claim_slots` with ``n=1``."""
        return self.claim_slots(n=1, **kwargs)[0]

    def release_slot(self, lease: SlotLease) -> bool:
        """Hand an unfinished slot back for re-issue; False if it was already re-issued."""
        from sandpiper.store import slots

        with self.transaction() as conn:
            return slots.release(conn, lease)

    def slot_counts(self, run_id: str) -> dict[str, int]:
        from sandpiper.store import slots

        with self.connect_readonly() as conn:
            return slots.slot_counts(conn, run_id)

    # ---- learner ---------------------------------------------------------------------------

    def claim_batch(
        self,
        *,
        run_id: str,
        learner_id: str,
        n_groups: int,
        max_lag: int,
        lease_s: float = 600.0,
        fence: Fence | None = None,
    ) -> TrainBatch | None:
        """Claim the ``n_groups`` oldest fresh READY groups, or None if fewer are available
        (stale groups are dropped, and unreadable ones set aside, even then)."""
        with self.transaction() as conn:
            return claim_groups(
                conn, run_id=run_id, learner_id=learner_id, n_groups=n_groups, max_lag=max_lag,
                lease_s=lease_s, fence=fence,
            )  # fmt: skip

    def release_claim(self, claim_id: str, *, fence: Fence | None = None) -> None:
        """Give a claim's groups back (READY) without training on them."""
        gs = T.group_states
        with self.transaction() as conn:
            if fence is not None:
                leases.check(conn, fence, skip_locked=backends.is_postgres(conn))
            conn.execute(
                sa.update(gs)
                .where(gs.c.claim_id == claim_id, gs.c.status == GroupStatus.CLAIMED.value)
                .values(
                    status=GroupStatus.READY.value,
                    claimed_by=None,
                    lease_expires_at=None,
                    updated_at=utcnow(),
                )
            )

    def group_counts(self, run_id: str) -> dict[GroupStatus, int]:
        """Train-split groups of ``run_id`` per status (every status present, 0 if none)."""
        gs, g = T.group_states, T.groups
        q = (
            sa.select(gs.c.status, sa.func.count())
            .select_from(gs.join(g, g.c.group_id == gs.c.group_id))
            .where(gs.c.run_id == run_id, g.c.split == Split.TRAIN.value)
            .group_by(gs.c.status)
        )
        with self.connect_readonly() as conn:
            found = {GroupStatus(s): int(n) for s, n in conn.execute(q)}
        return {s: found.get(s, 0) for s in GroupStatus}

    def sft_episodes(
        self, *, run_id: str | None, min_reward: float, limit: int | None = None
    ) -> list[TrainEpisode]:
        """Valid trainable episodes with ``reward >= min_reward``, oldest first."""
        e = T.episodes
        q = (
            sa.select(e.c.episode_id)
            .where(e.c.valid, e.c.trainable, e.c.reward >= min_reward)
            .order_by(e.c.started_at, e.c.episode_id)
        )
        if run_id is not None:
            q = q.where(e.c.run_id == run_id)
        if limit is not None:
            q = q.limit(limit)
        with self.connect_readonly() as conn:
            ids = list(conn.execute(q).scalars())
            by_id = {ep.episode_id: ep for ep in load_episodes(conn, episode_ids=ids)}
        return [by_id[i] for i in ids]

    def episode_ids(self, run_id: str) -> list[str]:
        e = T.episodes
        with self.connect_readonly() as conn:
            q = sa.select(e.c.episode_id).where(e.c.run_id == run_id).order_by(e.c.episode_id)
            return list(conn.execute(q).scalars())

    def group_ids(self, run_id: str, status: GroupStatus | None = None) -> list[str]:
        gs = T.group_states
        q = sa.select(gs.c.group_id).where(gs.c.run_id == run_id).order_by(gs.c.group_id)
        if status is not None:
            q = q.where(gs.c.status == status.value)
        with self.connect_readonly() as conn:
            return list(conn.execute(q).scalars())

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
