"""The native loop's inference client: CPU per call against a plain HTTP post.

``VLLMPolicyClient.generate`` (the client the native loop and the gateway call vLLM through)
against a plain ``httpx`` post of the same body with its JSON answer parsed (an agent calling
vLLM itself), both over one in-memory transport answering as vLLM's ``/inference/v1/generate``
does: no sockets and no server, so the figure is the client's own work (building and
encoding the body, retry bookkeeping, parsing the answer into a Generation).

Figures (``--json``: one JSON object on the last line): ``client_cpu_us_per_call``,
``plain_httpx_cpu_us_per_call`` (medians over ``--reps`` runs of ``--calls`` calls) and
``client_vs_plain_httpx`` (their ratio). Measured figures: bench/results/client_bench.json.

    python bench/client_bench.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np


async def client_cpu(reps: int = 5, calls: int = 1000) -> dict[str, float]:
    """CPU time per ``generate`` of the native loop's client (the gateway's too), against a
    plain ``httpx`` post of the same body with its JSON answer parsed (an agent calling vLLM
    itself), both over one in-memory transport answering as vLLM does (no sockets)."""
    import httpx

    from sandpiper.collector.inference.base import SamplingParams
    from sandpiper.collector.inference.vllm_client import (
        GENERATE_PATH,
        VLLMPolicyClient,
        generate_body,
    )

    n = 16
    answer = json.dumps({
        "request_id": "r", "weight_versions": [{"version": "3", "start": 0, "end": n}],
        "choices": [{"index": 0, "token_ids": list(range(5, 5 + n)), "finish_reason": "stop",
                     "logprobs": {"content": [{"logprob": -0.5}] * n}}],
    }).encode()  # fmt: skip
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, content=answer,
                                       headers={"content-type": "application/json"})
    )  # fmt: skip
    params = SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=[2])
    prompt = list(range(300))
    client = VLLMPolicyClient(["http://vllm"], transport=transport)
    plain = httpx.AsyncClient(transport=transport)

    async def plain_call() -> None:
        body = {**generate_body(prompt, params), "request_id": "r"}
        (await plain.post("http://vllm" + GENERATE_PATH, json=body)).json()

    async def per_call_us(fn) -> float:
        runs = []
        for _ in range(reps):
            for _ in range(calls // 10):  # warm
                await fn()
            c0 = time.process_time()
            for _ in range(calls):
                await fn()
            runs.append((time.process_time() - c0) * 1e6 / calls)
        return float(np.median(runs))

    try:
        ours = await per_call_us(lambda: client.generate(prompt, params))
        theirs = await per_call_us(plain_call)
    finally:
        await client.aclose()
        await plain.aclose()
    return {
        "client_cpu_us_per_call": round(ours, 1),
        "plain_httpx_cpu_us_per_call": round(theirs, 1),
        "client_vs_plain_httpx": round(ours / theirs, 3),
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="Timed runs of each (median kept).")
    p.add_argument("--calls", type=int, default=1000, help="Calls per timed run.")
    p.add_argument("--json", action="store_true", help="Print one JSON object as last line.")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    out = asyncio.run(client_cpu(args.reps, args.calls))
    for key, value in out.items():
        print(f"{key}: {value}")
    if args.json:
        print(json.dumps(out))
