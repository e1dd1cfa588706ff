"""The Python API of analysis: every function returns a polars DataFrame (for notebooks).

Each function takes a :class:`sandpiper.store.Store` or a store URL and an optional ``run_id``
(None = every run), opens one short read-only connection and reads one analysis view
(see :mod:`sandpiper.analysis.views` for what each row means)::

    from sandpiper.analysis import api

    url = "duckdb:///runs/store.duckdb"
    api.reward_by_version(url, run_id="local")          # reward and pass rate per version
    api.episodes(url).filter(pl.col("outcome") == "max_turns")
    api.query(url, "SELECT tool, error_rate FROM tool_usage ORDER BY error_rate DESC")

:func:`episode` returns everything ``sandpiper show`` prints about one episode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sandpiper.analysis.query import QueryError, fetch, reader, run_sql
from sandpiper.store import text as store_text

if TYPE_CHECKING:
    import polars as pl
    import sqlalchemy as sa

    from sandpiper.store import Store

# view name -> ORDER BY of its public function (stable row order for people and tests)
_ORDER = {
    "episode_summary": "started_at, episode_id",
    "reward_by_version": "run_id, policy_version",
    "reward_by_time": "run_id, minute",
    "pass_rate_by_task": "run_id, task_id",
    "tool_usage": "run_id, n_calls DESC, tool",
    "failure_kinds": "run_id, level, n DESC, kind",
    "group_staleness": "run_id, consumed_by_step, group_id",
    "staleness_histogram": "run_id, status, staleness",
    "importance_weights": "run_id, step",
    "group_reward_variance": "run_id, min_policy_version, group_id",
    "zero_variance_share": "run_id, policy_version",
}


def read_view(conn: sa.Connection, view: str, run_id: str | None = None) -> pl.DataFrame:
    """Rows of ``view`` (optionally of one run) on an open connection from :func:`reader`."""
    where = " WHERE run_id = :run_id" if run_id is not None else ""
    return fetch(conn, f"SELECT * FROM {view}{where} ORDER BY {_ORDER[view]}", {"run_id": run_id})


def _view(store: Store | str, view: str, run_id: str | None) -> pl.DataFrame:
    with reader(store) as conn:
        return read_view(conn, view, run_id)


def query(store: Store | str, sql: str, params: dict[str, Any] | None = None) -> pl.DataFrame:
    """Any read-only SQL (views included); ``:name`` placeholders take ``params``."""
    return run_sql(store, sql, params)


def runs(store: Store | str) -> pl.DataFrame:
    """One row per run: id, created_at, code version, episode and policy counts."""
    sql = """
SELECT r.run_id, r.created_at, r.code_version,
       (SELECT count(*) FROM episodes e WHERE e.run_id = r.run_id) AS n_episodes,
       (SELECT max(version) FROM policies p WHERE p.run_id = r.run_id) AS latest_version
FROM runs r ORDER BY r.created_at"""
    with reader(store) as conn:
        return fetch(conn, sql)


def episodes(store: Store | str, *, run_id: str | None = None) -> pl.DataFrame:
    """``episode_summary``: one row per episode (outcome, reward, tokens, timings, tools)."""
    return _view(store, "episode_summary", run_id)


def reward_by_version(store: Store | str, *, run_id: str | None = None) -> pl.DataFrame:
    """Reward mean/std and pass rate per policy version that started the episode."""
    return _view(store, "reward_by_version", run_id)


def reward_by_time(store: Store | str, *, run_id: str | None = None) -> pl.DataFrame:
    """Reward and pass rate per minute of episode start."""
    return _view(store, "reward_by_time", run_id)


def pass_rate_by_task(store: Store | str, *, run_id: str | None = None) -> pl.DataFrame:
    """Pass rate, mean reward and infra failures per task."""
    return _view(store, "pass_rate_by_task", run_id)


def top_failing_tasks(
    store: Store | str, *, run_id: str | None = None, n: int = 10
) -> pl.DataFrame:
    """The ``n`` tasks with the lowest pass rate (most valid episodes first among ties)."""
    import polars as pl

    tasks = pass_rate_by_task(store, run_id=run_id)
    return (
        tasks.filter(pl.col("n_valid") > 0)
        .sort(["pass_rate", "n_valid"], descending=[False, True])
        .head(n)
    )


def tool_usage(store: Store | str, *, run_id: str | None = None) -> pl.DataFrame:
    """Calls, errors, time-outs, non-zero exits and duration percentiles per tool."""
    return _view(store, "tool_usage", run_id)


def failure_kinds(store: Store | str, *, run_id: str | None = None) -> pl.DataFrame:
    """Non-passing episode outcomes and tool-call error kinds with counts and shares."""
    return _view(store, "failure_kinds", run_id)


def group_staleness(store: Store | str, *, run_id: str | None = None) -> pl.DataFrame:
    """Per consumed group: how many versions old it was when trained on."""
    return _view(store, "group_staleness", run_id)


def staleness(store: Store | str, *, run_id: str | None = None) -> pl.DataFrame:
    """Histogram: consumed groups per staleness, plus groups dropped as stale."""
    return _view(store, "staleness_histogram", run_id)


def importance_weights(store: Store | str, *, run_id: str | None = None) -> pl.DataFrame:
    """Importance-weight mean/min/max, ESS, clipped/masked fractions, KL per learner step."""
    return _view(store, "importance_weights", run_id)


def group_reward_variance(store: Store | str, *, run_id: str | None = None) -> pl.DataFrame:
    """Reward mean and variance per group; ``zero_variance`` groups give GRPO no signal."""
    return _view(store, "group_reward_variance", run_id)


def zero_variance_share(store: Store | str, *, run_id: str | None = None) -> pl.DataFrame:
    """Share of zero-variance groups per run and policy version."""
    return _view(store, "zero_variance_share", run_id)


@dataclass(frozen=True, slots=True)
class EpisodeDetail:
    """Everything stored about one episode, as ``sandpiper show`` prints it."""

    summary: dict[str, Any]
    """The episode's ``episode_summary`` row."""
    reward_breakdown: dict[str, Any]
    """Reward components as the reward function reported them ({} when not scored)."""
    turns: pl.DataFrame
    """One row per turn in order: role, text, n_tokens, token_ids, logprobs, policy_versions,
    trainable, started_at, duration_ms."""
    tool_calls: pl.DataFrame
    """One row per tool call: turn_index, call_index, name, arguments, output, ..."""


