"""bench/gateway_bench.py's own arithmetic: vLLM's time of one call read from its metrics,
and the client CPU comparison (the bench itself needs a vLLM server: see its docstring)."""

from __future__ import annotations

import asyncio
import importlib.util
import math
from pathlib import Path

import httpx

_PATH = Path(__file__).resolve().parents[2] / "bench" / "gateway_bench.py"
_spec = importlib.util.spec_from_file_location("gateway_bench", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


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
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)

    async def main(finished: int) -> float:
        async with _server(finished) as http:
            assert await bench._e2e_ms(http, "http://v") == (1000.0, 4.0)
            call = lambda: http.post("http://v/inference/v1/generate")  # noqa: E731
            _, inside, _ = await bench._timed_vllm_call(http, "http://v", call)
            return inside

    assert math.isclose(asyncio.run(main(1)), 50.0)
    assert math.isnan(asyncio.run(main(2)))  # another request finished meanwhile: left out


def test_client_cpu_compares_the_client_with_a_plain_post():
    out = asyncio.run(bench.client_cpu(reps=1, calls=20))
    assert out["client_cpu_us_per_call"] > 0 and out["plain_httpx_cpu_us_per_call"] > 0
    assert math.isclose(
        out["client_vs_plain_httpx"],
        out["client_cpu_us_per_call"] / out["plain_httpx_cpu_us_per_call"],
        rel_tol=0.01,
    )
