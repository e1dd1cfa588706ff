"""``sandpiper gateway``: an OpenAI-compatible server that records exact tokens per episode."""

from __future__ import annotations

from typing import Annotated

import typer

from sandpiper.commands._common import ConfigOption, cli_errors, command, resolve_config


def register(app: typer.Typer) -> None:
    @command(app, "gateway")
    def gateway(
        ctx: typer.Context,
        config: ConfigOption = None,
        host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port (0: any free port).")] = 8300,
        time_limit_s: Annotated[
            float,
            typer.Option(
                "--time-limit-s",
                min=0.001,
                help="An episode's time limit unless POST /episodes gives one; past it the "
                "episode is closed and stored (stop reason time_limit).",
            ),
        ] = 600.0,
    ) -> None:
        """Serve the run's policy as an OpenAI-compatible API, one base URL per episode.

        POST /episodes opens an episode and returns its base URL (model name ``policy``);
        POST /episodes/ID/close returns its calls with token ids, logprobs and policy
        versions. Every episode is stored in the run's store when it ends: closed, past its
        time limit, or still open when the gateway stops (stop reason cancelled). The
        collector runs the same gateway for tasks that name an agent_command
        (docs/gateway.md). Stops on SIGTERM / Ctrl-C.
        """
        import asyncio
        import logging
        import signal

        from sandpiper.collector.gateway.standalone import serve

        cfg = resolve_config(config, ctx)
        with cli_errors():
            from sandpiper.commands import _preflight as pf

            pf.check_port_free(port, host=host, field="--port")
            if not cfg.inference.server_urls:
                pf.check_model(cfg.learner.model)
                pf.check_server_ports(cfg)
            pf.check_run_identity(cfg)  # its episodes join the run's groups
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await serve(
                cfg.for_collector(), host=host, port=port, stop=stop, time_limit_s=time_limit_s
            )

        with cli_errors():
            asyncio.run(main())
