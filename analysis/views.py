"""SQL views over the store that answer the usual questions about a run.

The views are plain SQL over the tables of :mod:`sandpiper.store.schema`, written once for both
backends; only JSON access differs (see :func:`_json_float`). They are created with the
store (``store.Store.init`` calls :func:`create_views`) so that any SQL client sees them,
and re-created on every ``init`` (``CREATE OR REPLACE``), so a schema migration that
changes a column only needs the matching edit here.

Views, in dependency order (each is documented in :data:`VIEW_DOCS`):

- ``group_status``         groups joined with their claim state.
- ``episode_summary``      one row per episode: outcome, reward, tokens, tool-call counts.
- ``reward_by_version``    reward and pass rate per policy version that started the episode.
- ``reward_by_time``       the same per minute of episode start.
- ``pass_rate_by_task``    pass rate, reward and failures per task.
- ``tool_usage``           calls, errors, time-outs, non-zero exits and durations per tool.
- ``failure_kinds``        episode outcomes other than ``passed``, and tool-call error kinds.
- ``group_staleness``      per consumed group: versions between sampling and training.
- ``staleness_histogram``  consumed and dropped groups per staleness.
- ``importance_weights``   importance-weight statistics per learner step (metrics JSON).
- ``group_reward_variance``reward variance of each group; ``zero_variance`` groups carry no
  GRPO signal.
- ``zero_variance_share``  share of zero-variance groups per run and policy version.
- ``gateway_episodes``     external-agent episodes: calls, segments, re-tokenization mismatches.

An episode **passes** when it is valid and its reward is at least :data:`PASS_REWARD`
(full marks). Invalid episodes (infrastructure failures) are counted but never averaged as 0.
"""

from __future__ import annotations

from typing import Any

from sandpiper.store.records import MIN_VALID_EPISODES
from sandpiper.store.step_metrics import StepMetrics

PASS_REWARD = 1.0
"""Reward at or above which a valid episode counts as passed (rewards are in [0, 1])."""

IMPORTANCE_METRICS = StepMetrics.view_columns()
"""Column of the ``importance_weights`` view -> key of ``learner_steps.metrics``, taken from
the declaration the learner writes by (:class:`sandpiper.store.step_metrics.StepMetrics`)."""

BAD_SAMPLER_OUTPUT = "bad_sampler_output"
"""``records.StopReason.BAD_SAMPLER_OUTPUT``: the store found a non-finite logprob or version
on a sampled token at ingest (an infra failure; the report counts these separately)."""

SUPPORTED_DIALECTS = ("duckdb", "postgresql")


def _json_float(column: str, key: str, dialect: str) -> str:
    """A JSON member as a double; NULL when absent. DuckDB JSON and PostgreSQL JSONB both
    have ``->>`` (member as text), but the cast that tolerates junk differs."""
    if dialect == "duckdb":
        return f"TRY_CAST({column} ->> '{key}' AS DOUBLE)"
    return f"CAST({column} ->> '{key}' AS DOUBLE PRECISION)"


def _json_int(column: str, path: tuple[str, ...], dialect: str) -> str:
    """A nested JSON member as an integer; NULL when absent."""
    if dialect == "duckdb":
        return f"TRY_CAST(json_extract_string({column}, '$.{'.'.join(path)}') AS INTEGER)"
    return f"CAST({column} #>> '{{{','.join(path)}}}' AS INTEGER)"


def _float(expr: str) -> str:
    # PostgreSQL's avg/sum of integers is NUMERIC (Decimal in Python); keep every ratio a
    # double on both backends so DataFrames get Float64 columns.
    return f"CAST({expr} AS DOUBLE PRECISION)"


