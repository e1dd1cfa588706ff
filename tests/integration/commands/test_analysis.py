"""``sandpiper sql`` / ``show`` / ``report`` on the fixture store, on DuckDB and PostgreSQL."""

from __future__ import annotations

import io
import json
import threading

import polars as pl
import pytest
from typer.testing import CliRunner

from sandpiper.analysis import api
from sandpiper.cli import app

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPORT_PLOTS = {
    "reward_by_version", "reward_over_time", "pass_rate_by_task", "staleness",
    "importance_weights", "tool_usage", "failures", "episode_lengths",
}  # fmt: skip


def _run(url: str, *args: str):
    result = CliRunner().invoke(app, [*args, "--store.url", url, "--tracking.enabled", "false"])
    return result


def test_sql_formats(analysis_store_url: str, tmp_path) -> None:
    query = "SELECT policy_version, n_episodes, reward_mean FROM reward_by_version ORDER BY 1"
    expected = api.query(analysis_store_url, query)

    table = _run(analysis_store_url, "sql", query)
    assert table.exit_code == 0, table.output
    assert "reward_mean" in table.stdout and f"{expected.height} rows" in table.stdout

    csv = _run(analysis_store_url, "sql", query, "--format", "csv")
    assert csv.exit_code == 0, csv.output
    assert pl.read_csv(io.StringIO(csv.stdout)).equals(expected)

    js = _run(analysis_store_url, "sql", query, "-f", "json")
    assert js.exit_code == 0, js.output
    rows = json.loads(js.stdout)
    assert [r["policy_version"] for r in rows] == expected["policy_version"].to_list()

    out = tmp_path / "turns.parquet"
    pq = _run(analysis_store_url, "sql", "SELECT * FROM turns", "-f", "parquet", "--out", str(out))
    assert pq.exit_code == 0, pq.output
    turns = pl.read_parquet(out)
    assert turns.schema["token_ids"].is_nested() and turns.height > 0


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("DELETE FROM episodes", "read-only"),
        ("DROP VIEW episode_summary", "read-only"),
        ("SELECT 1; DELETE FROM episodes", "one statement"),
        ("SELEC * FROM episodes", "rejected"),
        ("SELECT no_such_column FROM episodes", "rejected"),
    ],
)
def test_sql_refuses_writes_and_explains_bad_sql(analysis_store_url, query, message) -> None:
    before = api.query(analysis_store_url, "SELECT count(*) AS n FROM episodes")["n"][0]
    result = _run(analysis_store_url, "sql", query)
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], lines
    assert api.query(analysis_store_url, "SELECT count(*) AS n FROM episodes")["n"][0] == before


def test_data_modifying_cte_is_refused_by_the_database(analysis_postgres_url: str) -> None:
    query = "WITH gone AS (DELETE FROM episodes RETURNING 1) SELECT count(*) FROM gone"
    result = _run(analysis_postgres_url, "sql", query)
    assert result.exit_code == 1 and "read-only" in result.stderr


def test_parquet_needs_out(analysis_duckdb_url: str) -> None:
    result = _run(analysis_duckdb_url, "sql", "SELECT 1", "--format", "parquet")
    assert result.exit_code == 1 and "--out" in result.stderr


def test_sql_reads_while_a_writer_commits(tmp_path) -> None:
    """Readers wait briefly for the writer's lock and never fail or see partial groups."""
    from sandpiper.store import Store
    from sandpiper.testing.synthetic import populate, synthetic_run

    url = f"duckdb:///{tmp_path / 'live.duckdb'}"
    store = Store(url)
    store.init()
    live = synthetic_run(seed=7, run_id="live", num_versions=3)
    writer = threading.Thread(target=populate, args=(store, live))
    writer.start()
    counts = []
    try:
        while writer.is_alive() or not counts:
            result = _run(url, "sql", "SELECT count(*) AS n FROM episodes", "-f", "csv")
            assert result.exit_code == 0, result.output
            counts.append(int(result.stdout.splitlines()[1]))
    finally:
        writer.join()
    group_size = len(live.groups[0].episodes)
    assert all(n % group_size == 0 for n in counts)  # whole groups only
    assert counts == sorted(counts)
    assert api.query(url, "SELECT count(*) AS n FROM episodes")["n"][0] == len(live.episodes)


def test_show_transcript(analysis_store_url: str) -> None:
    eps = api.episodes(analysis_store_url)
    spanning = eps.filter((eps["version_span"] > 0) & (eps["n_tool_calls"] > 0))["episode_id"][0]
    result = _run(analysis_store_url, "show", spanning[:10])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert spanning in out and "reward breakdown" in out and "tool call 0" in out
    assert "→" in out  # the policy-version spans of the turn that straddled an update
    invalid = eps.filter(~eps["valid"]).row(0, named=True)
    result = _run(analysis_store_url, "show", invalid["episode_id"])
    assert result.exit_code == 0 and "infra failure" in result.stdout
    assert invalid["error"] in result.stdout.replace("\n", " ") or "error" in result.stdout


def test_show_unknown_episode(analysis_duckdb_url: str) -> None:
    result = _run(analysis_duckdb_url, "show", "no-such-episode")
    assert result.exit_code == 1 and "no episode" in result.stderr


def test_report_has_every_plot(analysis_store_url: str, tmp_path) -> None:
    out = tmp_path / "report"
    result = _run(analysis_store_url, "report", "--out", str(out), "--run", "synthetic")
    assert result.exit_code == 0, result.output
    pngs = {p.stem: p.read_bytes() for p in out.glob("*.png")}
    assert set(pngs) == REPORT_PLOTS
    assert all(data.startswith(PNG_MAGIC) and len(data) > 5000 for data in pngs.values())
    html = (out / "index.html").read_text()
    assert html.count("data:image/png;base64,") == len(REPORT_PLOTS)
    for key in REPORT_PLOTS:
        assert f'data-plot="{key}"' in html
    assert "impossible-proof" in html  # the top failing tasks table


def test_report_of_an_empty_store(tmp_path) -> None:
    """A store with no episodes yet still renders every section (plots say "no data")."""
    from sandpiper.store import Store

    url = f"duckdb:///{tmp_path / 'empty.duckdb'}"
    Store(url).init()
    result = _run(url, "report", "--out", str(tmp_path / "report"))
    assert result.exit_code == 0, result.output
    assert {p.stem for p in (tmp_path / "report").glob("*.png")} == REPORT_PLOTS


def test_report_never_mixes_runs(tmp_path) -> None:
    from sandpiper.store import Store
    from sandpiper.testing.synthetic import populate, synthetic_run

    url = f"duckdb:///{tmp_path / 'two.duckdb'}"
    store = Store(url)
    store.init()
    for name in ("first", "second"):
        populate(store, synthetic_run(run_id=name, num_versions=1, groups_per_version=2))
    result = _run(url, "report", "--out", str(tmp_path / "r"))
    assert result.exit_code == 1 and "pick one with --run" in result.stderr
    result = _run(url, "report", "--out", str(tmp_path / "r"), "--run", "second")
    assert result.exit_code == 0, result.output
    assert "<code>second</code>" in (tmp_path / "r" / "index.html").read_text()
    result = _run(url, "report", "--out", str(tmp_path / "r"), "--run", "third")
    assert result.exit_code == 1 and "no run 'third'" in result.stderr
