"""``sandpiper demo``: the whole pipeline on the tiny model, or on SmolLM2 with ``--model
smollm2`` (see :mod:`sandpiper.demo`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from sandpiper.commands._common import cli_errors, command, resolve_config
from sandpiper.commands._preflight import check_model, check_podman, check_server_ports
from sandpiper.demo.tasks import COMPUTE_FRACTION

PROGRESS_EVERY_S = 30.0
"""Without a terminal, a plain progress line at most this often (and on every new version)."""


def register(app: typer.Typer) -> None:
    @command(app, "demo")
    def demo(
        ctx: typer.Context,
        model: Annotated[
            str,
            typer.Option(
                help="tiny (1.3 M parameters, learns in minutes) or smollm2 "
                "(SmolLM2-135M-Instruct, bash-block actions)."
            ),
        ] = "tiny",
        config: Annotated[
            Path | None,
            typer.Option(
                "--config", "-c", help="Demo config (TOML); default: the --model's config."
            ),
        ] = None,
        minutes: Annotated[
            float | None,
            typer.Option(min=0.1, help="Time budget of the GRPO phase (default per model)."),
        ] = None,
        tasks: Annotated[
            int | None,
            typer.Option(min=1, help="Demo tasks and SFT demonstrations (default per model)."),
        ] = None,
        compute_fraction: Annotated[
            float,
            typer.Option(
                min=0.0, max=1.0, help="Share of the teacher's demonstrations that compute."
            ),
        ] = COMPUTE_FRACTION,
        fresh: Annotated[
            bool,
            typer.Option(
                help="Delete an earlier demo of this name (run folders, DuckDB store) first; "
                "without it a rerun resumes where the earlier one stopped."
            ),
        ] = False,
    ) -> None:
        """Watch an agent learn to use its sandbox: demonstrations, SFT, then GRPO with
        the collector and the learner running side by side. Ends with the reward by policy
        version, the HTML report and the MLflow run. Extra ``--part.field VALUE`` override."""
        from rich.console import Console

        from sandpiper.demo import run as d

        if model not in d.DEMO_MODELS:
            raise typer.BadParameter(f"--model must be one of {', '.join(d.DEMO_MODELS)}")
        spec = d.DEMO_MODELS[model]
        console = Console()
        cfg = resolve_config(config or spec.config, ctx)
        n_tasks = tasks if tasks is not None else spec.tasks
        with cli_errors():
            if fresh:
                for path in d.reset(cfg):
                    console.print(f"deleted {path}")
            elif cfg.run_dir.is_dir():
                console.print(f"resuming the demo in {cfg.run_dir} (--fresh starts over)")
            check_podman(cfg.sandbox.image)
            check_server_ports(cfg)
            sft_cfg, grpo_cfg = d.prepare(cfg, n_tasks, spec.sft_learner)
            check_model(cfg.learner.model)
            started = time.monotonic()
            console.rule("[bold]1/3 demonstrations (real sandboxes, scripted demonstrator)")
            d.collect_demonstrations(sft_cfg, compute_fraction=compute_fraction)
            console.rule("[bold]2/3 SFT warm start (sandpiper learn --algo sft)")
            grpo_cfg.learner.model = d.run_sft(sft_cfg, cfg.run_dir / "sft.log")
            console.print(f"warm-started policy: {grpo_cfg.learner.model}")
            console.rule("[bold]3/3 GRPO: collector and learner side by side")
            progress = _Progress(console, cfg.store.url, grpo_cfg.name, started)
            budget = minutes if minutes is not None else spec.minutes
            progress.run(lambda tick: d.run_grpo(grpo_cfg, minutes=budget, on_tick=tick))
            from sandpiper.analysis.report import build_report

            report = build_report(cfg.store.url, cfg.run_dir / "report", run_id=grpo_cfg.name)
        console.print(progress.table())
        console.print(f"HTML report: {report.html_path}")
        from sandpiper.trainer.tracking import default_uri

        uri = cfg.tracking.tracking_uri or default_uri(cfg.runs_dir)
        console.print(
            f"MLflow: {uri} (experiment {cfg.tracking.experiment!r}); "
            f"browse with: .venv/bin/mlflow ui --backend-store-uri {uri}"
        )


class _Progress:
    """The reward-by-version table: redrawn live on a terminal; elsewhere (a log file, CI)
    one plain line per new policy version, or every :data:`PROGRESS_EVERY_S` seconds."""

    def __init__(self, console, store_url: str, run_id: str, started: float) -> None:
        self.console, self.store_url, self.run_id, self.started = (
            console,
            store_url,
            run_id,
            started,
        )
        self._last_line = 0.0
        self._last_version: int | None = None

    def frame(self):
        from sandpiper.demo import run as d

        return d.reward_table(self.store_url, self.run_id)

    def table(self):
        from rich.table import Table

        frame = self.frame()
        out = Table(title=f"reward by policy version ({self._minutes():.1f} min)")
        for column in frame.columns:
            out.add_column(column)
        for row in frame.iter_rows():
            out.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row))
        return out

    def line(self) -> str | None:
        """A plain progress line, or None when there is nothing new to say yet."""
        frame = self.frame()
        now = time.monotonic()
        version = int(frame["policy_version"].max()) if frame.height else None
        if version == self._last_version and now - self._last_line < PROGRESS_EVERY_S:
            return None
        self._last_line, self._last_version = now, version
        if version is None:
            return f"[{self._minutes():5.1f} min] GRPO: waiting for the first episodes"
        last = frame.filter(frame["policy_version"] == version).row(0, named=True)
        total = int(frame["n_episodes"].sum())
        return (
            f"[{self._minutes():5.1f} min] GRPO: {total} episodes; newest sampling version "
            f"{version}: {last['n_episodes']} episodes, reward {last['reward_mean'] or 0:.3f}"
        )

    def run(self, body) -> None:
        if self.console.is_terminal:
            from rich.live import Live

            with Live(self.table(), console=self.console, refresh_per_second=1) as live:
                body(lambda: live.update(self.table()))
            return

        def tick() -> None:
            text = self.line()
            if text:
                print(text, flush=True)

        body(tick)

    def _minutes(self) -> float:
        return (time.monotonic() - self.started) / 60
