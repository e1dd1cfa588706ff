"""Checkpoint retention: what is kept (last N, every K-th, version 0, versions that work in
flight was sampled with, the grace period), and that deleting only touches what it may."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from sandpiper.store.records import PolicyRecord
from sandpiper.trainer.retention import RetentionPolicy, prune_checkpoints, versions_to_keep

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _policies(n: int, root: Path | None = None, *, age_s: float = 3600.0, term: int = 1):
    out = []
    for v in range(n):
        uri = f"{root}/v{v:06d}-t{term:04d}" if root else f"ckpt/{v}"
        when = NOW - timedelta(seconds=age_s * (n - v))
        out.append(PolicyRecord("r", v, uri, v - 1 if v else None, v or None, when))
    return out


def test_keeps_last_n_every_kth_v0_and_in_flight():
    rule = RetentionPolicy(keep_last=2, keep_every=4, grace_s=0)
    assert versions_to_keep(_policies(11), rule, in_flight_from=None, now=NOW) == {0, 4, 8, 9, 10}
    assert versions_to_keep(_policies(11), rule, in_flight_from=6, now=NOW) == {
        0, 4, 6, 7, 8, 9, 10,
    }  # fmt: skip
    no_every = RetentionPolicy(keep_last=1, keep_every=0, grace_s=0)
    assert versions_to_keep(_policies(5), no_every, in_flight_from=None, now=NOW) == {0, 4}


def test_grace_keeps_a_version_whose_successor_is_young():
    rule = RetentionPolicy(keep_last=1, keep_every=0, grace_s=90)
    # one version a minute: the successors of versions 3 and 4 are younger than 90 s
    kept = versions_to_keep(_policies(6, age_s=60), rule, in_flight_from=None, now=NOW)
    assert kept == {0, 4, 5}


class _Store:
    """What retention reads, by room: ``store.slots`` and ``store.policy_versions`` (both
    this object)."""

    def __init__(self, policies, in_flight=None, collectors=()):
        self._policies, self._in_flight = policies, in_flight
        self.collectors = list(collectors)
        """(policy_version, heartbeat age in s, stopped) of the run's collectors."""
        self.asked_within_s: list[float] = []
        self.slots = self.policy_versions = self

    def referenced_versions(self, *, run_id, within_s):
        self.asked_within_s.append(within_s)
        return {v for v, age, stopped in self.collectors if not stopped and age < within_s}

    def all(self, run_id):
        return self._policies

    def oldest_in_flight(self, run_id):
        return self._in_flight


def test_prune_deletes_only_what_retention_allows(tmp_path):
    ckpt = tmp_path / "policies"
    ckpt.mkdir()
    outside = tmp_path / "initial-model"
    policies = _policies(6, ckpt, term=2)
    policies[0] = PolicyRecord("r", 0, str(outside), None, None, NOW - timedelta(days=1))
    for p in policies:
        Path(p.checkpoint_uri).mkdir()
        (Path(p.checkpoint_uri) / "model.safetensors").write_bytes(b"x")
    deposed = ckpt / "v000003-t0001"  # a deposed learner's unregistered version
    half = ckpt / ".v000004-t0001.tmp-abcd0123"  # and its half-written one
    mine = ckpt / ".v000006-t0002.tmp-00ff00ff"  # the current term's: never touched
    for d in (deposed, half, mine):
        d.mkdir()
    rule = RetentionPolicy(keep_last=2, keep_every=0, grace_s=0)
    deleted = prune_checkpoints(
        _Store(policies, in_flight=3), run_id="r", checkpoint_dir=ckpt, term=2, rule=rule,
        now=NOW,
    )  # fmt: skip
    assert sorted(p.name for p in deleted) == sorted(
        ["v000001-t0002", "v000002-t0002", "v000003-t0001", ".v000004-t0001.tmp-abcd0123"]
    )
    assert outside.is_dir()  # version 0 outside the checkpoint dir is never touched
    left = sorted(p.name for p in ckpt.iterdir())
    assert left == [".v000006-t0002.tmp-00ff00ff", "v000003-t0002", "v000004-t0002",
                    "v000005-t0002"]  # fmt: skip


