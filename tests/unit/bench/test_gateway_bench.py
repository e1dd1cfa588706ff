"""The benches' own arithmetic: vLLM's time of one call read from its metrics (the agent
process of bench/gateway_bench.py, which itself needs a vLLM server) and the client CPU
comparison of bench/client_bench.py."""

from __future__ import annotations

import asyncio
import importlib.util
import math
from pathlib import Path

import httpx
import numpy as np
import pytest


def _load(name: str):
    path = Path(__file__).resolve().parents[3] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


agent = _load("gateway_agent")
client_bench = _load("client_bench")


def _metrics(total_s: float, count: int) -> str:
    """vLLM's histogram as /metrics prints it, split over two label sets."""
    return "\n".join([
        "# TYPE vllm:e2e_request_latency_seconds histogram",
        f'vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="m"}} {total_s / 2}',
        f'vllm:e2e_request_latency_seconds_count{{engine="0",model_name="m"}} {count - 1}.0',
        f'vllm:e2e_request_latency_seconds_sum{{engine="1",model_name="m"}} {total_s / 2}',
        'vllm:e2e_request_latency_seconds_count{engine="1",model_name="m"} 1.0',
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="m"} 9.0',
    ])  # fmt: skip


def _server(finished_per_call: int):
    """A vLLM stand-in: each generate finishes ``finished_per_call`` requests of 50 ms."""
    state = {"total": 1.0, "count": 4}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=_metrics(state["total"], state["count"]))
        state["total"] += 0.05 * finished_per_call
        state["count"] += finished_per_call
        return httpx.Response(200, json={})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://v")


def test_a_calls_own_vllm_time_is_the_histograms_growth_over_it(monkeypatch):
    monkeypatch.setattr(agent, "SETTLE_S", 0.0)

    async def main(finished: int) -> float:
        async with _server(finished) as http:
            assert await agent._e2e_ms(http, "http://v") == (1000.0, 4.0)
            call = lambda: http.post("http://v/inference/v1/generate")  # noqa: E731
            _, inside, _ = await agent._timed_vllm_call(http, "http://v", call)
            return inside

    assert math.isclose(asyncio.run(main(1)), 50.0)
    assert math.isnan(asyncio.run(main(2)))  # another request finished meanwhile: left out


def test_client_cpu_compares_the_client_with_a_plain_post():
    out = asyncio.run(client_bench.client_cpu(reps=1, calls=20))
    assert out["client_cpu_us_per_call"] > 0 and out["plain_httpx_cpu_us_per_call"] > 0
    assert math.isclose(
        out["client_vs_plain_httpx"],
        out["client_cpu_us_per_call"] / out["plain_httpx_cpu_us_per_call"],
        rel_tol=0.01,
    )


gateway_bench = _load("gateway_bench")
BASH_LS = '<tool_call>\n{"name": "execute_bash", "arguments": {"command": "ls"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_the_bench_agent_speaks_each_api_and_its_calls_extend(tiny_tokenizer, api, stream):
    """The bench agent's request and reply handling in each wire API (streams parsed back
    into the reply): the gateway answers every call, and the second call, which sends the
    first reply back with a tool result, extends the first token for token — so the bench
    times the path a real agent of that API takes."""
    from sandpiper.collector.episode.render import ChatRenderer
    from sandpiper.collector.episode.tools import offered_schemas
    from sandpiper.collector.gateway.server import Gateway, GatewaySettings
    from sandpiper.testing import ScriptedPolicy

    tools = offered_schemas(["execute_bash", "str_replace_editor", "submit"], "brief")
    gateway = Gateway(client=ScriptedPolicy(tiny_tokenizer, [BASH_LS, "done"]),
                      renderer=ChatRenderer(tiny_tokenizer, tools),
                      settings=GatewaySettings(model_names=("policy",)))  # fmt: skip
    gateway.open_episode("e")

    async def main() -> None:
        transport = httpx.ASGITransport(app=gateway.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            conversation = agent.Conversation(api, "list the files")
            for turn in range(2):
                r = await http.post("/episodes/e/v1" + agent.ROUTES[api],
                                    json=conversation.body(stream))  # fmt: skip
                assert r.status_code == 200, r.text
                conversation.absorb(conversation.reply(r, stream), turn)

    asyncio.run(main())
    calls = gateway.close_episode("e").calls
    assert len(calls) == 2 and calls[1].extends and calls[1].restart_reason is None
    assert "execute_bash" in calls[0].text  # the reply sent back held a tool call


def test_overhead_over_hop_is_the_worst_apis_p50_minus_the_hops():
    figures = {
        "api_chat_overhead_ms_p50": 2.0, "api_messages_stream_overhead_ms_p50": 3.5,
        "api_chat_overhead_ms_p99": 40.0, "api_chat_overhead_ms_p50_c16": 90.0,
        "stub_api_chat_overhead_ms_p50": 9.0,
    }  # fmt: skip
    hop = np.array([1.0, 1.5, np.nan])  # a direct-first pair has no hop
    out = gateway_bench.over_hop(figures, hop)
    assert out == {"gateway_hop_ms_p50": 1.25, "gateway_overhead_over_hop_ms_p50": 2.25}
    stub = gateway_bench.over_hop(figures, hop, "stub_")
    assert stub == {"stub_hop_ms_p50": 1.25, "stub_overhead_over_hop_ms_p50": 7.75}
