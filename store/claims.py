"""The learner's side of the store: claim groups by policy version, load them as numpy.

A claim is one transaction: drop stale READY groups, pick the oldest eligible groups (READY,
or CLAIMED with an expired lease, or CLAIMED earlier by the same learner so that a restarted
learner re-takes its own claim), mark them CLAIMED under a new ``claim_id`` and lease, and
load their token arrays. PostgreSQL picks with ``FOR UPDATE … SKIP LOCKED``; DuckDB needs
nothing more than its cross-process file lock, which serialises every writer.

``Store`` composes :class:`Claims` (claim, release, and the reads of groups and episodes by
run) as ``store.claims``.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta

import numpy as np
import pyarrow as pa
import sqlalchemy as sa

from sandpiper.store import backends, dead, leases, schema, train_arrays
from sandpiper.store.records import (
    Fence,
    GroupSampling,
    GroupStatus,
    Split,
    TrainBatch,
    TrainEpisode,
    TrainGroup,
    utcnow,
)

log = logging.getLogger(__name__)


def new_claim_id() -> str:
    return uuid.uuid4().hex


def lease_deadline(lease_s: float) -> datetime:
    return utcnow() + timedelta(seconds=lease_s)


T = schema
READY, CLAIMED = GroupStatus.READY.value, GroupStatus.CLAIMED.value


def claim_groups(
    conn: sa.Connection,
    *,
    run_id: str,
    learner_id: str,
    n_groups: int,
    max_lag: int,
    lease_s: float,
    fence: Fence | None = None,
) -> TrainBatch | None:
    """See :meth:`Claims.claim`; with ``fence``, only the run's leader may claim."""
    gs, g, pol = T.group_states, T.groups, T.policies
    now = utcnow()
    if fence is not None:
        leases.check(conn, fence, skip_locked=backends.is_postgres(conn))
    current = conn.execute(
        sa.select(sa.func.max(pol.c.version)).where(pol.c.run_id == run_id)
    ).scalar()
    current = 0 if current is None else int(current)
    stale = sa.select(g.c.group_id).where(
        g.c.run_id == run_id, g.c.min_policy_version < current - max_lag
    )
    dropped = conn.execute(
        sa.update(gs)
        .where(gs.c.run_id == run_id, gs.c.status == READY, gs.c.group_id.in_(stale))
        .values(status=GroupStatus.DROPPED_STALE.value, updated_at=now)
    ).rowcount
    eligible = sa.or_(
        gs.c.status == READY,
        sa.and_(
            gs.c.status == CLAIMED,
            sa.or_(gs.c.lease_expires_at < now, gs.c.claimed_by == learner_id),
        ),
    )
    own_first = sa.case((gs.c.claimed_by == learner_id, 0), else_=1)
    claim_id = new_claim_id()
    pick = (
        sa.select(gs.c.group_id, g.c.task_id, g.c.min_policy_version)
        .join(g, g.c.group_id == gs.c.group_id)
        .where(gs.c.run_id == run_id, g.c.split == Split.TRAIN.value, eligible)
        .where(sa.or_(gs.c.claim_id.is_(None), gs.c.claim_id != claim_id))
        .order_by(own_first, g.c.committed_at, g.c.group_id)
    )
    groups: list[TrainGroup] = []
    # A group that cannot be read is set aside and the claim picks another in its place
    # (each round sets at least one aside, so this ends).
    while (need := n_groups - len(groups)) > 0:
        q = pick.limit(need)
        if backends.is_postgres(conn):
            q = q.with_for_update(skip_locked=True, of=gs)
        picked = conn.execute(q).all()  # with what load_groups needs of the groups
        if len(picked) < need:
            if groups:  # give back what this claim took; the next claim picks anew
                conn.execute(
                    sa.update(gs)
                    .where(gs.c.claim_id == claim_id, gs.c.status == CLAIMED)
                    .values(status=READY, claim_id=None, claimed_by=None,
                            lease_expires_at=None, updated_at=now)
                )  # fmt: skip
            return None  # the stale drops above still commit: they must not block backpressure
        ids = [r.group_id for r in picked]
        conn.execute(
            sa.update(gs)
            .where(gs.c.group_id.in_(ids))
            .values(
                status=CLAIMED,
                claim_id=claim_id,
                claimed_by=learner_id,
                lease_expires_at=lease_deadline(lease_s),
                updated_at=now,
            )
        )
        loaded, unreadable = _load_readable(
            conn, ids, current, meta={r.group_id: r for r in picked}
        )
        groups.extend(loaded)
        if unreadable:
            dead.set_aside_unreadable(conn, unreadable, run_id=run_id, now=now)
            log.error(
                "%d claimed group(s) could not be read and were set aside (status "
                "'dead', listed in dead_groups; `sandpiper store retry-dead` gives them "
                "back): %s",
                len(unreadable), "; ".join(f"{g}: {e}" for g, e in unreadable.items()),
            )  # fmt: skip
    return TrainBatch(
        claim_id=claim_id, groups=tuple(groups), dropped_stale=int(dropped), current_version=current
    )


UNREADABLE = (ValueError, TypeError, IndexError, KeyError, pa.ArrowException)
"""What turning stored rows into training arrays raises for rows it cannot use (a packed
array of a length no dtype divides, a missing column value); a database error is not one
of these and aborts the claim instead."""


def _load_readable(
    conn: sa.Connection, ids: list[str], current: int, meta: dict
) -> tuple[tuple[TrainGroup, ...], dict[str, str]]:
    """:func:`load_groups`, and when that fails, group by group: the readable groups, and
    group_id → error for the others (the claim sets those aside instead of failing on them
    forever)."""
    try:
        return load_groups(conn, ids, current, meta=meta), {}
    except UNREADABLE:
        pass
    good: list[TrainGroup] = []
    errors: dict[str, str] = {}
    for gid in ids:
        try:
            good.extend(load_groups(conn, [gid], current, meta=meta))
        except UNREADABLE as e:
            errors[gid] = dead.short_error(e)
    return tuple(good), errors


