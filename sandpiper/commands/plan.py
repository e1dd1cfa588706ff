"""``sandpiper plan``: the memory plan of a run config, per GPU, before anything starts."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from sandpiper.commands._common import ConfigOption, cli_errors, command, resolve_config


def register(app: typer.Typer) -> None:
    @command(app, "plan")
    def plan(
        ctx: typer.Context,
        config: ConfigOption = None,
        gpu: Annotated[
            str | None,
            typer.Option(
                help="h200, h100-80gb, a100-80gb, l40s or NAME=GiB; default: this host's CUDA "
                "device, else h200."
            ),
        ] = None,
        nproc: Annotated[
            int | None,
            typer.Option(help="Learner ranks when learner.gpus is empty (as `learn --nproc`)."),
        ] = None,
        as_json: Annotated[
            bool, typer.Option("--json", help="One JSON object: fits and every term in bytes.")
        ] = False,
    ) -> None:
        """Print what each GPU holds at the learner's peak and the vLLM share beside it.

        Sizes the model from its config.json (built on the meta device: exact parameter
        count, output layer untied), then weights, fp32 master copy, gradients and Adam
        moments by ZeRO stage, precision, offload and world size; activations of one
        micro-batch (with or without gradient checkpointing); the logprob step; DeepSpeed's
        buckets; and vLLM's weights, KV-cache tokens and concurrent sequences. Exit status 1
        when something does not fit. Extra ``--part.field VALUE`` args override the config.
        """
        cfg = resolve_config(config, ctx)
        with cli_errors():
            from sandpiper.commands._plan import cuda_device_bytes, plan_run, render, to_json
            from sandpiper.trainer import memory_plan as mp

            if gpu is not None:
                name, size = mp.gpu_bytes_of(gpu)
            else:
                found = cuda_device_bytes()
                name, size = found if found else ("h200", mp.GPU_BYTES["h200"])
            shape = mp.model_shape(cfg.learner.model)
            plans = plan_run(cfg, gpu=name, gpu_bytes=size, nproc=nproc, shape=shape)
        if as_json:
            typer.echo(json.dumps(to_json(plans, model=cfg.learner.model, shape=shape)))
        else:
            typer.echo(render(plans, model=cfg.learner.model, shape=shape))
        if not all(gp.plan.fits for gp in plans):
            raise typer.Exit(1)
