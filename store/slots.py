"""The collectors' side of the store: process registry, heartbeats and task slots.

Design and reasons: ``docs/scaleout.md``. In short:

- Every collector process registers (:func:`register`) under an id unique to the process
  (:func:`new_collector_id`) and heartbeats (:func:`heartbeat`). It is *live* while its
  ``heartbeat_at`` is younger than the heartbeat TTL (by the store's clock) and it has not
  stopped. Nothing here, nor the sandbox janitor, ever judges a collector by its pid.
- A *task slot* ``(run, task, seq)`` is one GRPO group to collect; its group id is
  ``{run}/{task}/{seq}``. :func:`claim_slots` issues the next slot to one collector: the lowest
  ``seq`` first, ties by the task's hashed rank (the least-sampled-first order of a single
  collector), free slots before new ones. When no slot is free it adds the next *round*
  (the next ``seq`` of every least-sampled task). PostgreSQL picks with ``FOR UPDATE SKIP
  LOCKED``; on DuckDB the file lock already serialises the whole transaction.
- Each issue bumps the slot's ``lease`` number; the group carries it, and
  ``Store.write_groups`` stores a group only if its slot still has that lease (then marks it
  ``done`` in the same transaction). A slot leased by a collector that is not live any more
  is freed (:func:`reap`, at every claim) and re-issued under a new lease: the late group of
  the old holder is refused as ``superseded``, never stored twice.

``Store`` composes :class:`Slots` (these functions, each in one transaction) as ``store.slots``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import socket
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from sandpiper.errors import StoreError, TaskError
from sandpiper.store import backends, schema
from sandpiper.store.records import CollectorRecord, SlotLease, Split

log = logging.getLogger(__name__)
T = schema
FREE, LEASED, DONE = "free", "leased", "done"


def default_host() -> str:
    return socket.gethostname() or os.uname().nodename


def new_collector_id(host: str | None = None) -> str:
    """``{host}:{pid}:{UTC start second}:{12 random hex}`` — unique per process, never reused
    (pids repeat across PID namespaces and over time; the random part does not)."""
    start = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    return f"{host or default_host()}:{os.getpid()}:{start}:{secrets.token_hex(6)}"


def task_rank(task_id: str, seed: int) -> str:
    """Fixed, seed-dependent tie-break order of tasks (not alphabetical)."""
    return hashlib.sha256(f"{seed}:{task_id}".encode()).hexdigest()


def db_now(conn: sa.Connection) -> datetime:
    """The store's clock: heartbeats of every host are compared on one clock."""
    now = conn.execute(sa.select(sa.func.now())).scalar_one()
    return now if now.tzinfo else now.replace(tzinfo=UTC)


# ---- registry ------------------------------------------------------------------------------


def register(
    conn: sa.Connection, *, run_id: str, host: str | None = None, collector_id: str | None = None
) -> str:
    """Insert this process's row (started and heartbeat now); returns its collector id."""
    host = host or default_host()
    cid = collector_id or new_collector_id(host)
    now = db_now(conn)
    conn.execute(
        sa.insert(T.collectors).values(
            collector_id=cid, run_id=run_id, host=host, pid=os.getpid(),
            started_at=now, heartbeat_at=now, stopped_at=None,
        )
    )  # fmt: skip
    return cid


def heartbeat(conn: sa.Connection, collector_id: str, *, policy_version: int | None = None) -> bool:
    """Renew the heartbeat, and with ``policy_version`` announce the version the collector
    serves or is about to load (None: leave it); False when the store does not know it as
    running (retired)."""
    c = T.collectors
    values: dict = {"heartbeat_at": sa.func.now()}
    if policy_version is not None:
        values["policy_version"] = policy_version
    n = conn.execute(
        sa.update(c)
        .where(c.c.collector_id == collector_id, c.c.stopped_at.is_(None))
        .values(**values)
    ).rowcount
    return n == 1


