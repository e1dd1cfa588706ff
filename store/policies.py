"""Policy versions: a learner's checkpoints registered (with the step and the claim it
consumed), and read back. ``Store`` composes :class:`PolicyVersions` as
``store.policy_versions`` (``store.policy_versions.all(run_id)`` reads every version).

``register`` is the end of the learner's claim protocol (``store/store.py``): the policy,
its learner step and the consumption of the claimed groups in ONE transaction.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from sandpiper.errors import PolicyConflictError, StoreError
from sandpiper.store import backends, leases
from sandpiper.store import schema as T
from sandpiper.store.backends import Connections
from sandpiper.store.records import Fence, GroupStatus, PolicyRecord, utcnow


class PolicyVersions:
    """The ``policies`` and ``learner_steps`` tables, through ``db``'s transactions."""

    def __init__(self, db: Connections) -> None:
        self.db = db

    def register(
        self,
        policy: PolicyRecord,
        *,
        claim_id: str | None = None,
        metrics: dict | None = None,
        fence: Fence | None = None,
    ) -> None:
        """Insert the policy; with a learner step, also the step and consume its claim.

        One transaction, one INSERT: a version that exists already, or a parent that is not
        the latest version, raises :class:`PolicyConflictError` (never a silent no-op), and
        with ``fence`` a learner that is no longer in charge gets :class:`NotLeaderError`.
        """
        pol = T.policies
        with self.db.transaction() as conn:
            if fence is not None:
                leases.check(conn, fence, skip_locked=backends.is_postgres(conn))
            latest = conn.execute(
                sa.select(sa.func.max(pol.c.version)).where(pol.c.run_id == policy.run_id)
            ).scalar()
            if latest != policy.parent_version:
                raise PolicyConflictError(
                    f"cannot register version {policy.version} of run {policy.run_id} with "
                    f"parent {policy.parent_version}: the latest registered version is "
                    f"{latest}; another learner registered in between"
                )
            try:
                conn.execute(sa.insert(pol).values(**_policy_row(policy)))
            except sa.exc.DBAPIError as e:
                if not _is_unique_violation(e):
                    raise
                raise PolicyConflictError(
                    f"policy version {policy.version} of run {policy.run_id} is already "
                    "registered; not registering it twice"
                ) from e
            if policy.learner_step is None:
                return
            n_groups = 0
            if claim_id is not None:
                n_groups = _consume(conn, claim_id, policy.learner_step)
            conn.execute(
                sa.insert(T.learner_steps).values(
                    run_id=policy.run_id,
                    step=policy.learner_step,
                    policy_version=policy.version,
                    claim_id=claim_id,
                    n_groups=n_groups,
                    metrics=metrics or {},
                    created_at=utcnow(),
                )
            )

    def latest(self, run_id: str) -> PolicyRecord | None:
        pol = T.policies
        with self.db.connect_readonly() as conn:
            row = conn.execute(
                sa.select(pol).where(pol.c.run_id == run_id).order_by(pol.c.version.desc()).limit(1)
            ).one_or_none()
        return None if row is None else _policy_record(row)

    def all(self, run_id: str) -> list[PolicyRecord]:
        """Every registered version of ``run_id``, oldest first."""
        pol = T.policies
        with self.db.connect_readonly() as conn:
            rows = conn.execute(
                sa.select(pol).where(pol.c.run_id == run_id).order_by(pol.c.version)
            ).all()
        return [_policy_record(r) for r in rows]

    def oldest_in_flight(self, run_id: str) -> int | None:
        """Oldest policy version sampled by a group not consumed yet (READY or CLAIMED)."""
        g, gs = T.groups, T.group_states
        live = (GroupStatus.READY.value, GroupStatus.CLAIMED.value)
        q = (
            sa.select(sa.func.min(g.c.min_policy_version))
            .select_from(g.join(gs, gs.c.group_id == g.c.group_id))
            .where(gs.c.run_id == run_id, gs.c.status.in_(live))
        )
        with self.db.connect_readonly() as conn:
            found = conn.execute(q).scalar()
        return None if found is None else int(found)


def _consume(conn: sa.Connection, claim_id: str, step: int) -> int:
    gs = T.group_states
    n = conn.execute(
        sa.update(gs)
        .where(gs.c.claim_id == claim_id, gs.c.status == GroupStatus.CLAIMED.value)
        .values(status=GroupStatus.CONSUMED.value, consumed_by_step=step, updated_at=utcnow())
    ).rowcount
    if n == 0:
        raise StoreError(
            f"claim {claim_id} holds no groups (its lease expired and another learner "
            "re-took them, or it was released); not registering a policy trained on it"
        )
    return n


def _policy_record(row: Any) -> PolicyRecord:
    return PolicyRecord(
        run_id=row.run_id,
        version=row.version,
        checkpoint_uri=row.checkpoint_uri,
        parent_version=row.parent_version,
        learner_step=row.learner_step,
        created_at=row.created_at,
    )


def _is_unique_violation(e: sa.exc.DBAPIError) -> bool:
    """A duplicate key: psycopg's UniqueViolation, or DuckDB's ConstraintException."""
    if isinstance(e, sa.exc.IntegrityError):
        return True
    text = str(e.orig).lower()
    return "duplicate key" in text or "constraint" in text


def _policy_row(p: PolicyRecord) -> dict[str, Any]:
    return {
        "run_id": p.run_id,
        "version": p.version,
        "checkpoint_uri": p.checkpoint_uri,
        "parent_version": p.parent_version,
        "learner_step": p.learner_step,
        "created_at": p.created_at,
    }
