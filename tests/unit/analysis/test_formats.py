"""Output formats, transcripts and plots on small in-memory frames (no store)."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime

import polars as pl
import pytest
from rich.console import Console

from sandpiper.analysis import plots
from sandpiper.analysis.api import EpisodeDetail
from sandpiper.analysis.formats import MAX_TABLE_ROWS, OutputFormat, write_frame
from sandpiper.analysis.query import QueryError
from sandpiper.analysis.transcript import format_spans, render, version_spans

FRAME = pl.DataFrame({"name": ["a", "b"], "reward": [0.5, None], "ids": [[1, 2], [3]]})


def test_csv_writes_nested_columns_as_json() -> None:
    out = io.StringIO()
    write_frame(FRAME, OutputFormat.CSV, file=out)
    back = pl.read_csv(io.StringIO(out.getvalue()))
    assert back["name"].to_list() == ["a", "b"]
    assert [json.loads(v) for v in back["ids"]] == [[1, 2], [3]]


def test_json_keeps_nesting_and_nulls() -> None:
    out = io.StringIO()
    write_frame(FRAME, OutputFormat.JSON, file=out)
    assert json.loads(out.getvalue()) == [
        {"name": "a", "reward": 0.5, "ids": [1, 2]},
        {"name": "b", "reward": None, "ids": [3]},
    ]


def test_table_shows_rows_and_caps_long_results() -> None:
    out = io.StringIO()
    write_frame(pl.DataFrame({"x": range(MAX_TABLE_ROWS + 5)}), OutputFormat.TABLE, file=out)
    text = out.getvalue()
    assert f"{MAX_TABLE_ROWS + 5} rows (showing {MAX_TABLE_ROWS}" in text


def test_parquet_round_trip_and_needs_a_file(tmp_path) -> None:
    with pytest.raises(QueryError, match="--out"):
        write_frame(FRAME, OutputFormat.PARQUET)
    write_frame(FRAME, OutputFormat.PARQUET, out=tmp_path / "x.parquet")
    assert pl.read_parquet(tmp_path / "x.parquet").equals(FRAME)


def test_version_spans() -> None:
    assert version_spans([3, 3, 4, 4, 4]) == [(3, 2), (4, 3)]
    assert version_spans(None) == []
    assert format_spans([1, 1, 2]) == "v1×2 → v2×1"


def _detail(error: str | None) -> EpisodeDetail:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    summary = {
        "episode_id": "e1", "run_id": "r", "group_id": "r/t/0", "sample_index": 0,
        "task_id": "t", "task_format": "folder", "outcome": "passed", "stop_reason": "submitted",
        "reward": 1.0, "valid": error is None, "min_policy_version": 1, "max_policy_version": 2,
        "completion_tokens": 3, "total_tokens": 5, "n_turns": 2, "n_tool_calls": 1,
        "n_tool_errors": 1, "n_tool_timeouts": 1, "started_at": at, "duration_ms": 1500.0,
        "tool_ms": 30000.0, "sandbox_id": None, "group_status": "ready",
        "consumed_by_step": None, "error": error,
    }  # fmt: skip
    turns = pl.DataFrame({
        "turn_index": [0, 1], "role": ["user", "assistant"], "text": ["hi [b]x[/b]", "run it"],
        "n_tokens": [2, 3], "token_ids": [[1, 2], [3, 4, 5]], "logprobs": [None, [-0.1] * 3],
        "policy_versions": [None, [1, 1, 2]], "trainable": [False, True],
        "started_at": [at, at], "duration_ms": [0.0, 12.0],
    })  # fmt: skip
    calls = pl.DataFrame({
        "turn_index": [1], "call_index": [0], "name": ["execute_bash"],
        "arguments": ['{"command": "sleep 99"}'], "output": ["x" * 50],
        "output_bytes_total": [9999], "exit_code": [None], "duration_ms": [30000.0],
        "timed_out": [True], "error_kind": ["timed_out"],
    }, schema_overrides={"exit_code": pl.Int64})  # fmt: skip
    return EpisodeDetail(summary, {"tests_passed": 1}, turns, calls)


def test_transcript_shows_turns_calls_and_spans() -> None:
    console = Console(record=True, width=120)
    render(_detail(None), console, max_output_chars=10)
    text = console.export_text()
    for expected in ("turn 1 · assistant · 3 tokens · v1×2 → v2×1", "TIMED OUT",
                     "error: timed_out", "9999 bytes", "(40 more chars)", "hi [b]x[/b]",
                     "tests_passed"):  # fmt: skip
        assert expected in text, expected


def test_transcript_shows_infra_errors_verbatim() -> None:
    console = Console(record=True, width=120)
    render(_detail("OOM [killed] by kernel"), console)
    text = console.export_text()
    assert "OOM [killed] by kernel" in text and "infra failure" in text


EMPTY = {
    "reward_by_version": pl.DataFrame(schema={"policy_version": pl.Int64, "reward_mean": pl.Float64,
                                              "reward_std": pl.Float64, "pass_rate": pl.Float64}),
    "reward_over_time": pl.DataFrame(schema={"minute": pl.Datetime, "reward_mean": pl.Float64,
                                             "pass_rate": pl.Float64}),
    "pass_rate_by_task": pl.DataFrame(schema={"task_id": pl.String, "n_valid": pl.Int64,
                                              "pass_rate": pl.Float64}),
    "staleness": pl.DataFrame(schema={"staleness": pl.Int64, "status": pl.String,
                                      "n_groups": pl.Int64}),
    "importance_weights": pl.DataFrame(schema={"step": pl.Int64}),
    "tool_usage": pl.DataFrame(schema={"tool": pl.String}),
    "failure_breakdown": pl.DataFrame(schema={"level": pl.String}),
    "episode_lengths": pl.DataFrame(schema={"n_turns": pl.Int64}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(EMPTY))
def test_plots_of_an_empty_run_say_no_data(name: str) -> None:
    fig = getattr(plots, name)(EMPTY[name])
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "no data yet" in texts
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    assert buffer.getvalue().startswith(b"\x89PNG")


def test_report_never_shows_the_store_password() -> None:
    from sandpiper.analysis.report import _safe_url

    shown = _safe_url("postgresql+psycopg://alice:s3cret@db.example/sandpiper")
    assert "s3cret" not in shown and "alice@" not in shown.replace("alice:***@", "")
    assert shown.startswith("postgresql+psycopg://alice:")
