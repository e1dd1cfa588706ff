"""The analysis views on the fixture store (DuckDB and PostgreSQL) against the records that
were written: every figure is recomputed here in plain Python from the synthetic run."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict

import pytest

from sandpiper.analysis import api
from sandpiper.analysis.views import IMPORTANCE_METRICS, VIEW_NAMES
from sandpiper.store.records import ToolErrorKind

pytestmark = pytest.mark.integration


def _episodes_by_start_version(run):
    by_version = defaultdict(list)
    for e in run.episodes:
        by_version[e.policy_version_range[0]].append(e)
    return by_version


def test_every_view_answers(analysis_store_url: str) -> None:
    for view in VIEW_NAMES:
        df = api.query(analysis_store_url, f"SELECT * FROM {view}")
        assert df.height > 0, view


def test_episode_summary(analysis_store_url: str, analysis_run) -> None:
    df = api.episodes(analysis_store_url)
    assert sorted(df["episode_id"]) == sorted(e.episode_id for e in analysis_run.episodes)
    assert (~df["valid"]).sum() == sum(not e.valid for e in analysis_run.episodes)
    n_calls = sum(len(t.tool_calls) for e in analysis_run.episodes for t in e.turns)
    assert df["n_tool_calls"].sum() == n_calls
    invalid = df.filter(~df["valid"])
    assert invalid["reward"].null_count() == invalid.height  # never scored as 0
    assert set(invalid["outcome"]) <= {"sandbox_lost", "model_error", "infra_error", "cancelled"}


def test_reward_by_version(analysis_store_url: str, analysis_run) -> None:
    df = api.reward_by_version(analysis_store_url)
    expected = _episodes_by_start_version(analysis_run)
    assert df["policy_version"].to_list() == sorted(expected)
    for row in df.iter_rows(named=True):
        eps = expected[row["policy_version"]]
        rewards = [e.reward for e in eps if e.valid]
        assert row["n_episodes"] == len(eps)
        assert row["n_invalid"] == sum(not e.valid for e in eps)
        assert row["reward_mean"] == pytest.approx(statistics.fmean(rewards))
        assert row["reward_std"] == pytest.approx(statistics.stdev(rewards))
        assert row["pass_rate"] == pytest.approx(statistics.fmean(r >= 1.0 for r in rewards))


def test_pass_rate_by_task(analysis_store_url: str, analysis_run) -> None:
    df = api.pass_rate_by_task(analysis_store_url)
    rewards = defaultdict(list)
    for g in analysis_run.groups:
        rewards[g.task_id].extend(e.reward for e in g.episodes if e.valid)
    got = dict(zip(df["task_id"], df["pass_rate"], strict=True))
    assert got == pytest.approx(
        {t: statistics.fmean(r >= 1 for r in rs) for t, rs in rewards.items()}
    )
    worst = api.top_failing_tasks(analysis_store_url, n=2)["task_id"].to_list()
    assert "impossible-proof" in worst


def test_tool_usage(analysis_store_url: str, analysis_run) -> None:
    calls = [c for e in analysis_run.episodes for t in e.turns for c in t.tool_calls]
    df = api.tool_usage(analysis_store_url)
    rows = {r["tool"]: r for r in df.iter_rows(named=True)}
    assert set(rows) == {c.name for c in calls}
    for name, row in rows.items():
        mine = [c for c in calls if c.name == name]
        assert row["n_calls"] == len(mine)
        assert row["n_errors"] == sum(c.error_kind != ToolErrorKind.NONE for c in mine)
        assert row["n_timeouts"] == sum(c.timed_out for c in mine)
        assert row["duration_ms_max"] == pytest.approx(max(c.duration_ms for c in mine))
    assert rows["execute_bash"]["n_timeouts"] > 0


def test_failure_kinds(analysis_store_url: str, analysis_run) -> None:
    df = api.failure_kinds(analysis_store_url)
    episode = df.filter(df["level"] == "episode")
    expected = Counter()
    for e in analysis_run.episodes:
        if not e.valid:
            expected[str(e.stop_reason)] += 1
        elif e.reward < 1.0:
            expected["wrong_answer" if e.stop_reason == "submitted" else str(e.stop_reason)] += 1
    assert dict(zip(episode["kind"], episode["n"], strict=True)) == dict(expected)
    assert episode["share"].sum() == pytest.approx(1.0)
    infra = set(episode.filter(episode["infra"])["kind"])
    assert infra == {"sandbox_lost", "model_error"}
    tools = df.filter(df["level"] == "tool_call")
    assert "timed_out" in tools["kind"].to_list()


def test_staleness_matches_the_claims(analysis_store_url: str, analysis_run) -> None:
    version_of = {g.group_id: v for v, gs in analysis_run.groups_by_version.items() for g in gs}
    expected = Counter(
        step_index - version_of[gid]
        for step_index, step in enumerate(analysis_run.steps)
        for gid in step.group_ids
    )
    df = api.staleness(analysis_store_url)
    consumed = df.filter(df["status"] == "consumed")
    assert dict(zip(consumed["staleness"], consumed["n_groups"], strict=True)) == dict(expected)
    dropped = df.filter(df["status"] == "dropped_stale")["n_groups"].sum()
    assert dropped == len(analysis_run.dropped_group_ids) > 0


def test_importance_weights(analysis_store_url: str, analysis_run) -> None:
    df = api.importance_weights(analysis_store_url)
    assert df["step"].to_list() == [s.policy.learner_step for s in analysis_run.steps]
    for row, step in zip(df.iter_rows(named=True), analysis_run.steps, strict=True):
        for column, key in IMPORTANCE_METRICS.items():
            assert row[column] == pytest.approx(step.metrics[key]), column


def test_group_reward_variance(analysis_store_url: str, analysis_run) -> None:
    df = api.group_reward_variance(analysis_store_url)
    expected_zero = set()
    for g in analysis_run.groups:
        rewards = [e.reward for e in g.episodes if e.valid]
        if len(rewards) >= 1 and statistics.pvariance(rewards) == 0:
            expected_zero.add(g.group_id)
    assert set(df.filter(df["zero_variance"])["group_id"]) == expected_zero
    share = api.zero_variance_share(analysis_store_url)
    assert 0 < share["n_zero_variance"].sum() < share["n_groups"].sum()


def test_backends_agree(analysis_duckdb_url: str, analysis_postgres_url: str) -> None:
    for view in VIEW_NAMES:
        if view in {"group_status"}:
            continue  # carries write timestamps, which differ per store
        duck = api.query(analysis_duckdb_url, f"SELECT * FROM {view}")
        pg = api.query(analysis_postgres_url, f"SELECT * FROM {view}")
        assert duck.columns == pg.columns, view
        drop = [c for c in duck.columns if c.endswith("_at") or c == "minute"]
        key = [c for c in duck.columns if c not in drop]
        a, b = duck.drop(drop).sort(key), pg.drop(drop).sort(key)
        assert a.shape == b.shape, view
        for col in a.columns:
            left, right = a[col].to_list(), b[col].to_list()
            if a[col].dtype.is_float():
                assert [x is None for x in left] == [x is None for x in right], (view, col)
                pairs = [(x, y) for x, y in zip(left, right, strict=True) if x is not None]
                assert [x for x, _ in pairs] == pytest.approx([y for _, y in pairs]), (view, col)
            else:
                assert left == right, (view, col)


def test_concurrent_first_readers_create_the_views_once(analysis_empty_postgres_url) -> None:
    """Several readers of a store without views: all succeed, the DDL runs safely once."""
    from concurrent.futures import ThreadPoolExecutor

    from sandpiper.analysis.views import VIEWS_VERSION

    def read(_: int) -> int:
        return api.episodes(analysis_empty_postgres_url).height

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert list(pool.map(read, range(8))) == [0] * 8
    version = api.query(analysis_empty_postgres_url, "SELECT version FROM analysis_views_version")
    assert version["version"].to_list() == [VIEWS_VERSION]


def test_gateway_episodes(analysis_store_url: str, analysis_run) -> None:
    want = {
        e.episode_id: e.reward_breakdown["gateway"]
        for e in analysis_run.episodes
        if "gateway" in e.reward_breakdown
    }
    df = api.query(analysis_store_url, "SELECT * FROM gateway_episodes")
    assert sorted(df["episode_id"]) == sorted(want)
    for row in df.iter_rows(named=True):
        stats = want[row["episode_id"]]
        assert row["calls"] == stats["calls"] and row["segments"] == stats["segments"]
        assert row["retokenization_mismatches"] == stats["retokenization_mismatches"]
