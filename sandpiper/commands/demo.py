"""``sandpiper demo``: the whole pipeline on the tiny model (see :mod:`sandpiper.demo`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from collector.demo_tasks import COMPUTE_FRACTION
from sandpiper.commands._common import cli_errors, command, resolve_config

DEFAULT_CONFIG = Path("configs/demo.toml")


def register(app: typer.Typer) -> None:
    @command(app, "demo")
    def demo(
        ctx: typer.Context,
        config: Annotated[
            Path, typer.Option("--config", "-c", help="Demo config (TOML).")
        ] = DEFAULT_CONFIG,
        minutes: Annotated[float, typer.Option(help="Time budget of the GRPO phase.")] = 15.0,
        tasks: Annotated[int, typer.Option(help="Demo tasks (and SFT demonstrations).")] = 120,
        compute_fraction: Annotated[
            float, typer.Option(help="Share of the teacher's demonstrations that compute.")
        ] = COMPUTE_FRACTION,
        fresh: Annotated[
            bool,
            typer.Option(
                help="Delete an earlier demo of this name (run folders, DuckDB store) first; "
                "without it a rerun resumes where the earlier one stopped."
            ),
        ] = False,
    ) -> None:
        """Watch a tiny agent learn to use its sandbox: demonstrations, SFT, then GRPO with
        the collector and the learner running side by side. Ends with the reward by policy
        version, the HTML report and the MLflow run. Extra ``--part.field VALUE`` override."""
        from rich.console import Console
        from rich.live import Live
        from rich.table import Table

        from sandpiper import demo as d

        console = Console()
        cfg = resolve_config(config, ctx)
        with cli_errors():
            if fresh:
                for path in d.reset(cfg):
                    console.print(f"deleted {path}")
            elif cfg.run_dir.is_dir():
                console.print(f"resuming the demo in {cfg.run_dir} (--fresh starts over)")
            sft_cfg, grpo_cfg = d.prepare(cfg, tasks)
            started = time.monotonic()
            console.rule("[bold]1/3 demonstrations (real sandboxes, scripted demonstrator)")
            d.collect_demonstrations(sft_cfg, compute_fraction=compute_fraction)
            console.rule("[bold]2/3 SFT warm start (sandpiper learn --algo sft)")
            grpo_cfg.learner.model = d.run_sft(sft_cfg, cfg.run_dir / "sft.log")
            console.print(f"warm-started policy: {grpo_cfg.learner.model}")
            console.rule("[bold]3/3 GRPO: collector and learner side by side")

            def table() -> Table:
                frame = d.reward_table(cfg.store.url, grpo_cfg.name)
                elapsed = time.monotonic() - started
                out = Table(title=f"reward by policy version ({elapsed / 60:.1f} min)")
                for column in frame.columns:
                    out.add_column(column)
                for row in frame.iter_rows():
                    out.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row))
                return out

            with Live(table(), console=console, refresh_per_second=1) as live:
                d.run_grpo(grpo_cfg, minutes=minutes, on_tick=lambda: live.update(table()))
            from analysis.report import build_report

            report = build_report(cfg.store.url, cfg.run_dir / "report", run_id=grpo_cfg.name)
        console.print(table())
        console.print(f"HTML report: {report.html_path}")
        from trainer.tracking import default_uri

        uri = cfg.tracking.tracking_uri or default_uri(cfg.runs_dir)
        console.print(
            f"MLflow: {uri} (experiment {cfg.tracking.experiment!r}); "
            f"browse with: .venv/bin/mlflow ui --backend-store-uri {uri}"
        )