def referenced_versions(conn: sa.Connection, *, run_id: str, within_s: float) -> set[int]:
    """Policy versions announced by collectors of ``run_id`` that have not stopped and whose
    heartbeat is younger than ``within_s`` (store clock): what they serve or are loading."""
    c = T.collectors
    q = (
        sa.select(c.c.policy_version)
        .where(
            c.c.run_id == run_id,
            c.c.stopped_at.is_(None),
            c.c.policy_version.is_not(None),
            c.c.heartbeat_at >= sa.func.now() - timedelta(seconds=within_s),
        )
        .distinct()
    )
    return {int(v) for v in conn.execute(q).scalars()}


def stop(conn: sa.Connection, collector_id: str) -> int:
    """Mark the collector stopped and free the slots it still leases; returns how many."""
    c, s = T.collectors, T.task_slots
    now = db_now(conn)
    conn.execute(
        sa.update(c)
        .where(c.c.collector_id == collector_id, c.c.stopped_at.is_(None))
        .values(stopped_at=now)
    )
    return conn.execute(
        sa.update(s)
        .where(s.c.collector_id == collector_id, s.c.status == LEASED)
        .values(status=FREE)
    ).rowcount


def collectors(conn: sa.Connection, *, run_id: str | None = None) -> list[CollectorRecord]:
    c = T.collectors
    q = sa.select(c).order_by(c.c.started_at, c.c.collector_id)
    if run_id is not None:
        q = q.where(c.c.run_id == run_id)
    return [CollectorRecord(**row._mapping) for row in conn.execute(q)]


def liveness(conn: sa.Connection, *, ttl_s: float) -> tuple[datetime, dict[str, bool]]:
    """The store's clock and, for every registered collector, whether it is live."""
    c = T.collectors
    now = db_now(conn)
    rows = conn.execute(sa.select(c.c.collector_id, c.c.heartbeat_at, c.c.stopped_at)).all()
    cutoff = now - timedelta(seconds=ttl_s)
    return now, {r[0]: r[2] is None and _aware(r[1]) >= cutoff for r in rows}


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=UTC)


# ---- slots -----------------------------------------------------------------------------------


def reap(conn: sa.Connection, *, run_id: str, ttl_s: float, skip_locked: bool) -> int:
    """Free the slots of ``run_id`` leased by collectors that are not live; returns how many.

    One ``UPDATE`` on the store's clock. On PostgreSQL it skips rows another transaction has
    locked (a writer finishing that slot), so a claim never waits behind a writer's commit;
    the next claim reaps what was skipped, if it is still leased."""
    s, c = T.task_slots, T.collectors
    live = (
        sa.select(c.c.collector_id)
        .where(
            c.c.collector_id == s.c.collector_id,
            c.c.stopped_at.is_(None),
            c.c.heartbeat_at >= sa.func.now() - timedelta(seconds=ttl_s),
        )
        .exists()
    )
    dead = sa.and_(s.c.run_id == run_id, s.c.status == LEASED, ~live)
    if skip_locked:
        key = sa.tuple_(s.c.run_id, s.c.task_id, s.c.seq)
        t = s.alias("t")
        locked = (
            sa.select(t.c.run_id, t.c.task_id, t.c.seq)
            .where(
                t.c.run_id == run_id, t.c.status == LEASED,
                ~sa.select(c.c.collector_id).where(
                    c.c.collector_id == t.c.collector_id, c.c.stopped_at.is_(None),
                    c.c.heartbeat_at >= sa.func.now() - timedelta(seconds=ttl_s),
                ).exists(),
            )
            .with_for_update(skip_locked=True)
        )  # fmt: skip
        dead = key.in_(locked)
    holders = conn.execute(
        sa.update(s).where(dead).values(status=FREE).returning(s.c.collector_id)
    ).scalars()
    freed: dict[str | None, int] = {}
    for holder in holders:
        freed[holder] = freed.get(holder, 0) + 1
    if freed:  # rare: look up why, for the log
        rows = conn.execute(
            sa.select(c.c.collector_id, c.c.heartbeat_at, c.c.stopped_at, sa.func.now()).where(
                c.c.collector_id.in_([h for h in freed if h is not None])
            )
        ).all()
        why = {
            r[0]: "stopped" if r[2] else f"last heartbeat {r[1]} (store time now {r[3]})"
            for r in rows
        }
        for holder, n in freed.items():
            log.warning("re-issuing %d task slots of collector %s: %s", n, holder,
                        why.get(holder, "not registered"))  # fmt: skip
    return sum(freed.values())


