"""``sandpiper learn``: run the learner (GRPO with importance correction, or SFT).

Placement: the learner's ranks run on ``learner.gpus`` (physical ids), else on the caller's
``CUDA_VISIBLE_DEVICES``; several ranks are launched with ``deepspeed --include
localhost:<ids>`` (never ``--num_gpus``, with which DeepSpeed drops ``CUDA_VISIBLE_DEVICES``
and takes GPUs 0..N-1), one rank runs in this process with ``CUDA_VISIBLE_DEVICES`` set.
``--dry-run`` prints that plan as JSON and starts nothing.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from sandpiper.commands._common import ConfigOption, cli_errors, command, resolve_config
from sandpiper.config import RunConfig


def learner_gpus(cfg: RunConfig, environ: Mapping[str, str]) -> list[int]:
    """The learner's physical GPU ids: ``learner.gpus``, else ``CUDA_VISIBLE_DEVICES``."""
    if cfg.learner.gpus:
        return list(cfg.learner.gpus)
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible or cfg.learner.device == "cpu":
        return []
    try:
        ids = [int(x) for x in visible.split(",") if x.strip()]
    except ValueError:  # UUIDs: leave the variable to do the placement
        return []
    return ids if all(i >= 0 for i in ids) else []  # "-1" hides every GPU: no placement


def learner_launch(
    cfg: RunConfig,
    *,
    config_path: str | None,
    extra: list[str],
    nproc: int,
    environ: Mapping[str, str],
    master_port: str,
) -> dict[str, Any]:
    """The learner's process: ``{"name", "argv", "cwd", "env"}`` (``env``: what is set over
    the caller's environment); ``argv`` is None when it runs in this process."""
    env: dict[str, str] = {}
    argv: list[str] | None = None
    if "LOCAL_RANK" in environ or "RANK" in environ:
        # already one rank of a launched world (`deepspeed --module sandpiper.cli learn`,
        # `torchrun -m sandpiper.cli learn`): the launcher placed this process, and set
        # CUDA_VISIBLE_DEVICES for it (DeepSpeed does so on CPU too: "0,1" for two ranks);
        # launching again would start a world per rank on the same port (EADDRINUSE)
        return {"name": "learner", "argv": None, "cwd": str(Path.cwd()), "env": env}
    gpus = learner_gpus(cfg, environ)
    ranks = len(gpus) if gpus else nproc
    if ranks > 1:
        launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        where = ["--include", "localhost:" + ",".join(map(str, gpus))] if gpus else []
        argv = [
            launcher,
            *(where or ["--num_gpus", str(ranks)]),
            "--no_local_rank",
            # DeepSpeed's default rendezvous port is 29500 for every launch: a second
            # learner on this host (a standby, another run) would fail with EADDRINUSE
            "--master_port",
            master_port,
            "--module",
            "sandpiper.trainer",
        ]
        argv += (["--config", str(config_path)] if config_path else []) + extra
    elif gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(gpus[0])
    return {"name": "learner", "argv": argv, "cwd": str(Path.cwd()), "env": env}


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (without importing torch, which
    must not see the GPUs before ``CUDA_VISIBLE_DEVICES`` is set)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def register(app: typer.Typer) -> None:
    @command(app, "learn")
    def learn(
        ctx: typer.Context,
        config: ConfigOption = None,
        algo: Annotated[
            str | None, typer.Option(help="grpo or sft; overrides learner.algo.")
        ] = None,
        nproc: Annotated[
            int,
            typer.Option(
                help="Data-parallel processes (>1 uses the DeepSpeed launcher); learner.gpus, "
                "when set, gives one per GPU instead."
            ),
        ] = 1,
        dry_run: Annotated[
            bool,
            typer.Option(
                "--dry-run", help="Print the process it would start (JSON) and start nothing."
            ),
        ] = False,
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
        if dry_run:
            plan = learner_launch(
                cfg, config_path=str(config) if config else None, extra=extra, nproc=nproc,
                environ=os.environ, master_port=os.environ.get("MASTER_PORT") or "<free port>",
            )  # fmt: skip
            typer.echo(json.dumps({"processes": [plan]}, indent=2))
            return
        with cli_errors():
            from sandpiper.commands._preflight import check_memory, learner_ready

            learner_ready(cfg)
            check_memory(cfg, role="learner", nproc=nproc)
        plan = learner_launch(
            cfg, config_path=str(config) if config else None, extra=extra, nproc=nproc,
            environ=os.environ, master_port=os.environ.get("MASTER_PORT") or str(_free_port()),
        )  # fmt: skip
        if plan["argv"] is not None:
            os.execv(plan["argv"][0], plan["argv"])
        os.environ.update(plan["env"])  # before torch is imported: one GPU, the placed one
        with cli_errors():
            from sandpiper.trainer.main import run_learner

            steps = run_learner(cfg.for_learner())
        typer.echo(f"learner finished after {steps} step(s) in this process")
