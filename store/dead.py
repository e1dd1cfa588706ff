"""Dead letters: a group the store cannot take, or a learner cannot read, is set aside so that
nothing else waits on it (no poison pill).

- **Writer** (``source = 'writer'``): a batch whose commit fails is split until the group
  that fails alone is found; the others are committed, that group's spool file moves to
  ``<spool>/dead/`` and into ``dead_groups.spool`` with its error (:mod:`sandpiper.store.writer`).
- **Learner** (``source = 'learner'``): a claimed group whose rows cannot be turned into
  training arrays is marked ``dead`` in ``group_states`` (never trained on) and listed here
  (:mod:`sandpiper.store.claims`).

``sandpiper store retry-dead`` re-submits them after a fix (:meth:`DeadLetters.retry`). The
functions here take the caller's connection, inside its transaction; :class:`DeadLetters`
(composed as ``store.dead_letters``) runs each in one of the store's transactions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from sandpiper.errors import StoreError
from sandpiper.store import backends, schema, spool
from sandpiper.store.records import GroupRecord, GroupStatus, WriteOutcome, WriteReport, utcnow

WRITER, LEARNER = "writer", "learner"
"""Values of ``dead_groups.source``."""

MAX_ERROR_CHARS = 4_000
"""An error message is kept up to this length (a driver may quote a whole row)."""


@dataclass(frozen=True, slots=True)
class DeadGroup:
    """One row of ``dead_groups`` (without the spool bytes)."""

    group_id: str
    run_id: str
    source: str
    """``writer``: never committed (its spool file is kept); ``learner``: stored, unreadable."""
    collector_id: str | None
    error: str
    attempts: int
    created_at: datetime
    updated_at: datetime


def short_error(error: BaseException | str) -> str:
    """One line (the first) of an error, with its type, capped at :data:`MAX_ERROR_CHARS`."""
    if isinstance(error, BaseException):
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        error = f"{type(error).__name__}: {first}" if first else type(error).__name__
    return error[:MAX_ERROR_CHARS]


def record(
    conn: sa.Connection,
    *,
    group_id: str,
    run_id: str,
    source: str,
    error: str,
    now: datetime,
    spool: bytes | None = None,
    collector_id: str | None = None,
) -> None:
    """Insert the dead letter, or count one more failure of a group already listed."""
    d = schema.dead_groups
    found = conn.execute(sa.select(d.c.attempts).where(d.c.group_id == group_id)).first()
    if found is None:
        conn.execute(
            sa.insert(d).values(
                group_id=group_id, run_id=run_id, source=source, collector_id=collector_id,
                error=error, spool=spool, attempts=1, created_at=now, updated_at=now,
            )
        )  # fmt: skip
        return
    values = {"error": error, "attempts": found.attempts + 1, "updated_at": now}
    if spool is not None:
        values["spool"] = spool
    conn.execute(sa.update(d).where(d.c.group_id == group_id).values(**values))


def count(conn: sa.Connection, run_id: str | None = None) -> int:
    d = schema.dead_groups
    q = sa.select(sa.func.count()).select_from(d)
    if run_id is not None:
        q = q.where(d.c.run_id == run_id)
    return int(conn.execute(q).scalar_one())


def listed(conn: sa.Connection, run_id: str | None = None) -> list[DeadGroup]:
    d = schema.dead_groups
    cols = [c for c in d.c if c.name != "spool"]
    q = sa.select(*cols).order_by(d.c.created_at, d.c.group_id)
    if run_id is not None:
        q = q.where(d.c.run_id == run_id)
    return [DeadGroup(**row._asdict()) for row in conn.execute(q)]


def spool_of(conn: sa.Connection, group_id: str) -> bytes | None:
    d = schema.dead_groups
    return conn.execute(sa.select(d.c.spool).where(d.c.group_id == group_id)).scalar()


def remove(conn: sa.Connection, group_id: str) -> None:
    d = schema.dead_groups
    conn.execute(sa.delete(d).where(d.c.group_id == group_id))


def set_aside_unreadable(
    conn: sa.Connection, errors: dict[str, str], *, run_id: str, now: datetime
) -> None:
    """Mark the claimed groups of ``errors`` (group_id → error) ``dead`` and list them."""
    if not errors:
        return
    gs = schema.group_states
    conn.execute(
        sa.update(gs)
        .where(gs.c.group_id.in_(list(errors)))
        .values(status=GroupStatus.DEAD.value, claim_id=None, claimed_by=None,
                lease_expires_at=None, updated_at=now)
    )  # fmt: skip
    for gid, error in errors.items():
        record(conn, group_id=gid, run_id=run_id, source=LEARNER, error=error, now=now)


def give_back_to_learner(conn: sa.Connection, group_id: str, *, now: datetime) -> bool:
    """A ``learner`` dead letter made READY again (retry-dead); False if it is not dead."""
    gs = schema.group_states
    n = conn.execute(
        sa.update(gs)
        .where(gs.c.group_id == group_id, gs.c.status == GroupStatus.DEAD.value)
        .values(status=GroupStatus.READY.value, updated_at=now)
    ).rowcount
    remove(conn, group_id)
    return bool(n)


class DeadLetters:
    """The ``dead_groups`` table, each call in one of ``db``'s transactions; ``write`` commits
    groups again (the store's ``write_groups_report``). ``Store`` composes it as
    ``store.dead_letters``."""

    def __init__(
        self, db: backends.Connections, *, write: Callable[[list[GroupRecord]], WriteReport]
    ) -> None:
        self.db = db
        self.write = write

    def record(
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
        with self.db.transaction() as conn:
            record(
                conn, group_id=group_id, run_id=run_id, source=source, error=error,
                now=utcnow(), spool=spool, collector_id=collector_id,
            )  # fmt: skip

    def all(self, run_id: str | None = None) -> list[DeadGroup]:
        """The dead letters (oldest first)."""
        with self.db.connect_readonly() as conn:
            return listed(conn, run_id)

    def retry(
        self, *, run_id: str | None = None, group_ids: Sequence[str] | None = None
    ) -> dict[str, str]:
        """Re-submit dead letters (after a fix): a writer's group is written again from its
        spool bytes, a learner's group is made READY again. Returns group_id → outcome
        (``stored``, ``replayed``, ``ready``, or ``failed: <error>`` — still listed)."""
        wanted = [d for d in self.all(run_id) if group_ids is None or d.group_id in group_ids]
        out: dict[str, str] = {}
        for d in wanted:
            try:
                if d.source == LEARNER:
                    with self.db.transaction() as conn:
                        give_back_to_learner(conn, d.group_id, now=utcnow())
                    out[d.group_id] = "ready"
                    continue
                with self.db.connect_readonly() as conn:
                    data = spool_of(conn, d.group_id)
                if data is None:
                    raise StoreError("no spool bytes were kept for it")
                outcome = self.write([spool.decode(data)]).outcomes[d.group_id]
                if outcome not in (WriteOutcome.STORED, WriteOutcome.REPLAYED):
                    raise StoreError(f"refused by the store: {outcome}")
                with self.db.transaction() as conn:
                    remove(conn, d.group_id)
                out[d.group_id] = str(outcome)
            except Exception as e:  # stays listed with its new error; the others go on
                error = short_error(e)
                self.record(group_id=d.group_id, run_id=d.run_id, source=d.source,
                            error=error, collector_id=d.collector_id)  # fmt: skip
                out[d.group_id] = f"failed: {error}"
        return out