def claim_slots(
    conn: sa.Connection,
    *,
    run_id: str,
    collector_id: str,
    tasks: Sequence[tuple[str, str]],
    split: Split = Split.TRAIN,
    only: Sequence[str] | None = None,
    ttl_s: float,
    n: int = 1,
) -> list[SlotLease]:
    """Issue the next ``n`` slots of ``run_id`` to ``collector_id`` in one transaction.

    ``tasks`` are ``(task_id, rank)`` of the collector's tasks of ``split`` (used to add a
    round); ``only`` restricts the pick to these task ids (a validation round)."""
    if not tasks:
        raise StoreError(f"no {split} tasks to issue slots for")
    known = {t for t, _ in tasks}
    leases: list[SlotLease] = []
    c = T.collectors
    # claiming proves the claimer alive: never reap slots issued a moment ago because
    # the heartbeat loop has not run yet (e.g. a slow start-up after registration)
    alive = conn.execute(
        sa.update(c)
        .where(c.c.collector_id == collector_id, c.c.stopped_at.is_(None))
        .values(heartbeat_at=sa.func.now())
    ).rowcount
    stopped = (
        not alive
        and conn.execute(
            sa.select(c.c.stopped_at).where(c.c.collector_id == collector_id)
        ).scalar_one_or_none()
    )
    if stopped:  # a claim left running by a stop would lease slots nobody frees until the TTL
        raise StoreError(f"collector {collector_id} is stopped: it claims no slots")
    reap(conn, run_id=run_id, ttl_s=ttl_s, skip_locked=backends.is_postgres(conn))
    for _ in range(n + 8):  # another collector may take the round we add; add another
        if len(leases) >= n:
            break
        got = _take(conn, run_id=run_id, collector_id=collector_id, split=split,
                    only=only, n=n - len(leases))  # fmt: skip
        if not got:
            _add_round(conn, run_id=run_id, split=split, tasks=tasks, only=only, n=n)
            continue
        for task_id, seq, lease, _ in sorted(got, key=lambda r: (r[1], r[3], r[0])):
            if task_id not in known:
                raise TaskError(
                    f"the store issued a slot of task {task_id!r}, which this collector "
                    f"does not have: collectors of run {run_id!r} must load the same tasks"
                )
            leases.append(SlotLease(run_id, task_id, int(seq), int(lease), collector_id))
    return leases  # empty: contention (the caller raises after the commit)


def _take(conn: sa.Connection, *, run_id: str, collector_id: str, split: Split, only, n: int):
    """Lease up to ``n`` free slots, lowest ``(seq, rank)`` first, in one ``UPDATE …
    RETURNING``; returns their ``(task_id, seq, new lease, rank)``. On PostgreSQL the pick is
    ``FOR UPDATE SKIP LOCKED``: concurrent claimers take disjoint rows and never wait."""
    s = T.task_slots
    pick = (
        sa.select(s.c.run_id, s.c.task_id, s.c.seq)
        .where(s.c.run_id == run_id, s.c.split == str(split), s.c.status == FREE)
        .order_by(s.c.seq, s.c.rank, s.c.task_id)
        .limit(n)
    )
    if only is not None:
        pick = pick.where(s.c.task_id.in_(list(only)))
    if backends.is_postgres(conn):
        pick = pick.with_for_update(skip_locked=True)
    return conn.execute(
        sa.update(s)
        .where(sa.tuple_(s.c.run_id, s.c.task_id, s.c.seq).in_(pick))
        .values(
            status=LEASED, collector_id=collector_id, lease=s.c.lease + 1,
            leased_at=sa.func.now(),
        )
        .returning(s.c.task_id, s.c.seq, s.c.lease, s.c.rank)
    ).all()  # fmt: skip