def _view_sql(dialect: str) -> dict[str, str]:
    passed = f"(e.valid AND e.reward >= {PASS_REWARD})"
    importance_cols = ",\n    ".join(
        f"{_json_float('ls.metrics', key, dialect)} AS {column}"
        for column, key in IMPORTANCE_METRICS.items()
    )
    return {
        "group_status": """
SELECT g.*, s.status, s.claim_id, s.claimed_by, s.consumed_by_step, s.updated_at AS status_at
FROM groups g LEFT JOIN group_states s ON s.group_id = g.group_id""",
        "episode_summary": f"""
WITH calls AS (
  SELECT episode_id,
         count(*) AS n_tool_calls,
         count(*) FILTER (WHERE error_kind <> 'none') AS n_tool_errors,
         count(*) FILTER (WHERE timed_out) AS n_tool_timeouts,
         {_float("sum(duration_ms)")} AS tool_ms
  FROM tool_calls GROUP BY episode_id
)
SELECT e.episode_id, e.run_id, e.group_id, e.task_id, t.format AS task_format, g.split,
       e.sample_index, e.stop_reason, e.valid, e.trainable, e.reward,
       {passed} AS passed,
       CASE WHEN NOT e.valid THEN e.stop_reason
            WHEN {passed} THEN 'passed'
            WHEN e.stop_reason = 'submitted' THEN 'wrong_answer'
            ELSE e.stop_reason END AS outcome,
       e.min_policy_version, e.max_policy_version,
       e.max_policy_version - e.min_policy_version AS version_span,
       e.n_turns, e.completion_tokens, e.total_tokens,
       e.started_at, e.duration_ms,
       COALESCE(c.n_tool_calls, 0) AS n_tool_calls,
       COALESCE(c.n_tool_errors, 0) AS n_tool_errors,
       COALESCE(c.n_tool_timeouts, 0) AS n_tool_timeouts,
       COALESCE(c.tool_ms, 0) AS tool_ms,
       gs.status AS group_status, gs.consumed_by_step,
       e.sandbox_id, e.error
FROM episodes e
LEFT JOIN calls c ON c.episode_id = e.episode_id
LEFT JOIN groups g ON g.group_id = e.group_id
LEFT JOIN group_states gs ON gs.group_id = e.group_id
LEFT JOIN tasks t ON t.task_id = e.task_id""",
        "reward_by_version": f"""
SELECT run_id, min_policy_version AS policy_version,
       count(*) AS n_episodes,
       count(*) FILTER (WHERE valid) AS n_valid,
       count(*) FILTER (WHERE NOT valid) AS n_invalid,
       {_float("avg(reward) FILTER (WHERE valid)")} AS reward_mean,
       {_float("stddev_samp(reward) FILTER (WHERE valid)")} AS reward_std,
       {_float("avg(CASE WHEN passed THEN 1.0 ELSE 0.0 END) FILTER (WHERE valid)")} AS pass_rate,
       {_float("avg(completion_tokens)")} AS completion_tokens_mean,
       min(started_at) AS first_started_at
FROM episode_summary
WHERE min_policy_version IS NOT NULL
GROUP BY run_id, min_policy_version""",
        "reward_by_time": f"""
SELECT run_id, date_trunc('minute', started_at) AS minute,
       count(*) AS n_episodes,
       count(*) FILTER (WHERE valid) AS n_valid,
       {_float("avg(reward) FILTER (WHERE valid)")} AS reward_mean,
       {_float("avg(CASE WHEN passed THEN 1.0 ELSE 0.0 END) FILTER (WHERE valid)")} AS pass_rate,
       max(max_policy_version) AS max_policy_version
FROM episode_summary
GROUP BY run_id, date_trunc('minute', started_at)""",
        "pass_rate_by_task": f"""
SELECT run_id, task_id, max(task_format) AS task_format,
       count(*) AS n_episodes,
       count(*) FILTER (WHERE valid) AS n_valid,
       count(*) FILTER (WHERE NOT valid) AS n_invalid,
       count(*) FILTER (WHERE passed) AS n_passed,
       {_float("avg(CASE WHEN passed THEN 1.0 ELSE 0.0 END) FILTER (WHERE valid)")} AS pass_rate,
       {_float("avg(reward) FILTER (WHERE valid)")} AS reward_mean,
       max(max_policy_version) AS last_policy_version
FROM episode_summary
GROUP BY run_id, task_id""",
        "tool_usage": f"""
SELECT e.run_id, c.name AS tool,
       count(*) AS n_calls,
       count(*) FILTER (WHERE c.error_kind <> 'none') AS n_errors,
       count(*) FILTER (WHERE c.timed_out) AS n_timeouts,
       count(*) FILTER (WHERE c.exit_code IS NOT NULL AND c.exit_code <> 0) AS n_nonzero_exit,
       {_float("avg(CASE WHEN c.error_kind <> 'none' THEN 1.0 ELSE 0.0 END)")} AS error_rate,
       {_float("avg(c.duration_ms)")} AS duration_ms_mean,
       {_float("percentile_cont(0.5) WITHIN GROUP (ORDER BY c.duration_ms)")} AS duration_ms_p50,
       {_float("percentile_cont(0.95) WITHIN GROUP (ORDER BY c.duration_ms)")} AS duration_ms_p95,
       {_float("max(c.duration_ms)")} AS duration_ms_max,
       {_float("avg(c.output_bytes_total)")} AS output_bytes_mean,
       count(*) FILTER (WHERE c.output_bytes_total > length(c.output)) AS n_truncated
FROM tool_calls c JOIN episodes e ON e.episode_id = c.episode_id
GROUP BY e.run_id, c.name""",
        "failure_kinds": f"""
WITH kinds AS (
  SELECT run_id, 'episode' AS level, outcome AS kind, NOT valid AS infra
  FROM episode_summary WHERE outcome <> 'passed'
  UNION ALL
  SELECT e.run_id, 'tool_call' AS level, c.error_kind AS kind, false AS infra
  FROM tool_calls c JOIN episodes e ON e.episode_id = c.episode_id
  WHERE c.error_kind <> 'none'
)
SELECT run_id, level, kind, bool_or(infra) AS infra, count(*) AS n,
       {_float("count(*)")} / sum(count(*)) OVER (PARTITION BY run_id, level) AS share
FROM kinds GROUP BY run_id, level, kind""",
        "group_staleness": """
SELECT g.run_id, g.group_id, g.task_id, g.status, g.consumed_by_step,
       g.min_policy_version, g.max_policy_version,
       ls.policy_version - 1 AS trained_from_version,
       ls.policy_version - 1 - g.min_policy_version AS staleness
FROM group_status g
JOIN learner_steps ls ON ls.run_id = g.run_id AND ls.step = g.consumed_by_step
WHERE g.status = 'consumed'""",
        "staleness_histogram": """
SELECT run_id, staleness, status, count(*) AS n_groups
FROM (
  SELECT run_id, staleness, status FROM group_staleness
  UNION ALL
  SELECT run_id, CAST(NULL AS INTEGER) AS staleness, status
  FROM group_status WHERE status = 'dropped_stale'
) s
GROUP BY run_id, staleness, status""",
        "importance_weights": f"""
SELECT ls.run_id, ls.step, ls.policy_version, ls.n_groups, ls.created_at,
    {importance_cols}
FROM learner_steps ls""",
        "group_reward_variance": f"""
SELECT g.run_id, g.group_id, g.task_id, g.min_policy_version, g.status,
       count(e.episode_id) FILTER (WHERE e.valid) AS n_valid,
       {_float("avg(e.reward) FILTER (WHERE e.valid)")} AS reward_mean,
       {_float("var_pop(e.reward) FILTER (WHERE e.valid)")} AS reward_var,
       COALESCE(var_pop(e.reward) FILTER (WHERE e.valid) = 0, false) AS zero_variance
FROM group_status g JOIN episodes e ON e.group_id = g.group_id
GROUP BY g.run_id, g.group_id, g.task_id, g.min_policy_version, g.status""",
        "zero_variance_share": f"""
SELECT run_id, min_policy_version AS policy_version,
       count(*) AS n_groups,
       count(*) FILTER (WHERE zero_variance) AS n_zero_variance,
       {_float("avg(CASE WHEN zero_variance THEN 1.0 ELSE 0.0 END)")} AS zero_variance_share
FROM group_reward_variance
WHERE n_valid >= {MIN_VALID_EPISODES}
GROUP BY run_id, min_policy_version""",
        "gateway_episodes": f"""
SELECT run_id, task_id, episode_id, valid, reward, stop_reason, started_at,
       {_json_int("reward_breakdown", ("gateway", "calls"), dialect)} AS calls,
       {_json_int("reward_breakdown", ("gateway", "segments"), dialect)} AS segments,
       {_json_int("reward_breakdown", ("gateway", "retokenization_mismatches"), dialect)}
           AS retokenization_mismatches
FROM episodes
WHERE (reward_breakdown -> 'gateway') IS NOT NULL""",
    }


