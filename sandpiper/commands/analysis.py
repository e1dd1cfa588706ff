"""``sandpiper sql``, ``sandpiper show`` and ``sandpiper report``: look at a run's store.

All three only read: they open the store read-only (on DuckDB briefly, under the store's
lock, so they work while the collector writes). The store comes from the config
(``--config``, or ``--store.url duckdb:///runs/store.duckdb`` as an override).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sandpiper.commands._common import ConfigOption, cli_errors, command, resolve_config

FORMATS = ("table", "csv", "json", "parquet")


def _store(ctx: typer.Context, config: Path | None):
    from sandpiper.store import Store

    cfg = resolve_config(config, ctx)
    return cfg, Store(cfg.store.url, lock_timeout_s=cfg.store.lock_timeout_s)


def _print_views() -> None:
    from rich.console import Console
    from rich.table import Table

    from sandpiper.analysis.views import VIEW_DOCS

    table = Table("view", "one row per / what", header_style="bold")
    for name, doc in VIEW_DOCS.items():
        table.add_row(name, doc)
    Console().print(table)


def register(app: typer.Typer) -> None:
    @command(app, "sql")
    def sql(
        ctx: typer.Context,
        query: Annotated[str | None, typer.Argument(help="One read-only SQL statement.")] = None,
        fmt: Annotated[
            str, typer.Option("--format", "-f", help="Output: table, csv, json or parquet.")
        ] = "table",
        out: Annotated[
            Path | None, typer.Option("--out", "-o", help="Write to this file (parquet needs it).")
        ] = None,
        views: Annotated[
            bool, typer.Option("--views", help="List the analysis views and exit.")
        ] = False,
        config: ConfigOption = None,
    ) -> None:
        """Run one read-only SQL query on the store (tables and analysis views).

        Example: sandpiper sql "SELECT * FROM reward_by_version" --store.url duckdb:///x.duckdb
        """
        if views:
            _print_views()
            return
        with cli_errors():
            from sandpiper.analysis.formats import OutputFormat, write_frame
            from sandpiper.analysis.query import QueryError, run_sql

            if fmt not in FORMATS:
                raise QueryError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
            if not query:
                raise QueryError('give a query, e.g. sandpiper sql "SELECT * FROM runs"')
            _, store = _store(ctx, config)
            output = OutputFormat(fmt)
            if output == OutputFormat.PARQUET and out is None:
                raise QueryError("--format parquet needs --out FILE (Parquet is binary)")
            if out is not None:
                out.parent.mkdir(parents=True, exist_ok=True)  # as `report --out` does
            write_frame(run_sql(store, query), output, out=out)

    @command(app, "show")
    def show(
        ctx: typer.Context,
        episode_id: Annotated[str, typer.Argument(help="Episode id (or a unique prefix).")],
        max_output_chars: Annotated[
            int, typer.Option(help="Shorten each tool output to this many characters.")
        ] = 2000,
        config: ConfigOption = None,
    ) -> None:
        """Print one episode's transcript: turns, tool calls, reward, versions, timings."""
        with cli_errors():
            from rich.console import Console

            from sandpiper.analysis.api import episode
            from sandpiper.analysis.transcript import render

            _, store = _store(ctx, config)
            render(episode(store, episode_id), Console(), max_output_chars=max_output_chars)

    @command(app, "report")
    def report(
        ctx: typer.Context,
        out: Annotated[Path, typer.Option("--out", "-o", help="Folder for index.html + PNGs.")],
        run: Annotated[
            str | None,
            typer.Option("--run", help="Run id to report on (default: the store's only run)."),
        ] = None,
        mlflow: Annotated[
            bool, typer.Option(help="Log the report to MLflow when tracking is enabled.")
        ] = True,
        replay: Annotated[
            Path | None,
            typer.Option(
                help="A `sandpiper replay` result (replay.json) to include; default: "
                "RUNS_DIR/RUN/replay/replay.json when it exists."
            ),
        ] = None,
        config: ConfigOption = None,
    ) -> None:
        """Write an HTML report with plots (reward, pass rates, staleness, IS weights, tools)."""
        with cli_errors():
            from sandpiper.analysis.report import build_report, log_to_mlflow

            cfg, store = _store(ctx, config)
            if replay is None:
                found = Path(cfg.runs_dir) / (run or cfg.name) / "replay" / "replay.json"
                replay = found if found.is_file() else None
            result = build_report(store, out, run_id=run, replay=replay)
            typer.echo(f"report: {result.html_path} ({len(result.png_paths)} plots)")
            if mlflow and cfg.tracking.enabled:
                mlflow_run = log_to_mlflow(result, cfg.tracking, runs_dir=cfg.runs_dir, run_id=run)
                typer.echo(f"logged to MLflow run {mlflow_run} (artifact path: report/)")
