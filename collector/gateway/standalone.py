"""``sandpiper gateway``: the gateway on its own, in front of the run's vLLM servers.

The collector starts a gateway itself for external-agent tasks; this serves one for agents
driven from elsewhere (a harness of your own). It starts the run's servers (or uses
``inference.server_urls``, loading the run's latest policy there), then serves until stopped:

- ``POST /episodes`` (optional ``{"episode_id": ...}``) → ``{"episode_id", "base_url"}``;
- the agent uses ``base_url`` as its OpenAI base URL, model ``policy``;
- ``POST /episodes/<id>/close`` → every call's prompt ids, sampled ids, logprobs, per-token
  policy versions and how it joined the previous call (JSON).

It serves the same renderer, parsers and client as the collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sandpiper.config import CollectorSettings, RunConfig, collector_settings

log = logging.getLogger(__name__)


async def serve(
    config: CollectorSettings | RunConfig, *, host: str, port: int, stop: asyncio.Event
) -> None:
    config = collector_settings(config)
    from transformers import AutoTokenizer

    from sandpiper.collector.agent import EpisodeLimits
    from sandpiper.collector.gateway.server import Gateway, GatewaySettings
    from sandpiper.collector.inference.vllm_client import VLLMPolicyClient
    from sandpiper.collector.render import renderer_for
    from sandpiper.collector.run_setup import open_store, start_run_servers

    tokenizer = AutoTokenizer.from_pretrained(config.model)
    renderer = renderer_for(tokenizer, config)  # the collector's: template, action format
    async with contextlib.AsyncExitStack() as stack:
        servers = await start_run_servers(config, stack)
        urls = config.inference.server_urls or [s.url for s in servers]
        client = VLLMPolicyClient.from_config(config.inference, urls)
        stack.push_async_callback(client.aclose)
        if config.inference.server_urls:
            store = await asyncio.to_thread(open_store, config)
            latest = await asyncio.to_thread(store.latest_policy, config.name)
            await client.reload(
                latest.checkpoint_uri if latest else config.model,
                latest.version if latest else 0,
            )
        gateway = Gateway(
            client=client,
            renderer=renderer,
            settings=GatewaySettings.from_limits(
                EpisodeLimits.from_config(config), run_id=config.name
            ),
        )
        url = await gateway.serve(host=host, port=port)
        stack.push_async_callback(gateway.aclose)
        print(f"gateway serving at {url} (POST {url}/episodes to open an episode)", flush=True)
        await stop.wait()