VIEW_DOCS: dict[str, str] = {
    "group_status": "groups joined with group_states (status, claim, consumed_by_step).",
    "episode_summary": "One row per episode: outcome, passed, reward, versions, tokens, "
    "timings, tool-call counts, group status.",
    "reward_by_version": "Episodes, valid/invalid counts, reward mean/std and pass rate per "
    "policy version that started the episode (min_policy_version).",
    "reward_by_time": "Reward and pass rate per minute of episode start.",
    "pass_rate_by_task": "Episodes, pass rate, mean reward and infra failures per task.",
    "tool_usage": "Calls, errors, time-outs, non-zero exits, duration percentiles and "
    "truncated outputs per tool.",
    "failure_kinds": "Counts and shares of non-passing episode outcomes (level 'episode') "
    "and tool-call error kinds (level 'tool_call'); infra outcomes include "
    f"'{BAD_SAMPLER_OUTPUT}' (non-finite sampler logprobs or versions, found at ingest).",
    "group_staleness": "Per consumed group: version trained from minus oldest sampled version.",
    "staleness_histogram": "Groups per staleness (consumed) plus dropped_stale groups.",
    "importance_weights": "Importance-weight statistics per learner step: "
    + ", ".join(IMPORTANCE_METRICS)
    + ".",
    "group_reward_variance": "Reward mean and variance of each group's valid episodes.",
    "zero_variance_share": f"Share of groups (>= {MIN_VALID_EPISODES} valid episodes) whose "
    "rewards are all equal.",
    "gateway_episodes": "Per episode of an external agent (through the gateway): model calls, "
    "training segments (> 1: the agent rewrote its history; the reasons are in "
    "reward_breakdown.gateway) and re-tokenization mismatches.",
}
"""One line per view: what a row is. ``sandpiper sql --views`` prints these."""

