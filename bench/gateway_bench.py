"""Gateway cost: latency an OpenAI-compatible call adds over calling vLLM directly.

Two processes, as in a real run: this one is the collector (the :class:`Gateway` and the
:class:`VLLMPolicyClient` it shares with the native loop); the agent is a separate process
(``bench/gateway_agent.py``) making plain ``httpx`` calls (the ``openai`` client's transport),
``--turns`` chat calls per episode with the run's tool schemas, greedy. One warm-up episode.

Figures (``--json``: one JSON object on the last line; definitions in docs/gateway.md, Cost):

- ``gateway_overhead_ms_p50`` / ``_p99``: added latency per call, one episode at a time
  (goal p50 ≤ 2 ms): the agent's latency − that call's own vLLM time, timed inside the
  gateway around the client's ``generate``;
- ``gateway_http_hop_ms_p50``: a bare HTTP hop in front of vLLM (a bench-only route that
  only calls vLLM), the floor any HTTP server pays;
- checks against a separate direct call of the same prompt ids (order alternated):
  ``gateway_model_minus_direct_ms_p50``, ``gateway_paired_overhead_ms_p50`` / ``_p99``
  (``_gateway_first`` / ``_direct_first``), ``direct_ms_p50``, ``gateway_vs_direct_p50``;
- the same with ``_c16``: 16 episodes at once; ``stub_*``: with an instant model instead of
  vLLM, and ``stub_server_cpu_ms_per_call``;
- ``--agent-direct``: ``gateway_added_over_agent_direct_ms_p50`` / ``_p99``, the added latency
  over the agent calling vLLM itself, vLLM's own time of each call taken from its metrics
  (colder: compare with the in-call figure of the same run only);
- per wire API (``chat``, ``responses``, ``messages``; ``_stream``: streamed, timed to the
  last byte): ``api_<api>[_stream]_overhead_ms_p50`` / ``_p99`` (one episode at a time) and
  ``_p50_c16`` / ``_p99_c16`` (16 at once); ``gateway_hop_ms_p50``, the bare HTTP hop over all
  of this run's one-at-a-time calls; ``gateway_overhead_over_hop_ms_p50`` = the worst API's
  p50 − the hop's (goal ≤ 0.5 ms: the gateway's own work beyond what any HTTP server in front
  of vLLM costs), ``gateway_worst_api`` names it on its own line;
- ``call_path_cpu_ms`` (CPU per call into the ASGI app, no sockets) and
  ``close_cpu_ms_per_episode``; ``load_avg_1m_*``. ``--profile FILE``: a cProfile of a stub run.

Measured figures: bench/results/gateway_bench.json. The client's own CPU: bench/client_bench.py.

    python bench/gateway_bench.py --json          # starts its own vLLM server (tiny model)
    python bench/gateway_bench.py --stub-only     # the gateway's own cost only
    python bench/gateway_bench.py --url http://127.0.0.1:8100 --model-dir runs/tiny-model
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
_RUNS = itertools.count()
"""Each agent run's tasks are its own: a prompt seen by an earlier run would be served from
the gateway's first-call cache, and the bench would measure a cache instead of the work."""


class StubClient:
    """An instant PolicyClient: a fixed short reply (isolates the gateway's own cost)."""

    def __init__(self, reply_ids: list[int]) -> None:
        self.reply = np.asarray(reply_ids, dtype=np.int32)
        self.policy_version = 0

    async def generate(self, prompt_ids, params):
        from sandpiper.collector.inference.base import Generation

        n = len(self.reply)
        return Generation(self.reply, np.zeros(n, np.float32), np.zeros(n, np.int32), "stop")


# ---- the collector process --------------------------------------------------------------


