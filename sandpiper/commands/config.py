"""``sandpiper config show`` (the resolved config) and ``sandpiper config docs`` (every field
with its bounds, as docs/configuration.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sandpiper.commands._common import ConfigOption, cli_errors, command, resolve_config
from sandpiper.config import load_config, to_toml


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
        from sandpiper.commands._config_doc import render

        typer.echo(render(), nl=False)

    @config_app.command("check")
    def check(
        config: Annotated[
            list[Path] | None, typer.Option("--config", "-c", help="Run config(s) to check.")
        ] = None,
        compose: Annotated[
            Path | None, typer.Option(help="Also check this compose file's vLLM service.")
        ] = None,
    ) -> None:
        """Run every vLLM server a config would launch (and the compose file's vLLM service)
        through the installed vLLM's own argument parser and model-config validation
        (``--max-model-len`` against the model's positions, dtype, ...), starting nothing.
        Exits 1 if any is refused."""
        from sandpiper.commands._launch_lines import compose_vllm_args, config_vllm_args

        with cli_errors():
            lines: dict[str, list[str]] = {}
            for path in config or []:
                lines.update(config_vllm_args(load_config(path), str(path)))
            if compose is not None:
                lines[f"{compose}: vllm"] = compose_vllm_args(compose)
        if not lines:
            raise typer.BadParameter("give --config FILE (repeatable) and/or --compose FILE")
        from sandpiper.collector.inference.launch_check import check_launch_lines

        failed = 0
        for name, error in check_launch_lines(lines).items():
            typer.echo(f"{name}: " + ("ok" if error is None else error))
            failed += error is not None
        if failed:
            raise typer.Exit(1)
