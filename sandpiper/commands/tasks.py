"""``sandpiper tasks import|list``: normalise task sources and inspect their splits."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sandpiper.commands._common import VerboseCommand, cli_errors
from sandpiper.commands._preflight import SOURCE_HINT, check_tasks

FORMATS = ("auto", "jsonl", "folder", "llm_in_sandbox", "trl_daytona")


def register(app: typer.Typer) -> None:
    tasks_app = typer.Typer(help="Import and inspect task sets.", no_args_is_help=True)
    app.add_typer(tasks_app, name="tasks")

    @tasks_app.command("import", cls=VerboseCommand)
    def import_(
        source: Annotated[Path, typer.Argument(help="JSONL file, task folder or folder of them.")],
        out: Annotated[Path, typer.Option("--out", "-o", help="Output folder.")],
        fmt: Annotated[
            str, typer.Option("--format", help=f"Source format: {', '.join(FORMATS)}.")
        ] = "auto",
        validation_fraction: Annotated[
            float, typer.Option(help="Fraction of tasks hashed into the validation split.")
        ] = 0.0,
        split_seed: Annotated[int, typer.Option(help="Seed of the hash split.")] = 0,
        task_data_dir: Annotated[
            Path | None,
            typer.Option(
                help="Folder of the task folders open-instruct rows name by task_id "
                "(default: the source's folder)."
            ),
        ] = None,
        strict: Annotated[
            bool,
            typer.Option(
                "--strict",
                help="Refuse the whole source when an LLM-in-Sandbox row's domain cannot be "
                "scored (instruct_follow, unknown), instead of skipping those rows into "
                "OUT/skipped.jsonl.",
            ),
        ] = False,
    ) -> None:
        """Write task folders and a ``tasks.jsonl`` index (with each task's split) to OUT.

        Reads peers' data as they write it, detected per record: Sandpiper JSONL (text or
        chat-message prompts), open-instruct task folders and dataset rows (env_config),
        LLM-in-Sandbox-RL rows and the
        rllm JSON array, TRL + Daytona code tasks (see docs/tasks.md). OUT must be new or
        empty; nothing is written unless every record converts, except rows of a domain
        that cannot be scored, which are skipped and listed (``--strict`` refuses them)."""
        from sandpiper.collector.tasks.importer import SKIPPED_FILE, import_tasks, skipped_rows

        with cli_errors():
            check_tasks(str(source), field="SRC", hint=SOURCE_HINT)
            tasks = import_tasks(
                source, out, fmt=fmt, validation_fraction=validation_fraction,
                split_seed=split_seed, task_data_dir=task_data_dir, strict=strict,
            )  # fmt: skip
        n_val = sum(t.split.value == "validation" for t in tasks)
        typer.echo(f"imported {len(tasks)} tasks into {out} ({n_val} validation)")
        skipped = skipped_rows(out)
        if skipped:
            typer.echo(
                f"skipped {len(skipped)} rows (kept in {out / SKIPPED_FILE}; --strict refuses "
                "them):"
            )
            for row in skipped:
                typer.echo(f"  {row['reason'][:200]}")

    @tasks_app.command("list", cls=VerboseCommand)
    def list_(
        source: Annotated[Path, typer.Argument(help="JSONL file, task folder or folder of them.")],
        validation_fraction: Annotated[
            float, typer.Option(help="Fraction of tasks hashed into the validation split.")
        ] = 0.0,
        split_seed: Annotated[int, typer.Option(help="Seed of the hash split.")] = 0,
    ) -> None:
        """Print one line per task: id, split, format, reward kind."""
        from sandpiper.collector.tasks.loading import load_tasks

        with cli_errors():
            check_tasks(str(source), field="SRC", hint=SOURCE_HINT)
            tasks = load_tasks(
                source, validation_fraction=validation_fraction, split_seed=split_seed
            )
        for t in tasks:
            typer.echo(f"{t.task_id}\t{t.split.value}\t{t.format}\t{t.reference.reward}")
