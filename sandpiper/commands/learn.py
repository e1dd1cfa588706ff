"""``sandpiper learn``: run the learner (GRPO with importance correction, or SFT)."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from sandpiper.commands._common import ConfigOption, cli_errors, command, resolve_config


def register(app: typer.Typer) -> None:
    @command(app, "learn")
    def learn(
        ctx: typer.Context,
        config: ConfigOption = None,
        algo: Annotated[
            str | None, typer.Option(help="grpo or sft; overrides learner.algo.")
        ] = None,
        nproc: Annotated[
            int, typer.Option(help="Data-parallel processes (>1 uses the DeepSpeed launcher).")
        ] = 1,
    ) -> None:
        """Train policy versions from groups in the store and register each checkpoint.

        GRPO waits for batches of ready groups (within learner.max_lag versions), trains one
        version per batch and registers it with the consumed groups; it stops at
        learner.max_steps versions (0 = never). ``--algo sft`` fine-tunes once on episodes
        with reward >= learner.sft_min_reward and registers the result. Extra
        ``--part.field VALUE`` arguments override the config.
        """
        extra = list(ctx.args) + (["--learner.algo", algo] if algo else [])
        ctx.args = extra
        cfg = resolve_config(config, ctx)
        with cli_errors():
            from sandpiper.commands._preflight import check_memory, learner_ready

            learner_ready(cfg)
            check_memory(cfg, role="learner", nproc=nproc)
        if nproc > 1:
            from sandpiper.trainer.engine import free_port

            launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
            argv = [
                launcher,
                "--num_gpus",
                str(nproc),
                "--no_local_rank",
                # DeepSpeed's default rendezvous port is 29500 for every launch: a second
                # learner on this host (a standby, another run) would fail with EADDRINUSE
                "--master_port",
                os.environ.get("MASTER_PORT") or str(free_port()),
                "--module",
                "sandpiper.trainer",
            ]
            argv += (["--config", str(config)] if config else []) + extra
            os.execv(launcher, argv)
        with cli_errors():
            from sandpiper.trainer.main import run_learner

            steps = run_learner(cfg.for_learner())
        typer.echo(f"learner finished after {steps} step(s) in this process")
