"""The learner on one CUDA GPU, in one short run: peak memory against the planner, tokens/s,
and checkpointing equality. Prints one JSON line (an ``error`` key when a piece is missing).

Run by ``scripts/gpu_check.sh`` on a GPU machine (torch + transformers there; deepspeed, hjson
and pydantic from the wheels ``scripts/gpu_wheels.sh`` puts in ``.whl/``, carried with the
tree). ``--dry-run`` does the same on CPU with the tiny model, small enough for a unit test
(``tests/unit/scripts/test_gpu_check.py``).

Steps:
1. ``sandpiper.trainer.memory_probe`` in a child process: learner steps (bf16, gradient
   checkpointing, chunked logprobs, ZeRO-0) on a randomly initialised model built from
   ``configs/models/qwen3-4b/config.json``; measured ``torch.cuda.max_memory_allocated`` vs the
   planner's tensor bytes for the same setup; tokens/s of the last step.
2. Checkpointing equality: logprobs and gradients of one packed micro-batch with and without
   gradient checkpointing (fp32, the same weights) on the model truncated to a few layers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _missing() -> str | None:
    for module in ("torch", "transformers", "pydantic", "deepspeed"):
        try:
            __import__(module)
        except ImportError as e:
            hint = (
                " (run scripts/gpu_wheels.sh here and carry .whl with the tree)"
                if module in ("pydantic", "deepspeed")
                else ""
            )
            return f"{module} is not importable: {e}{hint}"
    return None


def probe(model: Path, *, dry_run: bool, timeout_s: float) -> dict[str, Any]:
    shape = (
        ["--row-tokens", "128", "--rows", "2"]
        if dry_run
        else ["--row-tokens", "4096", "--rows", "2"]
    )
    argv = [
        sys.executable, "-m", "sandpiper.trainer.memory_probe", "--model", str(model),
        "--precision", "fp32" if dry_run else "bf16", "--checkpointing", "--steps", "3",
        "--chunk-tokens", "1024", "--json", *shape,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout_s
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"memory probe failed (exit {done.returncode}): {done.stderr[-1500:]}"}
    return json.loads(lines[-1])


def checkpointing_equality(model: Path, *, device: str, layers: int = 4) -> dict[str, Any]:
    """Max |difference| of logprobs and of gradients, checkpointing on vs off (fp32)."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sandpiper.trainer.checkpoint import untie_output_layer
    from sandpiper.trainer.memory_probe import workload
    from sandpiper.trainer.packing import pack_rows, packed_logprobs, plan_rows

    config = AutoConfig.from_pretrained(str(model))
    config.num_hidden_layers = min(layers, config.num_hidden_layers)
    if hasattr(config, "layer_types") and config.layer_types:
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    torch.manual_seed(0)
    with torch.device(device):
        net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    untie_output_layer(net)
    net.train()
    seqs = workload(
        config.vocab_size, row_tokens=256, rows=2, micro_batches=1, prompt_fraction=0.25, seed=1
    )
    rows = plan_rows([len(s.token_ids_T) for s in seqs], 512)[0]
    micro = pack_rows([[(seqs[i], 1.0) for i in row] for row in rows], device)

    def run(ckpt: bool) -> tuple[Any, list[Any]]:
        if ckpt:
            net.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            net.gradient_checkpointing_disable()
        net.zero_grad(set_to_none=True)
        logp = packed_logprobs(net, micro, chunk_tokens=128)
        (logp * micro.advantages_T).sum().backward()
        return logp.detach().clone(), [p.grad.detach().clone() for p in net.parameters()]

    a, ga = run(False)
    b, gb = run(True)
    logp_diff = float((a - b).abs().max())
    grad_diff = max(float((x - y).abs().max()) for x, y in zip(ga, gb, strict=True))
    return {
        "layers": config.num_hidden_layers,
        "logprob_max_abs_diff": logp_diff,
        "grad_max_abs_diff": grad_diff,
        "equal": bool(np.isclose(logp_diff, 0.0, atol=1e-6) and grad_diff <= 1e-6),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model (the test's path)")
    parser.add_argument(
        "--model", default=None, help="config.json folder (default: Qwen3-4B; dry run: tiny)"
    )
    parser.add_argument("--timeout-s", type=float, default=420.0, help="budget of the probe step")
    args = parser.parse_args()
    start = time.time()
    out: dict[str, Any] = {"check": "gpu_check", "dry_run": args.dry_run}
    missing = _missing()
    if missing:
        print(json.dumps({**out, "error": missing}))
        return
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(
            json.dumps(
                {
                    **out,
                    "error": "no CUDA device (torch.cuda.is_available() is False); --dry-run runs on CPU",
                }
            )
        )
        return
    model = (
        Path(args.model)
        if args.model
        else REPO / ("runs/tiny-model" if args.dry_run else "configs/models/qwen3-4b")
    )
    if not (model / "config.json").is_file():
        print(json.dumps({**out, "error": f"{model}/config.json is missing"}))
        return
    device = "cpu" if args.dry_run else "cuda"
    out.update(
        torch=torch.__version__, device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    )
    try:
        out["step"] = probe(model, dry_run=args.dry_run, timeout_s=args.timeout_s)
    except subprocess.TimeoutExpired:
        out["step"] = {"error": f"memory probe ran past {args.timeout_s} s"}
    try:
        out["checkpointing_equality"] = checkpointing_equality(model, device=device)
    except Exception as e:  # a failure is data: the line still comes out
        out["checkpointing_equality"] = {"error": f"{type(e).__name__}: {e}"}
    step = out["step"]
    out["ok"] = (
        "error" not in step
        and abs(step.get("rel_error") or 1) <= 0.25
        and bool(out["checkpointing_equality"].get("equal"))
    )
    out["wall_s"] = round(time.time() - start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
