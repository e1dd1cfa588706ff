"""``sandpiper config show`` (the resolved config) and ``sandpiper config docs`` (every field
with its bounds, as docs/configuration.md)."""

from __future__ import annotations

import typer

from sandpiper.commands._common import ConfigOption, command, resolve_config
from sandpiper.config import to_toml


def register(app: typer.Typer) -> None:
    config_app = typer.Typer(help="Inspect run configs.", no_args_is_help=True)
    app.add_typer(config_app, name="config")

    @command(config_app, "show")
    def show(ctx: typer.Context, config: ConfigOption = None) -> None:
        """Print the resolved config as TOML. Extra ``--part.field VALUE`` args override it."""
        typer.echo(to_toml(resolve_config(config, ctx)), nl=False)

    @config_app.command("docs")
    def docs() -> None:
        """Print every section and field with its type, default, bounds and meaning, and the
        rules across fields, as Markdown (docs/configuration.md is this output)."""
        from sandpiper.config_doc import render

        typer.echo(render(), nl=False)
