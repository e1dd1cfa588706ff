"""Learner leadership: one lease row per run, taken atomically, renewed, fenced by a term.

``acquire`` takes the run's lease when nobody holds it or the holder's lease has expired
(store clock), incrementing ``term``; in the same transaction every group still CLAIMED in
the run goes back to READY (only a leader claims, so those claims belong to a learner that
was just deposed). ``renew`` extends the lease while the row still names the caller's term.

Every fenced write (claim, release, registration) calls :func:`check` inside its own
transaction. On PostgreSQL the lease row is read ``FOR SHARE``: a takeover (an UPDATE of
that row) waits for the write to commit, and a write that starts after a takeover sees the
new term and is refused. DuckDB's cross-process file lock serialises every writer anyway.
A deposed learner's late write therefore never lands, whatever the clocks say: the term is
the fence, the expiry only decides when a standby may take over.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import sqlalchemy as sa

from sandpiper.errors import NotLeaderError
from sandpiper.store import backends
from sandpiper.store import schema as T
from sandpiper.store.records import Fence, GroupStatus, LeaseRecord

CLAIMED, READY = GroupStatus.CLAIMED.value, GroupStatus.READY.value


def store_now(conn: sa.Connection) -> datetime:
    """The store's clock (every host compares lease times against this one clock)."""
    return conn.execute(sa.select(sa.func.now())).scalar_one()


def _row(conn: sa.Connection, run_id: str, *, lock: str | None, skip_locked: bool):
    ll = T.learner_leases
    q = sa.select(ll).where(ll.c.run_id == run_id)
    if lock and skip_locked:  # PostgreSQL only; DuckDB's file lock already serialises
        q = q.with_for_update(read=lock == "share")
    return conn.execute(q).one_or_none()


def _record(row, held: bool) -> LeaseRecord:
    return LeaseRecord(row.run_id, row.learner_id, int(row.term), row.expires_at, held)


def acquire(conn: sa.Connection, *, run_id: str, learner_id: str, lease_s: float) -> LeaseRecord:
    """Take (or keep) the lease of ``run_id``; ``held`` says whether the caller has it."""
    ll, gs = T.learner_leases, T.group_states
    pg = backends.is_postgres(conn)
    now = store_now(conn)
    expires = now + timedelta(seconds=lease_s)
    row = _row(conn, run_id, lock="update", skip_locked=pg)
    if row is None:
        values = dict(
            run_id=run_id, learner_id=learner_id, term=1, expires_at=expires, acquired_at=now
        )
        if pg:  # two first learners at once: one insert wins, the other reads its row
            from sqlalchemy.dialects.postgresql import insert

            conn.execute(insert(ll).values(**values).on_conflict_do_nothing())
        else:
            conn.execute(sa.insert(ll).values(**values))
        row = _row(conn, run_id, lock="update", skip_locked=pg)
        return _record(row, row.learner_id == learner_id)
    if row.learner_id == learner_id:  # ours already: a renewal
        conn.execute(sa.update(ll).where(ll.c.run_id == run_id).values(expires_at=expires))
        return LeaseRecord(run_id, learner_id, int(row.term), expires, True)
    if row.expires_at > now:
        return _record(row, False)
    term = int(row.term) + 1
    conn.execute(
        sa.update(ll)
        .where(ll.c.run_id == run_id, ll.c.term == row.term)
        .values(learner_id=learner_id, term=term, expires_at=expires, acquired_at=now)
    )
    # The deposed leader's claims: back to READY, to be claimed again by the new leader.
    conn.execute(
        sa.update(gs)
        .where(gs.c.run_id == run_id, gs.c.status == CLAIMED)
        .values(status=READY, claimed_by=None, lease_expires_at=None, updated_at=now)
    )
    return LeaseRecord(run_id, learner_id, term, expires, True)


def renew(conn: sa.Connection, fence: Fence, *, lease_s: float) -> LeaseRecord:
    """Extend the lease; raises :class:`NotLeaderError` if another learner took it."""
    ll = T.learner_leases
    check(conn, fence, skip_locked=backends.is_postgres(conn), lock="update")
    expires = store_now(conn) + timedelta(seconds=lease_s)
    conn.execute(sa.update(ll).where(ll.c.run_id == fence.run_id).values(expires_at=expires))
    return LeaseRecord(fence.run_id, fence.learner_id, fence.term, expires, True)


def release(conn: sa.Connection, fence: Fence) -> None:
    """Let the lease lapse now (a clean stop), so a standby takes over at once."""
    ll = T.learner_leases
    conn.execute(
        sa.update(ll)
        .where(
            ll.c.run_id == fence.run_id,
            ll.c.learner_id == fence.learner_id,
            ll.c.term == fence.term,
        )
        .values(expires_at=store_now(conn))
    )


def current(conn: sa.Connection, run_id: str) -> LeaseRecord | None:
    row = _row(conn, run_id, lock=None, skip_locked=False)
    return None if row is None else _record(row, False)


def check(conn: sa.Connection, fence: Fence, *, skip_locked: bool, lock: str = "share") -> None:
    """Refuse the caller's transaction unless ``fence`` is the run's current term."""
    row = _row(conn, fence.run_id, lock=lock, skip_locked=skip_locked)
    if row is None or row.learner_id != fence.learner_id or int(row.term) != fence.term:
        holder = "nobody" if row is None else f"learner {row.learner_id} (term {row.term})"
        raise NotLeaderError(
            f"learner {fence.learner_id} is no longer in charge of run {fence.run_id}: its "
            f"term {fence.term} was superseded, {holder} holds the lease now; its write "
            "was refused and it must stop"
        )


class Leases:
    """The run's learner lease (the functions above), each call in one of ``db``'s
    transactions. ``Store`` composes it as ``store.leases``."""

    def __init__(self, db: backends.Connections) -> None:
        self.db = db

    def acquire(self, *, run_id: str, learner_id: str, lease_s: float) -> LeaseRecord:
        """Take or renew the run's learner lease; ``.held`` says whether the caller has it."""
        with self.db.transaction() as conn:
            return acquire(conn, run_id=run_id, learner_id=learner_id, lease_s=lease_s)

    def renew(self, fence: Fence, *, lease_s: float) -> LeaseRecord:
        with self.db.transaction() as conn:
            return renew(conn, fence, lease_s=lease_s)

    def release(self, fence: Fence) -> None:
        with self.db.transaction() as conn:
            release(conn, fence)

    def current(self, run_id: str) -> LeaseRecord | None:
        with self.db.connect_readonly() as conn:
            return current(conn, run_id)