def episode(store: Store | str, episode_id: str) -> EpisodeDetail:
    """One episode by id or by a unique prefix of its id."""
    import json

    with reader(store) as conn:
        ids = fetch(
            conn,
            "SELECT episode_id FROM episodes WHERE episode_id LIKE :prefix ORDER BY episode_id "
            "LIMIT 6",
            {"prefix": episode_id.replace("%", "").replace("_", r"\_") + "%"},
        )["episode_id"].to_list()
        if episode_id in ids:
            ids = [episode_id]
        if not ids:
            raise QueryError(f"no episode {episode_id!r} in the store")
        if len(ids) > 1:
            raise QueryError(f"{episode_id!r} is ambiguous: {', '.join(ids[:5])}, ...")
        params = {"id": ids[0]}
        summary = fetch(conn, "SELECT * FROM episode_summary WHERE episode_id = :id", params)
        breakdown = fetch(
            conn, "SELECT reward_breakdown FROM episodes WHERE episode_id = :id", params
        )
        turns = fetch(
            conn,
            "SELECT turn_index, role, text, n_tokens, token_ids, logprobs, policy_version, "
            "policy_version_changes, trainable, started_at, duration_ms FROM turns "
            "WHERE episode_id = :id ORDER BY turn_index",
            params,
        )
        turns = _with_token_versions(turns)
        calls = fetch(
            conn,
            "SELECT turn_index, call_index, name, arguments, output, output_bytes_total, "
            "exit_code, duration_ms, timed_out, error_kind FROM tool_calls "
            "WHERE episode_id = :id ORDER BY turn_index, call_index",
            params,
        )
    raw = breakdown["reward_breakdown"][0]
    raw = json.loads(raw) if isinstance(raw, str) else dict(raw or {})
    return EpisodeDetail(
        summary=summary.row(0, named=True),
        reward_breakdown=store_text.readable_json(raw),
        turns=_readable(turns, "text"),
        tool_calls=_readable(calls, "name", "arguments", "output"),
    )


def _readable(frame: pl.DataFrame, *columns: str) -> pl.DataFrame:
    """Text columns as people should read them: the store's escape of NUL and lone
    surrogates undone (:mod:`sandpiper.store.text`; surrogates shown as ``\\udXXX``)."""
    import polars as pl

    return frame.with_columns(
        pl.Series(c, [store_text.readable(v) for v in frame[c].to_list()], dtype=pl.String)
        for c in columns
    )


def _with_token_versions(turns: pl.DataFrame) -> pl.DataFrame:
    """``policy_version`` + ``policy_version_changes`` → one ``policy_versions`` list per
    turn (one version per token; None where the logprobs are None: nothing was sampled)."""
    import polars as pl

    from sandpiper.store.packed import expand_versions

    versions = [
        None if lp is None else expand_versions(v, ch, n).tolist()
        for v, ch, n, lp in zip(
            turns["policy_version"].to_list(), turns["policy_version_changes"].to_list(),
            turns["n_tokens"].to_list(), turns["logprobs"].to_list(), strict=True,
        )
    ]  # fmt: skip
    col = pl.Series("policy_versions", versions, dtype=pl.List(pl.Int64))
    at = turns.columns.index("policy_version")
    turns = turns.drop("policy_version", "policy_version_changes")
    return turns.insert_column(at, col)
