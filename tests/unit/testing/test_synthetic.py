"""The synthetic run looks like real collection (what the analysis fixture store holds)."""

from __future__ import annotations

from collections import Counter

from sandpiper.analysis.views import IMPORTANCE_METRICS
from sandpiper.store.records import INFRA_STOPS, ToolErrorKind
from sandpiper.testing.synthetic import synthetic_run


def test_it_is_reproducible() -> None:
    a, b = synthetic_run(seed=3), synthetic_run(seed=3)
    assert [e.episode_id for e in a.episodes] == [e.episode_id for e in b.episodes]
    assert [e.episode_id for e in a.episodes] != [
        e.episode_id for e in synthetic_run(seed=4).episodes
    ]


def test_it_has_what_the_views_need() -> None:
    run = synthetic_run()
    eps = run.episodes
    assert len(run.steps) == 5 and len(run.groups_by_version) == 6
    invalid = [e for e in eps if not e.valid]
    assert invalid and all(e.reward is None and e.stop_reason in INFRA_STOPS for e in invalid)
    assert all(e.error for e in invalid)
    assert any(e.policy_version_range[0] < e.policy_version_range[1] for e in eps)
    kinds = Counter(c.error_kind for e in eps for t in e.turns for c in t.tool_calls)
    assert kinds[ToolErrorKind.TIMED_OUT] and kinds[ToolErrorKind.TOOL_ERROR]
    assert kinds[ToolErrorKind.UNKNOWN_TOOL]
    assert run.dropped_group_ids
    rewards = [{e.reward for e in g.episodes if e.valid} for g in run.groups]
    assert any(len(r) == 1 for r in rewards) and any(len(r) == 2 for r in rewards)
    for step in run.steps:
        assert set(step.metrics) >= set(IMPORTANCE_METRICS.values())


def test_reward_rises_across_versions() -> None:
    run = synthetic_run()

    def mean(version: int) -> float:
        rs = [e.reward for g in run.groups_by_version[version] for e in g.episodes if e.valid]
        return sum(rs) / len(rs)

    assert mean(5) > mean(0)


def test_the_simulated_learner_never_trains_stale_groups() -> None:
    run = synthetic_run()
    version_of = {g.group_id: v for v, gs in run.groups_by_version.items() for g in gs}
    for index, step in enumerate(run.steps):
        assert all(0 <= index - version_of[gid] <= run.max_lag for gid in step.group_ids)
    taken = [gid for s in run.steps for gid in s.group_ids]
    assert len(taken) == len(set(taken)) and not set(taken) & set(run.dropped_group_ids)
