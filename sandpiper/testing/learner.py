"""The learner's store double: :class:`MemoryStore`, the ``LearnerStore`` Protocol in memory.

Claims without the store's I/O; the leadership lease and its fence are checked as the real
store checks them. :func:`to_train_group` is what the store's reader hands the learner for a
group.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING

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
    """In-process stand-in for ``store.Store``'s learner API, by room as the real store
    composes them (``policy_versions``, ``leases``, ``claims``, ``slots``): claims without
    leases; the leadership lease and its fence are checked as the real store does."""

    def __init__(self) -> None:
        self.registered: list[PolicyRecord] = []
        self.ready: list[TrainGroup] = []
        self.collector_versions: set[int] = set()
        """Policy versions live collectors announced (retention keeps them)."""
        self.claimed: dict[str, tuple[TrainGroup, ...]] = {}
        self.consumed: dict[str, int] = {}
        self.steps: list[dict] = []
        self.lease: LeaseRecord | None = None
        self.policy_versions = MemoryPolicyVersions(self)
        self.leases = MemoryLeases(self)
        self.claims = MemoryClaims(self)
        self.slots = MemorySlots(self)

    def write_groups(self, groups: list[GroupRecord]) -> None:
        self.ready.extend(to_train_group(g) for g in groups)

    def check(self, fence: Fence | None) -> None:
        """Refuse a fenced call of a deposed learner (as ``store/leases.py:check``)."""
        if fence is not None and (
            self.lease is None or (self.lease.learner_id, self.lease.term)
            != (fence.learner_id, fence.term)
        ):  # fmt: skip
            raise NotLeaderError(f"learner {fence.learner_id} term {fence.term} was deposed")


class MemoryPolicyVersions:
    """``store.policy_versions`` (``store/policies.py:PolicyVersions``) of a :class:`MemoryStore`."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def register(self, policy: PolicyRecord, *, claim_id=None, metrics=None, fence=None) -> None:
        st = self.store
        st.check(fence)
        latest = st.registered[-1].version if st.registered else None
        if policy.parent_version != latest:
            raise PolicyConflictError(f"version {policy.version}: latest is {latest}")
        st.registered.append(policy)
        if claim_id is not None:
            for g in st.claimed.pop(claim_id):
                assert g.group_id not in st.consumed, "group trained twice"
                st.consumed[g.group_id] = policy.version
        if policy.learner_step is not None:
            st.steps.append(metrics or {})

    def latest(self, run_id: str) -> PolicyRecord | None:
        return self.store.registered[-1] if self.store.registered else None

    def all(self, run_id: str) -> list[PolicyRecord]:
        return list(self.store.registered)

    def oldest_in_flight(self, run_id: str) -> int | None:
        live = self.store.ready + [g for c in self.store.claimed.values() for g in c]
        return min((g.min_policy_version for g in live), default=None)


class MemoryLeases:
    """``store.leases`` (``store/leases.py:Leases``) of a :class:`MemoryStore`."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def acquire(self, *, run_id, learner_id, lease_s) -> LeaseRecord:
        st = self.store
        now = utcnow()
        expires = now + timedelta(seconds=lease_s)
        held = st.lease
        if held is None or held.learner_id == learner_id or held.expires_at <= now:
            term = 1 if held is None else held.term + (held.learner_id != learner_id)
            if held is not None and held.learner_id != learner_id:
                for claim in st.claimed.values():  # the deposed leader's claims
                    st.ready = list(claim) + st.ready
                st.claimed.clear()
            st.lease = LeaseRecord(run_id, learner_id, term, expires, True)
            return st.lease
        return replace(held, held=False)

    def renew(self, fence: Fence, *, lease_s: float) -> LeaseRecord:
        self.store.check(fence)
        return self.acquire(run_id=fence.run_id, learner_id=fence.learner_id, lease_s=lease_s)

    def current(self, run_id: str) -> LeaseRecord | None:
        lease = self.store.lease
        return None if lease is None else replace(lease, held=False)

    def release(self, fence: Fence) -> None:
        st = self.store
        if st.lease is not None and st.lease.term == fence.term:
            st.lease = replace(st.lease, expires_at=utcnow())


class MemoryClaims:
    """The learner's part of ``store.claims`` (``store/claims.py:Claims``) of a
    :class:`MemoryStore`."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def claim(self, *, run_id, learner_id, n_groups, max_lag, lease_s=600.0, fence=None):
        st = self.store
        st.check(fence)
        current = st.registered[-1].version if st.registered else 0
        fresh = [g for g in st.ready if g.min_policy_version >= current - max_lag]
        dropped = len(st.ready) - len(fresh)
        st.ready = fresh
        if len(fresh) < n_groups:
            return None
        taken, st.ready = tuple(fresh[:n_groups]), fresh[n_groups:]
        claim_id = uuid.uuid4().hex
        st.claimed[claim_id] = taken
        return TrainBatch(claim_id, taken, dropped, current)

    def release(self, claim_id: str, *, fence=None) -> None:
        st = self.store
        st.check(fence)
        st.ready = list(st.claimed.pop(claim_id)) + st.ready

    def sft_episodes(self, *, run_id, min_reward, limit=None) -> list[TrainEpisode]:
        eps = [
            e for g in self.store.ready for e in g.episodes
            if e.valid and e.reward is not None and e.reward >= min_reward
        ]  # fmt: skip
        return eps[:limit] if limit is not None else eps


class MemorySlots:
    """What the learner reads of ``store.slots`` (``store/slots.py:Slots``) in a
    :class:`MemoryStore`: the versions live collectors announced."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def referenced_versions(self, *, run_id: str, within_s: float) -> set[int]:
        return set(self.store.collector_versions)


if TYPE_CHECKING:  # mypy holds the fake to the Protocol the learner is typed with
    from sandpiper.trainer.store_api import LearnerStore

    _MEMORY_STORE: LearnerStore = MemoryStore()
