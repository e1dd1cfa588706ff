"""``Store.write_groups_report``: store whole groups, one outcome per group, nothing silent.

In one transaction:

1. Groups whose id is already stored: the same episode ids (a re-send of the same group,
   e.g. the writer replaying its spool after a crash between commit and spool cleanup) are
   ``replayed``; other episode ids are ``superseded`` when the group's slot lease is not the
   slot's current one (the slot's next holder stored it), else a ``duplicate`` (another
   producer used the id).
2. Groups from a task slot (``slot_lease`` set): the slot is marked done if it still has
   that lease; otherwise the group is ``superseded`` (the slot was re-issued to another
   collector after this one's heartbeat lapsed) and not stored.
3. The rest is bulk-inserted (Arrow; COPY on PostgreSQL) and reported ``stored``.

Two groups with one id in the same call count as one group when their episodes agree, else
both are refused as duplicates.

A group comes as a record (converted here with the rest of its batch, checked on the
converted buffers: ``to_arrow.checked_tables``) or as the rows the writer converted and
checked once at ``put`` and spooled (``to_arrow.GroupRows``: inserted as they are, whether
from memory or read back after a restart).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime

import pyarrow as pa
import sqlalchemy as sa

from sandpiper.store import backends, schema, slots, to_arrow
from sandpiper.store.records import GroupRecord, WriteOutcome, WriteReport, utcnow

log = logging.getLogger(__name__)

CHUNK = 1000
"""Ids per IN list."""


def _chunks(ids: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(ids), CHUNK):
        yield ids[i : i + CHUNK]


def _stored_episodes(conn: sa.Connection, ids: list[str]) -> dict[str, frozenset[str]]:
    """For the ids among ``ids`` that are stored: their episode ids."""
    g, e = schema.groups, schema.episodes
    found: dict[str, set[str]] = {}
    for part in _chunks(ids):
        for (gid,) in conn.execute(sa.select(g.c.group_id).where(g.c.group_id.in_(part))):
            found[gid] = set()
    hits = list(found)
    for part in _chunks(hits):
        q = sa.select(e.c.group_id, e.c.episode_id).where(e.c.group_id.in_(part))
        for gid, eid in conn.execute(q):
            found[gid].add(eid)
    return {k: frozenset(v) for k, v in found.items()}


def _slot_seq(g: Item) -> int:
    head, _, seq = g.group_id.rpartition("/")
    if head != f"{g.run_id}/{g.task_id}" or not seq.isdigit():
        raise ValueError(f"group {g.group_id!r} has a slot lease but is not a slot's id")
    return int(seq)


def _lease(conn: sa.Connection, g: Item) -> int | None:
    s = schema.task_slots
    return conn.execute(
        sa.select(s.c.lease).where(
            s.c.run_id == g.run_id, s.c.task_id == g.task_id, s.c.seq == _slot_seq(g)
        )
    ).scalar()


def _finish_slots(conn: sa.Connection, groups: list[Item], now: datetime) -> set[str]:
    """Mark the slots of ``groups`` done where they still have the group's lease; returns
    the group ids whose slot was. PostgreSQL: one statement for all (a round trip per group
    was most of a commit's statements); DuckDB: one by one, under the file lock."""
    leased = [(g, g.slot_lease) for g in groups if g.slot_lease is not None]
    if backends.is_postgres(conn):
        done = slots.finish_many(
            conn, [(g.run_id, g.task_id, _slot_seq(g), lease) for g, lease in leased], now=now
        )
        return {g.group_id for g, _ in leased if (g.run_id, g.task_id, _slot_seq(g)) in done}
    return {
        g.group_id
        for g, lease in leased
        if slots.finish(
            conn, run_id=g.run_id, task_id=g.task_id, seq=_slot_seq(g), lease=lease, now=now
        )
    }


Item = GroupRecord | to_arrow.GroupRows
"""What a commit takes: groups as records (converted here, as one batch) or as the rows the
writer made at ``put`` and spooled (inserted as they are)."""


def _episode_ids(g: Item) -> frozenset[str]:
    if isinstance(g, to_arrow.GroupRows):
        return g.episode_ids
    return frozenset(e.episode_id for e in g.episodes)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A batch made ready for :func:`write` outside the store's transaction (on DuckDB that
    takes a file lock every reader and the learner's claim wait on)."""

    batch: dict[str, Item]
    """group_id -> the group (the first of two with one id and the same episodes)."""
    refused: dict[str, WriteOutcome]
    """Groups refused before the store is asked (one id handed in with other episodes)."""
    tables: dict[str, pa.Table] | None
    """Arrow rows of the candidates (episodes of unusable sampler output made invalid)."""
    now: datetime


def _tables(candidates: list[Item], now: datetime) -> dict[str, pa.Table]:
    """The rows of ``candidates``: records converted and checked in one batch
    (``to_arrow.checked_tables``); rows, already checked at ``put``, as they are."""
    parts = [g.tables for g in candidates if isinstance(g, to_arrow.GroupRows)]
    records = [g for g in candidates if not isinstance(g, to_arrow.GroupRows)]
    if records:
        tables, _ = to_arrow.checked_tables(records, now)
        if not parts:
            return tables
        parts.append(tables)
    return to_arrow.join_tables(parts, now)


def prepare(groups: Sequence[Item]) -> Prepared:
    outcomes: dict[str, WriteOutcome] = {}
    batch: dict[str, Item] = {}
    # (check_group leaves episode ids as they are: the checks below need no validated copy)
    for g in groups:
        first = batch.get(g.group_id)
        if first is None:
            batch[g.group_id] = g
        elif _episode_ids(first) != _episode_ids(g):
            log.error("group %s handed in twice with different episodes", g.group_id)
            outcomes[g.group_id] = WriteOutcome.DUPLICATE  # refused below too
    now = utcnow()
    candidates = [g for gid, g in batch.items() if gid not in outcomes]
    tables = _tables(candidates, now) if candidates else None
    return Prepared(batch, outcomes, tables, now)


def write(conn: sa.Connection, prepared: Prepared) -> WriteReport:
    """Store the groups of ``prepared`` in the caller's transaction (module docstring)."""
    batch, now, all_tables = prepared.batch, prepared.now, prepared.tables
    outcomes = dict(prepared.refused)
    if not batch:
        return WriteReport({})
    stored = _stored_episodes(conn, list(batch))
    pending: list[Item] = []
    # slots are finished in key order, so two writers never lock the same rows crosswise
    for gid, g in sorted(batch.items(), key=lambda kv: (kv[1].task_id, kv[0])):
        if gid in outcomes:
            continue
        if gid in stored:
            if stored[gid] == _episode_ids(g):
                outcomes[gid] = WriteOutcome.REPLAYED
            elif g.slot_lease is not None and _lease(conn, g) != g.slot_lease:
                outcomes[gid] = WriteOutcome.SUPERSEDED  # the slot's next holder stored it
            else:
                outcomes[gid] = WriteOutcome.DUPLICATE
        else:
            pending.append(g)
    finished = _finish_slots(conn, [g for g in pending if g.slot_lease is not None], now)
    fresh: list[Item] = []
    for g in pending:
        if g.slot_lease is not None and g.group_id not in finished:
            outcomes[g.group_id] = WriteOutcome.SUPERSEDED
        else:
            fresh.append(g)
    if fresh:
        assert all_tables is not None
        tables = to_arrow.only_groups(all_tables, [g.group_id for g in fresh])
        new = set(backends.insert_new(conn, tables).to_pylist())
        for g in fresh:
            # a concurrent writer may have stored the same id in between (PostgreSQL)
            outcomes[g.group_id] = (
                WriteOutcome.STORED if g.group_id in new else WriteOutcome.DUPLICATE
            )
    for gid, outcome in outcomes.items():
        if outcome in (WriteOutcome.DUPLICATE, WriteOutcome.SUPERSEDED):
            log.error("group %s refused by the store: %s", gid, outcome)
    return WriteReport({g.group_id: outcomes[g.group_id] for g in batch.values()})
