"""``sandpiper replay``: compare loss / correction configurations on a run's stored batches."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sandpiper.commands._common import ConfigOption, cli_errors, command, resolve_config

FORMATS = ("table", "csv", "json")


def _steps(text: str | None) -> tuple[int, int] | None:
    from sandpiper.errors import ConfigError

    if text is None:
        return None
    first, colon, last = text.partition(":")
    try:
        a = int(first) if first else 0
        b = int(last) if colon and last else (a if not colon else 2**31 - 1)
    except ValueError:
        raise ConfigError(f"--steps {text!r}: expected N, A:B, A: or :B") from None
    if a > b:
        raise ConfigError(f"--steps {text!r}: the first step is after the last")
    return a, b


def register(app: typer.Typer) -> None:
    @command(app, "replay")
    def replay(
        ctx: typer.Context,
        run: Annotated[
            str | None, typer.Option("--run", help="Run id (default: the config's name).")
        ] = None,
        steps: Annotated[
            str | None,
            typer.Option(help="Learner steps: N, A:B (inclusive), A: or :B (default: the last 5)."),
        ] = None,
        variant: Annotated[
            list[str] | None,
            typer.Option(
                "--variant",
                "-v",
                help="NAME: field=value ... over the run's learner config (repeat); TOML "
                "values, e.g. \"gspo: objective='gspo' eps_low=3e-4\". Default: a built-in set.",
            ),
        ] = None,
        micro_batch_tokens: Annotated[
            int | None,
            typer.Option(help="Packed tokens per micro-batch (default: the run's)."),
        ] = None,
        fmt: Annotated[
            str, typer.Option("--format", "-f", help="table, csv or json (stdout).")
        ] = "table",
        per_step: Annotated[
            bool, typer.Option(help="Table: one row per step and variant, not the means.")
        ] = False,
        out: Annotated[
            Path | None,
            typer.Option(
                help="Folder for replay.json + replay.png (default: replay/ in the run folder)."
            ),
        ] = None,
        mlflow: Annotated[
            bool, typer.Option(help="Log an MLflow run when tracking is enabled.")
        ] = True,
        config: ConfigOption = None,
    ) -> None:
        """Evaluate loss/correction variants on the batches a run trained on, without training.

        For each learner step: reload the policy the step started from, rebuild its batch from
        the store and compute, per variant, the effective sample size of the IS weights, the
        masked / truncated / clipped fractions, the gradient norm, the gradient variance over
        micro-batches and the cosine to the gradient with untruncated importance weights (the
        unbiased reference). Prints a table (or CSV / JSON), writes replay.json and a plot
        (`sandpiper report` includes it) and an MLflow run. See docs/replay.md.
        """
        import sys

        with cli_errors():
            from sandpiper.errors import ConfigError

            if fmt not in FORMATS:
                raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
            cfg = resolve_config(config, ctx)
            run_id = run or cfg.name
            window = _steps(steps)

            import polars as pl

            from sandpiper.analysis.formats import OutputFormat, write_frame
            from sandpiper.analysis.plots import replay as replay_plot
            from sandpiper.store import Store
            from sandpiper.trainer import replay as rp
            from sandpiper.trainer.tracking import log_replay

            store = Store(cfg.store.url, lock_timeout_s=cfg.store.lock_timeout_s)
            base = rp.run_learner_config(store, run_id, cfg.learner)
            specs = variant or list(rp.DEFAULT_VARIANTS)
            variants = [rp.reference_variant(base)] + [rp.parse_variant(v, base) for v in specs]
            names = [v.name for v in variants]
            if len(set(names)) != len(names):
                raise ConfigError(f"variant names must be unique (and not 'reference'): {names}")
            if window is None:
                done = rp.consumed_steps(store, run_id, None)
                window = (done[-5].step, done[-1].step) if len(done) >= 5 else None

            def progress(step: int, rows: list[dict]) -> None:
                ref = rows[0]
                print(f"step {step}: {ref['tokens']} loss tokens, {ref['micro_batches']} "
                      f"micro-batches, {len(rows)} variants", file=sys.stderr)  # fmt: skip

            result = rp.replay_run(
                store, run_id, variants, steps=window,
                micro_batch_tokens=micro_batch_tokens or base.micro_batch_tokens,
                progress=progress,
            )  # fmt: skip
            for s in result.skipped:
                print(f"step {s['step']} skipped: {s['reason']}", file=sys.stderr)
            if not result.rows:
                raise ConfigError(f"no step of run {run_id!r} could be replayed")
            folder = out or (Path(cfg.runs_dir) / run_id / "replay")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "replay.json").write_text(result.to_json())
            summary = pl.DataFrame(result.summary(), infer_schema_length=None)
            replay_plot(summary).savefig(folder / "replay.png", format="png")
            print(f"wrote {folder / 'replay.json'} and replay.png", file=sys.stderr)
            if mlflow:
                mlflow_run = log_replay(
                    cfg.tracking, runs_dir=cfg.runs_dir, run_id=run_id,
                    variants=result.variants, rows=result.rows, summary=result.summary(),
                    artifacts=folder,
                )  # fmt: skip
                if mlflow_run:
                    print(f"logged to MLflow run {mlflow_run}", file=sys.stderr)
            rows = pl.DataFrame(result.rows, infer_schema_length=None)
            if fmt == "table":
                write_frame(rows if per_step else summary, OutputFormat.TABLE)
            else:
                write_frame(rows, OutputFormat(fmt))