async def measure(
    client,
    renderer,
    args,
    concurrency: int,
    episodes: int,
    profile: str | None = None,
    wire_api: str = "chat",
    stream: bool = False,
) -> dict[str, Any]:
    """One agent process (speaking ``wire_api``, streamed or not) against a fresh gateway; the
    pairs and this process's CPU time."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from sandpiper.collector.episode.render import ChatRenderer
    from sandpiper.collector.gateway import openai_api as api
    from sandpiper.collector.gateway.server import Gateway, GatewaySettings
    from sandpiper.collector.inference.base import SamplingParams
    from sandpiper.collector.inference.vllm_client import VLLMPolicyClient, generate_body
    from sandpiper.config import SamplingLimits

    settings = GatewaySettings(model_names=("policy",), sampling=SamplingLimits(
        temperature=0.0, max_tokens_per_turn=args.max_tokens, context_limit=args.max_model_len,
    ))  # fmt: skip
    gateway = Gateway(client=client, renderer=renderer, settings=settings)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, stop_token_ids=renderer.stop_token_ids
    )
    cpu_start = [time.process_time()]

    # The direct call sends exactly the ids the gateway sends (checked). Direct first: the
    # ids the gateway will build, made by a copy of the episode's session with a renderer of
    # its own (its caches apart from the gateway's, so this warms none of the gateway's).
    shadow = ChatRenderer(renderer.tokenizer, renderer.tools, chat_template=renderer.chat_template,
                          action_format=renderer.action_format)  # fmt: skip
    expected: dict[str, tuple[int, list[int]]] = {}

    def verify(eid: str) -> None:
        index, ids = expected.pop(eid, (-1, []))
        calls = gateway._episodes[eid].session.calls
        if index >= 0 and (len(calls) <= index or list(calls[index].prompt_ids) != ids):
            raise RuntimeError(f"episode {eid} call {index}: the gateway sent other ids")

    async def timed(prompt: list[int]) -> JSONResponse:
        t0 = time.perf_counter()
        await client.generate(prompt, params)
        direct_ms = (time.perf_counter() - t0) * 1000
        return JSONResponse({"direct_ms": direct_ms, "body": generate_body(prompt, params)})

    async def direct(request):  # after the gateway call: the ids it just sent
        eid = request.path_params["eid"]
        verify(eid)
        return await timed(list(gateway._episodes[eid].session.calls[-1].prompt_ids))

    async def direct_first(request):  # before it: the ids it will send
        eid = request.path_params["eid"]
        verify(eid)
        body = api.parse_body(await request.body())
        session = copy.copy(gateway._episodes[eid].session)
        session.renderer = shadow
        prompt = session.chat_prompt(api.check_messages(body), api.check_tools(body))[0]
        expected[eid] = (len(session.calls), prompt)
        return await timed(prompt)

    async def verify_route(request):  # the episode's last call: its ids, and every call's time
        eid = request.path_params["eid"]
        verify(eid)
        return JSONResponse(
            {"model_ms": [c.duration_ms for c in gateway._episodes[eid].session.calls]}
        )

    async def start(request):
        cpu_start[0] = time.process_time()  # after the agent's warm-up episode
        if profile:
            profiler.enable()
        return JSONResponse({})

    import cProfile

    profiler = cProfile.Profile()
    control_app = Starlette(
        routes=[
            Route("/direct/{eid}", direct, methods=["POST"]),
            Route("/direct-first/{eid}", direct_first, methods=["POST"]),
            Route("/verify/{eid}", verify_route, methods=["POST"]),
            Route("/start", start, methods=["POST"]),
        ]
    )
    control = uvicorn.Server(
        uvicorn.Config(control_app, host="127.0.0.1", port=0, log_level="warning",
                       access_log=False, lifespan="off", timeout_keep_alive=900)
    )  # fmt: skip
    control_task = asyncio.create_task(control.serve())
    await gateway.serve()
    while not control.started:
        await asyncio.sleep(0.01)
    host, port = control.servers[0].sockets[0].getsockname()[:2]
    cmd = [
        sys.executable, str(Path(__file__).resolve().parent / "gateway_agent.py"),
        "--gateway", gateway.url, "--control", f"http://{host}:{port}",
        "--concurrency", str(concurrency), "--episodes", str(episodes),
        "--turns", str(args.turns), "--tag", f"run {next(_RUNS)}", "--api", wire_api,
    ]  # fmt: skip
    if stream:
        cmd.append("--stream")
    if args.agent_direct and isinstance(client, VLLMPolicyClient):  # and vLLM itself
        cmd += ["--vllm", client.urls[0]]
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)}
        )
        out, _ = await proc.communicate()
        cpu_s = time.process_time() - cpu_start[0]
        profiler.disable()
        if proc.returncode != 0:
            raise RuntimeError(f"the agent process failed (exit {proc.returncode})")
    finally:
        control.should_exit = True
        await control_task
        await gateway.aclose()
    if profile:
        profiler.dump_stats(profile)
    pairs = np.array(json.loads(out.decode().strip().splitlines()[-1]), dtype=float)
    return {
        "gateway_ms": pairs[:, 0], "direct_ms": pairs[:, 1], "direct_first": pairs[:, 2] > 0,
        "control_ms": pairs[:, 3], "gateway_inside_ms": pairs[:, 4],
        "agent_direct_ms": pairs[:, 5], "agent_direct_inside_ms": pairs[:, 6],
        "model_ms": pairs[:, 7], "cpu_s": cpu_s,
    }  # fmt: skip


async def _asgi_post(app, path: str, body: bytes) -> tuple[int, bytes]:
    """One POST straight into the ASGI app (no sockets, no HTTP parsing)."""
    sent: list[dict[str, Any]] = []
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "headers": [(b"content-type", b"application/json")],
        "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
    }  # fmt: skip

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def call_path_cpu(renderer, args, episodes: int) -> dict[str, float]:
    """CPU time of this process per chat call through the gateway's ASGI app with the instant
    model (routing, parsing, rendering, splicing, recording, the JSON answer; not uvicorn's
    HTTP parsing), and per episode close (the deferred re-tokenization checks)."""
    from sandpiper.collector.episode.tools import offered_schemas
    from sandpiper.collector.gateway.server import Gateway, GatewaySettings
    from sandpiper.config import SamplingLimits

    tools = offered_schemas(["execute_bash", "str_replace_editor", "submit"], "brief")
    reply = renderer.encode('<tool_call>\n{"name": "execute_bash", "arguments": '
                            '{"command": "ls"}}\n</tool_call>') + list(renderer.stop_token_ids)  # fmt: skip
    settings = GatewaySettings(model_names=("policy",), sampling=SamplingLimits(
        temperature=0.0, max_tokens_per_turn=args.max_tokens, context_limit=args.max_model_len,
    ))  # fmt: skip
    gateway = Gateway(client=StubClient(reply), renderer=renderer, settings=settings)
    call_cpu = close_cpu = 0.0
    n_calls = 0
    for i in range(-5, episodes):  # 5 warm-up episodes
        eid = f"cpu-{i}"
        gateway.open_episode(eid)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are an agent in a Linux sandbox."},
            {"role": "user", "content": f"Task {i} (call path): list the files in /workspace."},
        ]
        for turn in range(args.turns):
            body = json.dumps({"model": "policy", "messages": messages, "tools": tools}).encode()
            c0 = time.process_time()
            status, answer = await _asgi_post(
                gateway.app, f"/episodes/{eid}/v1/chat/completions", body
            )
            spent = time.process_time() - c0
            assert status == 200, answer
            reply_msg = json.loads(answer)["choices"][0]["message"]
            messages.append(reply_msg)
            call_id = (reply_msg.get("tool_calls") or [{"id": "none"}])[0]["id"]
            messages.append({"role": "tool", "tool_call_id": call_id, "content": f"out {turn}"})
            if i >= 0:
                call_cpu += spent
                n_calls += 1
        c0 = time.process_time()
        await gateway.close_episode(eid).settle()
        if i >= 0:
            close_cpu += time.process_time() - c0
    return {
        "call_path_cpu_ms": round(call_cpu * 1000 / n_calls, 3),
        "close_cpu_ms_per_episode": round(close_cpu * 1000 / episodes, 3),
    }


def _ms(values: np.ndarray, q: float) -> float:
    return round(float(np.nanpercentile(values, q)), 3)


def _figures(m: dict[str, Any], prefix: str, suffix: str) -> dict[str, float]:
    """The figures of one measurement (see the module docstring)."""
    added = m["gateway_ms"] - m["model_ms"]  # the same call: the agent's wait − vLLM's part
    paired = m["gateway_ms"] - m["direct_ms"]  # against the pair's direct call
    g50, d50 = _ms(m["gateway_ms"], 50), _ms(m["direct_ms"], 50)
    out = {
        f"{prefix}_overhead_ms_p50{suffix}": _ms(added, 50),
        f"{prefix}_overhead_ms_p99{suffix}": _ms(added, 99),
        f"{prefix}_http_hop_ms_p50{suffix}": _ms(m["control_ms"] - m["direct_ms"], 50),
        f"{prefix}_paired_overhead_ms_p50{suffix}": _ms(paired, 50),
        f"{prefix}_paired_overhead_ms_p99{suffix}": _ms(paired, 99),
        f"{prefix}_model_minus_direct_ms_p50{suffix}": _ms(m["model_ms"] - m["direct_ms"], 50),
        f"{prefix}_gateway_ms_p50{suffix}": g50,
        f"{prefix}_direct_ms_p50{suffix}": d50,
    }
    if prefix == "gateway":
        out[f"gateway_vs_direct_p50{suffix}"] = round(g50 / d50, 3)
        if not suffix:  # the order effect the alternation cancels (see _agent_episode)
            first = m["direct_first"]
            for name, sel in (("gateway_first", ~first), ("direct_first", first)):
                out[f"gateway_paired_overhead_ms_p50_{name}"] = _ms(paired[sel], 50)
            via = m["gateway_ms"] - m["gateway_inside_ms"]
            own = m["agent_direct_ms"] - m["agent_direct_inside_ms"]
            if np.isfinite(via - own).any():  # --agent-direct
                out |= _agent_direct_figures(via, own, m["model_ms"] - m["gateway_inside_ms"])
    return out


def _agent_direct_figures(via: np.ndarray, own: np.ndarray, client: np.ndarray) -> dict[str, float]:
    """``--agent-direct``: times outside vLLM's engine (latency − vLLM's own time of the
    call) through the gateway (``via``), of the agent calling vLLM itself (``own``) and of
    the gateway's client (``client``); their difference is the gateway's added latency over
    an agent calling vLLM directly, with no generation in it."""
    return {
        "gateway_added_over_agent_direct_ms_p50": _ms(via - own, 50),
        "gateway_added_over_agent_direct_ms_p99": _ms(via - own, 99),
        "gateway_outside_vllm_ms_p50": _ms(via, 50),
        "agent_direct_outside_vllm_ms_p50": _ms(own, 50),
        "gateway_client_outside_vllm_ms_p50": _ms(client, 50),
        "agent_direct_calls_timed": float(np.isfinite(via - own).sum()),
    }


API_RUNS = tuple((api, stream) for api in ("chat", "responses", "messages")
                 for stream in (False, True))  # fmt: skip
"""The wire APIs (and streamed or not) whose added latency is reported."""


async def _per_api(
    client, renderer, args, chat_one, chat_many, prefix: str = ""
) -> dict[str, float]:
    """Added latency per wire API, one episode at a time and 16 at once (the plain chat runs
    already made are reused), against the bare HTTP hop of all one-at-a-time calls; figure
    names start with ``prefix`` (``stub_`` for the instant model)."""
    out: dict[str, float] = {}
    hops, n_calls = [], 0
    for api, stream in API_RUNS:
        if api not in args.apis:
            continue
        name = api + ("_stream" if stream else "")
        if (api, stream) == ("chat", False):
            one, many = chat_one, chat_many
        else:
            one = await measure(
                client, renderer, args, 1, args.episodes, wire_api=api, stream=stream
            )
            many = await measure(client, renderer, args, 16, args.episodes_c16, wire_api=api,
                                 stream=stream)  # fmt: skip
        n_calls += len(one["gateway_ms"]) + len(many["gateway_ms"])
        hops.append(one["control_ms"] - one["direct_ms"])
        for m, suffix in ((one, ""), (many, "_c16")):
            added = m["gateway_ms"] - m["model_ms"]
            out[f"{prefix}api_{name}_overhead_ms_p50{suffix}"] = _ms(added, 50)
            out[f"{prefix}api_{name}_overhead_ms_p99{suffix}"] = _ms(added, 99)
    out |= over_hop(out, np.concatenate(hops), prefix)
    out[f"{prefix}calls"] = float(n_calls)
    return out


def over_hop(figures: dict[str, float], hop_ms: np.ndarray, prefix: str = "") -> dict[str, float]:
    """``gateway_overhead_over_hop_ms_p50``: the worst API's one-at-a-time p50 added latency
    − the bare HTTP hop's p50 (what the gateway costs beyond any server in front of vLLM)."""
    head = f"{prefix}api_"
    p50s = {k.removeprefix(head).removesuffix("_overhead_ms_p50"): v for k, v in figures.items()
            if k.startswith(head) and k.endswith("_overhead_ms_p50")}  # fmt: skip
    hop = _ms(hop_ms, 50)
    worst = max(p50s, key=lambda k: p50s[k])
    name = "gateway" if not prefix else prefix.rstrip("_")
    print(f"{name}_worst_api: {worst}", file=sys.stderr)
    return {f"{name}_hop_ms_p50": hop,
            f"{name}_overhead_over_hop_ms_p50": round(p50s[worst] - hop, 3)}  # fmt: skip


