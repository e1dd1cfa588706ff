"""``sandpiper store init | stats | migrate | export``: manage the trajectory store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from sandpiper.commands._common import ConfigOption, cli_errors, command, resolve_config

UrlOption = Annotated[
    str | None,
    typer.Option("--url", help="Store URL (duckdb:///path or postgresql+psycopg://...); "
                 "overrides store.url of the config."),
]  # fmt: skip


def _open(ctx: typer.Context, config: Path | None, url: str | None):
    from sandpiper.store import Store

    cfg = resolve_config(config, ctx).store
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
            typer.echo(json.dumps(_open(ctx, config, url).stats(), indent=2))

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
            from sandpiper.store.export import export_parquet

            rows = export_parquet(_open(ctx, config, url), parquet)
            typer.echo(json.dumps(rows))