def _add_round(conn: sa.Connection, *, run_id: str, split: Split, tasks, only, n: int) -> None:
    """Insert the next round(s) of slots: ``seq`` = the lowest next seq of the wanted tasks
    (of ``only`` when given) for every task that has not reached it, and further rounds so
    that about ``4 n`` slots are free. Free slots are issued by ``(seq, rank)``, so adding
    rounds ahead does not change the order; it spares concurrent claimers from inserting
    (and waiting on) the same round at every claim."""
    s = T.task_slots
    rows = conn.execute(
        sa.select(s.c.task_id, sa.func.max(s.c.seq))
        .where(s.c.run_id == run_id, s.c.split == str(split))
        .group_by(s.c.task_id)
    ).all()
    top = {t: int(m) for t, m in rows}
    wanted = [(t, r) for t, r in tasks if only is None or t in set(only)]
    next_seq = {t: top.get(t, -1) + 1 for t, _ in wanted}
    lowest = min(next_seq.values())
    rounds = max(1, -(-4 * n // len(wanted)))
    new = [
        {"run_id": run_id, "task_id": t, "seq": seq, "split": str(split), "rank": r,
         "status": FREE, "collector_id": None, "lease": 0, "leased_at": None, "done_at": None}
        for seq in range(lowest, lowest + rounds)
        for t, r in wanted
        if next_seq[t] <= seq
    ]  # fmt: skip
    if backends.is_postgres(conn):  # PostgreSQL: collectors may add the same round at once
        conn.execute(postgresql.insert(s).on_conflict_do_nothing(), new)
    else:
        conn.execute(sa.insert(s), new)


def release(conn: sa.Connection, lease: SlotLease) -> bool:
    """Give a slot back unfinished (its group was cancelled); False if it was re-issued."""
    s = T.task_slots
    n = conn.execute(
        sa.update(s)
        .where(
            s.c.run_id == lease.run_id, s.c.task_id == lease.task_id, s.c.seq == lease.seq,
            s.c.lease == lease.lease, s.c.status == LEASED,
        )
        .values(status=FREE)
    ).rowcount  # fmt: skip
    return n == 1


def finish(conn: sa.Connection, *, run_id: str, task_id: str, seq: int, lease: int, now) -> bool:
    """Mark a slot done if it still has ``lease`` (inside ``write_groups``' transaction).

    A slot freed by :func:`reap` but not re-issued yet still accepts the group of its last
    holder (nobody else works on it)."""
    s = T.task_slots
    n = conn.execute(
        sa.update(s)
        .where(
            s.c.run_id == run_id, s.c.task_id == task_id, s.c.seq == seq,
            s.c.lease == lease, s.c.status.in_([LEASED, FREE]),
        )
        .values(status=DONE, done_at=now)
    ).rowcount  # fmt: skip
    return n == 1


def finish_many(
    conn: sa.Connection, slots: Sequence[tuple[str, str, int, int]], *, now
) -> set[tuple[str, str, int]]:
    """:func:`finish` for many ``(run_id, task_id, seq, lease)`` in one statement (PostgreSQL);
    returns the ``(run_id, task_id, seq)`` marked done.

    The rows are locked in key order first (``ORDER BY … FOR UPDATE``), as the one-by-one
    loop did, so two writers never wait on each other crosswise."""
    s = T.task_slots
    if not slots:
        return set()
    key = sa.tuple_(s.c.run_id, s.c.task_id, s.c.seq)
    t = s.alias("t")
    mine = (
        sa.select(t.c.run_id, t.c.task_id, t.c.seq)
        .where(
            sa.tuple_(t.c.run_id, t.c.task_id, t.c.seq, t.c.lease).in_(list(slots)),
            t.c.status.in_([LEASED, FREE]),
        )
        .order_by(t.c.run_id, t.c.task_id, t.c.seq)
        .with_for_update()
    )
    rows = conn.execute(
        sa.update(s)
        .where(key.in_(mine))
        .values(status=DONE, done_at=now)
        .returning(s.c.run_id, s.c.task_id, s.c.seq)
    ).all()
    return {(r, t_, int(q)) for r, t_, q in rows}


def slot_counts(conn: sa.Connection, run_id: str) -> dict[str, int]:
    """Slots of ``run_id`` per status (free, leased, done)."""
    s = T.task_slots
    rows = conn.execute(
        sa.select(s.c.status, sa.func.count()).where(s.c.run_id == run_id).group_by(s.c.status)
    ).all()
    found = {k: int(n) for k, n in rows}
    return {k: found.get(k, 0) for k in (FREE, LEASED, DONE)}


# ---- the room --------------------------------------------------------------------------------


class Slots:
    """Collectors (registry, heartbeats, announced versions) and their task slots: the
    functions above, each call in one of ``db``'s transactions. ``Store`` composes it as
    ``store.slots``."""

    def __init__(self, db: backends.Connections) -> None:
        self.db = db

    def register(
        self, *, run_id: str, host: str | None = None, collector_id: str | None = None
    ) -> str:
        """Register this process as a collector of ``run_id``; returns its unique id."""
        with self.db.transaction() as conn:
            return register(conn, run_id=run_id, host=host, collector_id=collector_id)

    def heartbeat(self, collector_id: str, *, policy_version: int | None = None) -> bool:
        """Renew its heartbeat (and announce the policy version it serves or is about to
        load); False if the store holds it as stopped (or does not know it)."""
        with self.db.transaction() as conn:
            return heartbeat(conn, collector_id, policy_version=policy_version)

    def referenced_versions(self, *, run_id: str, within_s: float) -> set[int]:
        """Versions that collectors of ``run_id`` with a heartbeat younger than ``within_s``
        serve or are loading (checkpoint retention keeps them)."""
        with self.db.connect_readonly() as conn:
            return referenced_versions(conn, run_id=run_id, within_s=within_s)

    def stop(self, collector_id: str) -> int:
        """Mark it stopped and free its leased slots at once; returns the slots freed."""
        with self.db.transaction() as conn:
            return stop(conn, collector_id)

    def collectors(self, run_id: str | None = None) -> list[CollectorRecord]:
        with self.db.connect_readonly() as conn:
            return collectors(conn, run_id=run_id)

    def liveness(self, *, ttl_s: float) -> dict[str, bool]:
        """Every registered collector id -> live (heartbeat younger than ``ttl_s``, running)."""
        with self.db.connect_readonly() as conn:
            return liveness(conn, ttl_s=ttl_s)[1]

    def claim(
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
        with self.db.transaction() as conn:
            leases = claim_slots(
                conn, run_id=run_id, collector_id=collector_id, tasks=tasks, split=split,
                only=only, ttl_s=ttl_s, n=n,
            )  # fmt: skip
        if not leases:  # after the commit: the heartbeat, reaping and new rounds stay
            raise StoreError(f"could not claim a task slot of run {run_id!r} (contention)")
        return leases

    def claim_one(
        self,
        *,
        run_id: str,
        collector_id: str,
        tasks: Sequence[tuple[str, str]],
        ttl_s: float,
        split: Split = Split.TRAIN,
        only: Sequence[str] | None = None,
    ) -> SlotLease:
        """:meth:`claim` with ``n=1``."""
        return self.claim(run_id=run_id, collector_id=collector_id, tasks=tasks, ttl_s=ttl_s,
                          n=1, split=split, only=only)[0]  # fmt: skip

    def release(self, lease: SlotLease) -> bool:
        """Hand an unfinished slot back for re-issue; False if it was already re-issued."""
        with self.db.transaction() as conn:
            return release(conn, lease)

    def counts(self, run_id: str) -> dict[str, int]:
        """Slots of ``run_id`` per status (free, leased, done)."""
        with self.db.connect_readonly() as conn:
            return slot_counts(conn, run_id)
