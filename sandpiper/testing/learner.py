"""The learner's store double: :class:`MemoryStore`, the ``LearnerStore`` Protocol in memory.

Claims without the store's I/O; the leadership lease and its fence are checked as the real
store checks them. :func:`to_train_group` is what the store's reader hands the learner for a
group.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import timedelta

import numpy as np

from sandpiper.errors import NotLeaderError, PolicyConflictError
from sandpiper.store.records import (
    Fence,
    GroupRecord,
    LeaseRecord,
    PolicyRecord,
    TrainBatch,
    TrainEpisode,
    TrainGroup,
    utcnow,
)


def to_train_group(group: GroupRecord) -> TrainGroup:
    """What the store's reader hands the learner for ``group`` (used by :class:`MemoryStore`)."""
    episodes = []
    for e in group.episodes:
        ids = np.concatenate([t.token_ids_T for t in e.turns]).astype(np.int32)
        mask = np.concatenate([np.full(len(t.token_ids_T), t.trainable) for t in e.turns])
        behav = np.concatenate(
            [t.logprobs_T if t.trainable else np.full(len(t.token_ids_T), np.nan) for t in e.turns]
        ).astype(np.float32)
        versions = np.concatenate(
            [t.policy_versions_T if t.trainable else np.full(len(t.token_ids_T), -1)
             for t in e.turns]
        ).astype(np.int32)  # fmt: skip
        episodes.append(TrainEpisode(e.episode_id, e.reward, e.valid, ids, mask, behav, versions))
    low = min(int(ep.policy_versions_T[ep.loss_mask_T].min()) for ep in episodes)
    return TrainGroup(group.group_id, group.task_id, low, tuple(episodes))


class MemoryStore:
    """In-process stand-in for ``store.Store``'s learner API (claims without leases; the
    leadership lease and its fence are checked as the real store does)."""

    def __init__(self) -> None:
        self.registered: list[PolicyRecord] = []
        self.ready: list[TrainGroup] = []
        self.collector_versions: set[int] = set()
        """Policy versions live collectors announced (retention keeps them)."""
        self.claims: dict[str, tuple[TrainGroup, ...]] = {}
        self.consumed: dict[str, int] = {}
        self.steps: list[dict] = []
        self.lease: LeaseRecord | None = None

    def write_groups(self, groups: list[GroupRecord]) -> None:
        self.ready.extend(to_train_group(g) for g in groups)

    def latest_policy(self, run_id: str) -> PolicyRecord | None:
        return self.registered[-1] if self.registered else None

    def policies(self, run_id: str) -> list[PolicyRecord]:
        return list(self.registered)

    def oldest_version_in_flight(self, run_id: str) -> int | None:
        live = self.ready + [g for c in self.claims.values() for g in c]
        return min((g.min_policy_version for g in live), default=None)

    def collector_policy_versions(self, *, run_id: str, within_s: float) -> set[int]:
        return set(self.collector_versions)

    def acquire_lease(self, *, run_id, learner_id, lease_s) -> LeaseRecord:
        now = utcnow()
        expires = now + timedelta(seconds=lease_s)
        held = self.lease
        if held is None or held.learner_id == learner_id or held.expires_at <= now:
            term = 1 if held is None else held.term + (held.learner_id != learner_id)
            if held is not None and held.learner_id != learner_id:
                for claim in self.claims.values():  # the deposed leader's claims
                    self.ready = list(claim) + self.ready
                self.claims.clear()
            self.lease = LeaseRecord(run_id, learner_id, term, expires, True)
            return self.lease
        return replace(held, held=False)

    def _check(self, fence: Fence | None) -> None:
        if fence is not None and (
            self.lease is None or (self.lease.learner_id, self.lease.term)
            != (fence.learner_id, fence.term)
        ):  # fmt: skip
            raise NotLeaderError(f"learner {fence.learner_id} term {fence.term} was deposed")

    def renew_lease(self, fence: Fence, *, lease_s: float) -> LeaseRecord:
        self._check(fence)
        return self.acquire_lease(run_id=fence.run_id, learner_id=fence.learner_id,
                                  lease_s=lease_s)  # fmt: skip

    def current_lease(self, run_id: str) -> LeaseRecord | None:
        return None if self.lease is None else replace(self.lease, held=False)

    def release_lease(self, fence: Fence) -> None:
        if self.lease is not None and self.lease.term == fence.term:
            self.lease = replace(self.lease, expires_at=utcnow())

    def claim_batch(self, *, run_id, learner_id, n_groups, max_lag, lease_s=600.0, fence=None):
        self._check(fence)
        current = self.registered[-1].version if self.registered else 0
        fresh = [g for g in self.ready if g.min_policy_version >= current - max_lag]
        dropped = len(self.ready) - len(fresh)
        self.ready = fresh
        if len(fresh) < n_groups:
            return None
        taken, self.ready = tuple(fresh[:n_groups]), fresh[n_groups:]
        claim_id = uuid.uuid4().hex
        self.claims[claim_id] = taken
        return TrainBatch(claim_id, taken, dropped, current)

    def release_claim(self, claim_id: str, *, fence=None) -> None:
        self._check(fence)
        self.ready = list(self.claims.pop(claim_id)) + self.ready

    def register_policy(self, policy: PolicyRecord, *, claim_id=None, metrics=None, fence=None):
        self._check(fence)
        latest = self.registered[-1].version if self.registered else None
        if policy.parent_version != latest:
            raise PolicyConflictError(f"version {policy.version}: latest is {latest}")
        self.registered.append(policy)
        if claim_id is not None:
            for g in self.claims.pop(claim_id):
                assert g.group_id not in self.consumed, "group trained twice"
                self.consumed[g.group_id] = policy.version
        if policy.learner_step is not None:
            self.steps.append(metrics or {})

    def sft_episodes(self, *, run_id, min_reward, limit=None) -> list[TrainEpisode]:
        eps = [
            e for g in self.ready for e in g.episodes
            if e.valid and e.reward is not None and e.reward >= min_reward
        ]  # fmt: skip
        return eps[:limit] if limit is not None else eps