VIEW_NAMES: tuple[str, ...] = tuple(VIEW_DOCS)
"""All views in creation order (later views read earlier ones)."""

VIEWS_VERSION = 3
"""Bump whenever a view's SQL changes: readers re-create views whose marker differs."""

MARKER_VIEW = "analysis_views_version"
"""A one-row view holding :data:`VIEWS_VERSION`, created last (so it implies the others)."""


def view_statements(dialect: str, *, temporary: bool = False) -> list[str]:
    """``CREATE OR REPLACE [TEMP] VIEW`` statements for ``dialect``, in dependency order."""
    if dialect not in SUPPORTED_DIALECTS:
        raise ValueError(f"analysis views support {SUPPORTED_DIALECTS}, not {dialect!r}")
    kind = "TEMP VIEW" if temporary else "VIEW"
    sql = _view_sql(dialect)
    sql[MARKER_VIEW] = f"SELECT {VIEWS_VERSION} AS version"
    names = (*VIEW_NAMES, MARKER_VIEW)
    return [f"CREATE OR REPLACE {kind} {name} AS {sql[name].strip()}" for name in names]


def create_views(connection: Any, dialect: str, *, temporary: bool = False) -> None:
    """Create (or replace) every analysis view on ``connection``, a SQLAlchemy Connection
    inside a transaction that the caller commits.

    ``temporary`` creates session-local views instead, which DuckDB allows even on a
    read-only connection (used by readers of a store written before the views existed).
    """
    import sqlalchemy as sa

    if dialect == "postgresql" and not temporary:
        # CREATE OR REPLACE VIEW in PostgreSQL cannot change a view's columns; drop first.
        for name in (MARKER_VIEW, *reversed(VIEW_NAMES)):
            connection.execute(sa.text(f"DROP VIEW IF EXISTS {name} CASCADE"))
    for statement in view_statements(dialect, temporary=temporary):
        connection.execute(sa.text(statement))


def views_version(connection: Any) -> int | None:
    """The :data:`VIEWS_VERSION` the store's views were created with; None if absent."""
    import sqlalchemy as sa

    found = connection.execute(
        sa.text("SELECT count(*) FROM information_schema.tables WHERE table_name = :name"),
        {"name": MARKER_VIEW},
    ).scalar()
    if not found:
        return None
    return int(connection.execute(sa.text(f"SELECT version FROM {MARKER_VIEW}")).scalar())