def test_a_version_a_live_collector_announced_is_kept(tmp_path):
    """Keep last 1 and no grace would delete v1..v4; collectors still reference two of them."""
    ckpt = tmp_path / "policies"
    policies = _policies(6, ckpt, term=1)
    for p in policies:
        Path(p.checkpoint_uri).mkdir(parents=True)
    rule = RetentionPolicy(keep_last=1, keep_every=0, grace_s=30, collector_ttl_s=60)
    store = _Store(
        policies,
        collectors=[
            (2, 5.0, False),  # live, serving v2 (a slow reloader): kept
            (3, 80.0, False),  # heartbeat lapsed 80 s ago, within ttl + grace: kept
            (1, 5.0, True),  # stopped cleanly: its v1 may go
            (4, 200.0, False),  # silent longer than ttl + grace (dead): v4 may go
        ],
    )
    deleted = prune_checkpoints(store, run_id="r", checkpoint_dir=ckpt, term=1, rule=rule, now=NOW)
    assert store.asked_within_s == [90]
    assert sorted(p.name for p in deleted) == ["v000001-t0001", "v000004-t0001"]
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "v000000-t0001", "v000002-t0001", "v000003-t0001", "v000005-t0001",
    ]  # fmt: skip


def test_referenced_versions_unknown_to_the_store_are_ignored():
    rule = RetentionPolicy(keep_last=1, keep_every=0, grace_s=0)
    kept = versions_to_keep(_policies(4), rule, in_flight_from=None, now=NOW, referenced={1, 9})
    assert kept == {0, 1, 3}


def test_only_the_newest_version_keeps_its_training_state(tmp_path):
    """A learner resumes from the newest version only; the kept older ones (last N, grace,
    in flight, collectors' versions) serve weights, so their optimiser state goes."""
    from sandpiper.trainer.resume import STATE_DIR

    ckpt = tmp_path / "policies"
    outside = tmp_path / "initial-model"
    policies = _policies(5, ckpt, term=1)
    policies[0] = PolicyRecord("r", 0, str(outside), None, None, NOW - timedelta(days=1))
    for p in policies:
        (Path(p.checkpoint_uri) / STATE_DIR / "state").mkdir(parents=True)
        (Path(p.checkpoint_uri) / "model.safetensors").write_bytes(b"x")
    rule = RetentionPolicy(keep_last=3, keep_every=0, grace_s=0)
    deleted = prune_checkpoints(
        _Store(policies), run_id="r", checkpoint_dir=ckpt, term=1, rule=rule, now=NOW
    )
    assert [p.name for p in deleted] == ["v000001-t0001"]
    with_state = {p.version for p in policies if (Path(p.checkpoint_uri) / STATE_DIR).is_dir()}
    assert with_state == {0, 4}  # v0 lies outside the checkpoint dir: never touched
    for v in (2, 3, 4):  # the weights of every kept version stay
        assert (Path(policies[v].checkpoint_uri) / "model.safetensors").is_file()
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".trash-")]


def test_the_newest_training_state_is_kept_when_later_versions_have_none(tmp_path):
    """``learner.train_state_every`` > 1: v3 has the newest training state, v4 and v5 none;
    v3 and its state stay (a restart resumes from it); v1 (a collector serves it) stays
    without its state; v2 goes whole."""
    ckpt = tmp_path / "policies"
    policies = _policies(6, ckpt)
    for p in policies:
        (Path(p.checkpoint_uri) / "model.safetensors").parent.mkdir(parents=True)
        (Path(p.checkpoint_uri) / "model.safetensors").write_bytes(b"x")
    for v in (1, 3):
        (Path(policies[v].checkpoint_uri) / "train_state" / "state").mkdir(parents=True)
    rule = RetentionPolicy(keep_last=2, keep_every=0, grace_s=0)
    deleted = prune_checkpoints(
        _Store(policies, collectors=[(1, 0.0, False)]), run_id="r", checkpoint_dir=ckpt,
        term=1, rule=rule, now=NOW,
    )  # fmt: skip
    assert [p.name for p in deleted] == ["v000002-t0001"]
    assert (Path(policies[3].checkpoint_uri) / "train_state" / "state").is_dir()
    assert not (Path(policies[1].checkpoint_uri) / "train_state").exists()
    assert versions_to_keep(policies, rule, in_flight_from=None, now=NOW, resume_from=3) == {
        0, 3, 4, 5,
    }  # fmt: skip
