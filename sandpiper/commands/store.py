"""``sandpiper store init | stats | migrate | export | dead | retry-dead``: manage the trajectory
store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from sandpiper.commands._common import (
    ConfigOption,
    cli_errors,
    command,
    name_store_in_errors,
    resolve_config,
)

UrlOption = Annotated[
    str | None,
    typer.Option("--url", help="Store URL (duckdb:///path or postgresql+psycopg://...); "
                 "overrides store.url of the config."),
]  # fmt: skip


def _open(ctx: typer.Context, config: Path | None, url: str | None):
    from sandpiper.store import Store

    cfg = resolve_config(config, ctx).store
    if url:
        name_store_in_errors(url)
    return Store(url or cfg.url, lock_timeout_s=cfg.lock_timeout_s)


def register(app: typer.Typer) -> None:
    store_app = typer.Typer(help="Create, inspect, migrate and export the store.",
                            no_args_is_help=True)  # fmt: skip
    app.add_typer(store_app, name="store")

    @command(store_app, "init")
    def init(ctx: typer.Context, config: ConfigOption = None, url: UrlOption = None) -> None:
        """Create the store's schema if it has none (safe to run again)."""
        with cli_errors():
            store = _open(ctx, config, url)
            store.init()
            typer.echo(f"store ready: {store.url} (schema version {store.schema_version()})")

    @command(store_app, "stats")
    def stats(ctx: typer.Context, config: ConfigOption = None, url: UrlOption = None) -> None:
        """Print row counts, groups per status and the schema version as JSON."""
        with cli_errors():
            stats = _open(ctx, config, url).stats()
            typer.echo(json.dumps(stats, indent=2))
            if stats.get("dead_groups"):
                typer.secho(
                    f"WARNING: {stats['dead_groups']} dead group(s) set aside; see "
                    "`sandpiper store dead`, fix the cause, then `sandpiper store retry-dead`",
                    err=True, fg="red",
                )  # fmt: skip

    @command(store_app, "migrate")
    def migrate(ctx: typer.Context, config: ConfigOption = None, url: UrlOption = None) -> None:
        """Apply pending schema migrations in one transaction (back the store up first)."""
        with cli_errors():
            applied = _open(ctx, config, url).migrate()
            typer.echo(f"applied migrations: {applied}" if applied else "schema is up to date")

    @command(store_app, "export")
    def export(
        ctx: typer.Context,
        parquet: Annotated[Path, typer.Option("--parquet", help="Output directory.")],
        config: ConfigOption = None,
        url: UrlOption = None,
    ) -> None:
        """Export every table to Parquet, partitioned by policy version."""
        with cli_errors():
            rows = _open(ctx, config, url).export_parquet(parquet)
            typer.echo(json.dumps(rows))

    @command(store_app, "dead")
    def dead(
        ctx: typer.Context,
        run: Annotated[str | None, typer.Option("--run", help="Only this run.")] = None,
        config: ConfigOption = None,
        url: UrlOption = None,
    ) -> None:
        """List the dead groups: set aside by a writer that could not commit them, or by a
        learner that could not read them (one JSON object a line, with the error)."""
        with cli_errors():
            for d in _open(ctx, config, url).dead_letters.all(run):
                row = {k: getattr(d, k) for k in d.__slots__}
                typer.echo(json.dumps(row, default=str, ensure_ascii=False))

    @command(store_app, "retry-dead")
    def retry_dead(
        ctx: typer.Context,
        run: Annotated[str | None, typer.Option("--run", help="Only this run.")] = None,
        group: Annotated[
            list[str] | None, typer.Option("--group", help="Only this group id (repeatable).")
        ] = None,
        config: ConfigOption = None,
        url: UrlOption = None,
    ) -> None:
        """Re-submit dead groups after fixing their cause: a writer's group is written again
        from the spool bytes kept with it, a learner's group becomes ready again. Prints each
        group's outcome; exits 1 if any is still dead."""
        with cli_errors():
            outcomes = _open(ctx, config, url).dead_letters.retry(run_id=run, group_ids=group)
            for gid, outcome in outcomes.items():
                typer.echo(f"{gid}\t{outcome}")
            failed = sum(o.startswith("failed") for o in outcomes.values())
            typer.echo(f"{len(outcomes) - failed} re-submitted, {failed} still dead", err=True)
            if failed:
                raise typer.Exit(1)