async def main(args: argparse.Namespace) -> dict[str, float]:
    from transformers import AutoTokenizer

    from sandpiper.collector.episode.render import ChatRenderer
    from sandpiper.collector.episode.tools import offered_schemas
    from sandpiper.collector.inference.vllm_client import VLLMPolicyClient

    server = scratch = None
    url, model_dir = args.url, args.model_dir
    out: dict[str, float] = {"load_avg_1m_start": round(os.getloadavg()[0], 1)}
    if args.stub_only:
        model_dir = model_dir or str(REPO / "runs/tiny-model")
    elif url is None:
        from sandpiper.collector.inference.vllm_server import VLLMServer
        from sandpiper.models.tiny import init_tiny_model

        scratch = tempfile.mkdtemp(prefix="gateway-bench-")
        model_dir = init_tiny_model(Path(scratch) / "tiny-model")
        server = VLLMServer(model_dir=model_dir, port=args.port, max_model_len=args.max_model_len)
        await asyncio.to_thread(server.start)
        url = server.url
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools = offered_schemas(["execute_bash", "str_replace_editor", "submit"], "brief")
    renderer = ChatRenderer(tokenizer, tools)
    try:
        reply = renderer.encode('<tool_call>\n{"name": "execute_bash", "arguments": '
                                '{"command": "ls"}}\n</tool_call>') + list(renderer.stop_token_ids)  # fmt: skip
        stub = StubClient(reply)
        out |= await call_path_cpu(renderer, args, args.episodes)
        one = await measure(stub, renderer, args, 1, args.episodes)
        out |= _figures(one, "stub", "")
        out["stub_server_cpu_ms_per_call"] = round(one["cpu_s"] * 1000 / len(one["gateway_ms"]), 3)
        many = await measure(stub, renderer, args, 16, args.episodes_c16)
        out |= _figures(many, "stub", "_c16")
        out |= await _per_api(stub, renderer, args, one, many, prefix="stub_")
        if args.profile:  # a run of its own: the profiler slows what it watches
            await measure(stub, renderer, args, 1, args.episodes, profile=args.profile)
        if not args.stub_only:
            client = VLLMPolicyClient([url])
            try:
                one = await measure(client, renderer, args, 1, args.episodes)
                many = await measure(client, renderer, args, 16, args.episodes_c16)
                out |= _figures(one, "gateway", "") | _figures(many, "gateway", "_c16")
                out |= await _per_api(client, renderer, args, one, many)
            finally:
                await client.aclose()
            if args.agent_direct and "agent_direct_calls_timed" not in out:
                print("--agent-direct: no call could be timed from vLLM's metrics (no "
                      "vllm:e2e_request_latency_seconds at /metrics: --disable-log-stats?)",
                      file=sys.stderr)  # fmt: skip
    finally:
        if server is not None:
            server.stop()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    out["load_avg_1m_end"] = round(os.getloadavg()[0], 1)
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="Existing vLLM server (started with --enable-scale-out).")
    p.add_argument("--model-dir", help="Model folder of --url (for the tokenizer).")
    p.add_argument("--port", type=int, default=8191, help="Port of a server started here.")
    p.add_argument("--episodes", type=int, default=40, help="Episodes one at a time.")
    p.add_argument("--episodes-c16", type=int, default=32, help="Episodes, 16 at a time.")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--stub-only", action="store_true",
                   help="Only the gateway's own cost (no vLLM server; tokenizer of --model-dir "
                   "or runs/tiny-model).")  # fmt: skip
    p.add_argument("--profile", help="Write a cProfile of the stub run (1 episode) here.")
    p.add_argument(
        "--agent-direct",
        action="store_true",
        help="The agent also calls vLLM itself with the ids the gateway sent, and "
        "vLLM's own time of each call (its metrics, read around it) is taken out of "
        "both: gateway_added_over_agent_direct_ms_*. Slower; one episode at a time.",
    )
    p.add_argument("--apis", type=lambda s: tuple(s.split(",")),
                   default=("chat", "responses", "messages"),
                   help="Wire APIs whose added latency is reported, each streamed and not "
                   "(comma-separated; default: chat,responses,messages).")  # fmt: skip
    p.add_argument("--json", action="store_true", help="Print one JSON object as last line.")
    args = p.parse_args()
    unknown = set(args.apis) - {api for api, _ in API_RUNS}
    if unknown or not args.apis:
        p.error(f"--apis: unknown {sorted(unknown)} (chat, responses, messages)")
    return args


if __name__ == "__main__":
    import signal

    # a SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the vLLM server started here stops
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args()
    if args.url and not args.model_dir:
        raise SystemExit("--url needs --model-dir (the tokenizer)")
    out = asyncio.run(main(args))
    for key, value in out.items():
        print(f"{key}: {value}")
    if args.json:
        print(json.dumps(out))
