"""``sandpiper model init-tiny DIR``: build the tiny random-weight policy model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    model_app = typer.Typer(help="Build and inspect policy models.", no_args_is_help=True)
    app.add_typer(model_app, name="model")

    @model_app.command("init-tiny")
    def init_tiny(
        out_dir: Annotated[Path, typer.Argument(help="Folder to write the model into.")],
        seed: Annotated[int, typer.Option(help="Weight initialisation seed.")] = 0,
    ) -> None:
        """Write a ~1M-parameter random Qwen2 model, BPE tokenizer and tool chat template.

        The same seed writes byte-identical files."""
        from sandpiper.tiny_model import count_parameters, init_tiny_model

        path = init_tiny_model(out_dir, seed=seed)
        typer.echo(f"wrote {path} ({count_parameters(path):,} parameters, seed {seed})")
