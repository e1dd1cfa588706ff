"""``sandpiper collect``: the rollout daemon (or, with ``--eval``, a chat-endpoint evaluation)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from sandpiper.commands._common import ConfigOption, cli_errors, command, resolve_config
from sandpiper.config import RunConfig


def server_plans(cfg: RunConfig) -> list[dict[str, Any]]:
    """The local vLLM servers ``sandpiper collect`` would start (none with
    ``inference.server_urls``), each as ``{"name", "argv", "cwd", "env"}``."""
    from sandpiper.collector.inference.vllm_server import VLLMServer
    from sandpiper.collector.run_setup import served_model

    inf = cfg.inference
    if inf.server_urls:
        return []
    if inf.log_dir is None:
        inf = inf.model_copy(update={"log_dir": str(cfg.run_dir)})
    model = served_model(cfg.learner.model)
    return [
        VLLMServer.from_config(inf, model, index=i).launch_plan() for i in range(inf.num_servers)
    ]


def register(app: typer.Typer) -> None:
    @command(app, "collect")
    def collect(
        ctx: typer.Context,
        config: ConfigOption = None,
        eval_mode: Annotated[
            bool,
            typer.Option(
                "--eval",
                help="Evaluate a model behind an OpenAI-compatible chat endpoint once per task "
                "(stored untrainable, split=validation) instead of collecting.",
            ),
        ] = False,
        endpoint: Annotated[
            str | None, typer.Option(help="Chat endpoint base URL for --eval (…/v1 optional).")
        ] = None,
        model: Annotated[str, typer.Option(help="Model name sent to the endpoint (--eval).")] = "",
        api_key: Annotated[
            str | None,
            typer.Option(envvar="OPENAI_API_KEY", help="Bearer token for the endpoint (--eval)."),
        ] = None,
        dry_run: Annotated[
            bool,
            typer.Option(
                "--dry-run",
                help="Print the vLLM servers it would start (argv, cwd, environment set; JSON) "
                "and start nothing.",
            ),
        ] = False,
    ) -> None:
        """Collect GRPO groups until stopped (SIGTERM/Ctrl-C drains and flushes).

        Extra ``--part.field VALUE`` args override the config, e.g. ``--collector.group_size 4``.
        """
        import asyncio

        from sandpiper.config import write_resolved

        cfg = resolve_config(config, ctx)
        if dry_run:
            with cli_errors():
                typer.echo(json.dumps({"processes": server_plans(cfg)}, indent=2))
            return
        with cli_errors():
            from sandpiper.commands._preflight import check_endpoint, check_memory, collector_ready

            if eval_mode and not endpoint:
                raise typer.BadParameter("--eval needs --endpoint URL")
            if endpoint and eval_mode:
                check_endpoint(endpoint)  # first: named in a second, before the sandbox checks
            collector_ready(cfg, launch_servers=not eval_mode and not cfg.inference.server_urls)
            if not eval_mode:
                check_memory(cfg, role="inference")
            write_resolved(cfg)
            if endpoint and eval_mode:
                from sandpiper.collector.daemon.eval import evaluate

                n = asyncio.run(
                    evaluate(
                        cfg.for_collector(), endpoint_url=endpoint, model=model, api_key=api_key
                    )
                )
                typer.echo(f"evaluated {n} tasks; stored as run {cfg.name!r} (split=validation)")
                return
            from sandpiper.collector.daemon.launch import run_collector_process
            from sandpiper.collector.daemon.shutdown import exit_now_if_stuck

            # SIGTERM/SIGINT stop it within collector.drain_timeout_s, whatever the store does
            metrics = run_collector_process(cfg.for_collector())
            typer.echo(f"stopped: {metrics.groups_total} groups, {metrics.episodes_total} episodes")
            exit_now_if_stuck()
