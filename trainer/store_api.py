"""What the learner needs of the store, by room: Protocols the real ``store.Store``
(``store/``) and the in-memory double (``sandpiper.testing.MemoryStore``) both satisfy.

The learner reads and writes only through these, so a unit test can run it against the
double and the collector's daemon can hand it the real store unchanged.
"""

from __future__ import annotations

from typing import Protocol

from sandpiper.store.records import Fence, LeaseRecord, PolicyRecord, TrainBatch, TrainEpisode


class LearnerPolicies(Protocol):
    """The part of ``store.policy_versions`` (``store/policies.py:PolicyVersions``) the
    learner uses."""

    def register(
        self, policy: PolicyRecord, *, claim_id: str | None = None, metrics: dict | None = None,
        fence: Fence | None = None,
    ) -> None: ...  # fmt: skip

    def latest(self, run_id: str) -> PolicyRecord | None: ...

    def all(self, run_id: str) -> list[PolicyRecord]: ...

    def oldest_in_flight(self, run_id: str) -> int | None: ...


class LearnerLeases(Protocol):
    """``store.leases`` (``store/leases.py:Leases``): the learner's leadership."""

    def acquire(self, *, run_id: str, learner_id: str, lease_s: float) -> LeaseRecord: ...

    def renew(self, fence: Fence, *, lease_s: float) -> LeaseRecord: ...

    def release(self, fence: Fence) -> None: ...

    def current(self, run_id: str) -> LeaseRecord | None: ...


class LearnerClaims(Protocol):
    """The part of ``store.claims`` (``store/claims.py:Claims``) the learner uses."""

    def claim(
        self, *, run_id: str, learner_id: str, n_groups: int, max_lag: int, lease_s: float = ...,
        fence: Fence | None = None,
    ) -> TrainBatch | None: ...  # fmt: skip

    def release(self, claim_id: str, *, fence: Fence | None = None) -> None: ...

    def sft_episodes(
        self, *, run_id: str | None, min_reward: float, limit: int | None = None
    ) -> list[TrainEpisode]: ...


class CollectorVersions(Protocol):
    """The part of ``store.slots`` (``store/slots.py:Slots``) checkpoint retention reads."""

    def referenced_versions(self, *, run_id: str, within_s: float) -> set[int]: ...


class LearnerStore(Protocol):
    """The part of ``store.Store`` the learner uses, by room (``sandpiper.testing.MemoryStore``
    implements it in memory for unit tests)."""

    @property
    def policy_versions(self) -> LearnerPolicies: ...

    @property
    def leases(self) -> LearnerLeases: ...

    @property
    def claims(self) -> LearnerClaims: ...

    @property
    def slots(self) -> CollectorVersions: ...