def load_groups(
    conn: sa.Connection, ids: list[str], current: int, meta: dict | None = None
) -> tuple[TrainGroup, ...]:
    """The groups ``ids`` (in that order) with their episodes' per-token arrays; ``meta``:
    group_id → a row with ``task_id`` and ``min_policy_version`` when the caller has them."""
    if meta is None:
        g = T.groups
        q = sa.select(g.c.group_id, g.c.task_id, g.c.min_policy_version)
        meta = {r.group_id: r for r in conn.execute(q.where(g.c.group_id.in_(ids)))}
    g = T.groups
    sampled = conn.execute(
        sa.select(g.c.group_id, g.c.sampling_params).where(g.c.group_id.in_(ids))
    )
    temperature = {r.group_id: GroupSampling.from_json(r.sampling_params).temperature
                   for r in sampled}  # fmt: skip
    by_group: dict[str, list[TrainEpisode]] = {gid: [] for gid in ids}
    for gid, ep in _episodes(conn, group_ids=ids):
        by_group[gid].append(ep)
    return tuple(
        TrainGroup(
            group_id=gid,
            task_id=meta[gid].task_id,
            # a group without sampled tokens cannot be stale; treat it as current
            min_policy_version=(
                current if meta[gid].min_policy_version is None else meta[gid].min_policy_version
            ),
            episodes=tuple(by_group[gid]),
            temperature=temperature.get(gid, 1.0),
        )
        for gid in ids
    )


def load_episodes(conn: sa.Connection, *, episode_ids: list[str]) -> list[TrainEpisode]:
    return [ep for _, ep in _episodes(conn, episode_ids=episode_ids)]


def _episodes(
    conn: sa.Connection,
    *,
    group_ids: list[str] | None = None,
    episode_ids: list[str] | None = None,
) -> list[tuple[str, TrainEpisode]]:
    """(group_id, TrainEpisode) pairs ordered by group, sample index."""
    e = T.episodes
    key_col, keys = (
        ("group_id", group_ids) if group_ids is not None else ("episode_id", episode_ids)
    )
    if not keys:
        return []
    rows = conn.execute(
        sa.select(e.c.episode_id, e.c.group_id, e.c.reward, e.c.valid)
        .where(e.c[key_col].in_(keys))
        .order_by(e.c.group_id, e.c.sample_index)
    ).all()
    where, params = backends.in_list(conn, key_col, keys)
    turns = backends.fetch_arrow(
        conn,
        f"SELECT {', '.join(train_arrays.TRAIN_TURN_COLUMNS)} FROM turns WHERE {where}",
        params,
    )
    meta = {r.episode_id: (r.reward, bool(r.valid)) for r in rows}
    built = {ep.episode_id: ep for ep in train_arrays.train_episodes(turns, meta)}
    return [(r.group_id, built.get(r.episode_id) or _empty(r.episode_id, meta)) for r in rows]


def _empty(episode_id: str, meta: dict) -> TrainEpisode:
    """An episode without turns (e.g. an infra failure before the first turn)."""
    reward, valid = meta[episode_id]
    return TrainEpisode(
        episode_id=episode_id,
        reward=reward,
        valid=valid,
        token_ids_T=np.zeros(0, np.int32),
        loss_mask_T=np.zeros(0, bool),
        behaviour_logprobs_T=np.zeros(0, np.float32),
        policy_versions_T=np.zeros(0, np.int32),
    )


class Claims:
    """The learner's claims and the reads of groups by run, each call in one of ``db``'s
    transactions. ``Store`` composes it as ``store.claims``."""

    def __init__(self, db: backends.Connections) -> None:
        self.db = db

    def claim(
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
        with self.db.transaction() as conn:
            return claim_groups(
                conn, run_id=run_id, learner_id=learner_id, n_groups=n_groups, max_lag=max_lag,
                lease_s=lease_s, fence=fence,
            )  # fmt: skip

    def release(self, claim_id: str, *, fence: Fence | None = None) -> None:
        """Give a claim's groups back (READY) without training on them."""
        gs = T.group_states
        with self.db.transaction() as conn:
            if fence is not None:
                leases.check(conn, fence, skip_locked=backends.is_postgres(conn))
            conn.execute(
                sa.update(gs)
                .where(gs.c.claim_id == claim_id, gs.c.status == CLAIMED)
                .values(status=READY, claimed_by=None, lease_expires_at=None, updated_at=utcnow())
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
        with self.db.connect_readonly() as conn:
            found = {GroupStatus(s): int(n) for s, n in conn.execute(q)}
        return {s: found.get(s, 0) for s in GroupStatus}

    def group_ids(self, run_id: str, status: GroupStatus | None = None) -> list[str]:
        gs = T.group_states
        q = sa.select(gs.c.group_id).where(gs.c.run_id == run_id).order_by(gs.c.group_id)
        if status is not None:
            q = q.where(gs.c.status == status.value)
        with self.db.connect_readonly() as conn:
            return list(conn.execute(q).scalars())

    def episode_ids(self, run_id: str) -> list[str]:
        e = T.episodes
        q = sa.select(e.c.episode_id).where(e.c.run_id == run_id).order_by(e.c.episode_id)
        with self.db.connect_readonly() as conn:
            return list(conn.execute(q).scalars())

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
        with self.db.connect_readonly() as conn:
            ids = list(conn.execute(q).scalars())
            by_id = {ep.episode_id: ep for ep in load_episodes(conn, episode_ids=ids)}
        return [by_id[i] for i in ids]
