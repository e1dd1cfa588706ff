"""The benches' own arithmetic: vLLM's time of one call read from its metrics (the agent
process of bench/gateway_bench.py, which itself needs a vLLM server) and the client CPU
comparison of bench/client_bench.py."""

from __future__ import annotations

import asyncio
import importlib.util
import math
from pathlib import Path

import httpx


def _load(name: str):
    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
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
