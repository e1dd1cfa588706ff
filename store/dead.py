"""Dead letters: a group the store cannot take, or a learner cannot read, is set aside so that
nothing else waits on it (no poison pill).

- **Writer** (``source = 'writer'``): a batch whose commit fails is split until the group
  that fails alone is found; the others are committed, that group's spool file moves to
  ``<spool>/dead/`` and into ``dead_groups.spool`` with its error (:mod:`sandpiper.store.writer`).
- **Learner** (``source = 'learner'``): a claimed group whose rows cannot be turned into
  training arrays is marked ``dead`` in ``group_states`` (never trained on) and listed here
  (:mod:`sandpiper.store.claims`).

``sandpiper store retry-dead`` re-submits them after a fix (:meth:`Store.retry_dead`). The
functions here take the caller's connection, inside its transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from sandpiper.store import schema
from sandpiper.store.records import GroupStatus

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
