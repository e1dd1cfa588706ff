"""``sandpiper collect``: the rollout daemon (or, with ``--eval``, a chat-endpoint evaluation)."""

from __future__ import annotations

from typing import Annotated

import typer

from sandpiper.commands._common import ConfigOption, cli_errors, command, resolve_config


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
    ) -> None:
        """Collect GRPO groups until stopped (SIGTERM/Ctrl-C drains and flushes).

        Extra ``--part.field VALUE`` args override the config, e.g. ``--collector.group_size 4``.
        """
        import asyncio

        from sandpiper.config import write_resolved

        cfg = resolve_config(config, ctx)
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
