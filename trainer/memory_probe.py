"""Measure a learner step's peak memory and compare it with the planner (:mod:`memory_plan`).

Runs the learner's own path (``engine.build_engine``, ``optimise.build_minibatch``,
``optimise.optimise`` with ``loss.grpo_loss``) for ``--steps`` optimiser steps on a randomly
initialised model built from a ``config.json`` (no weights needed), on a packed synthetic batch,
and prints one JSON object: the measured peak, the planner's prediction for the same setup, their
relative error, and tokens/s of the last step. One process per case: peak memory is a
high-water mark of the process.

What "peak" means here: bytes allocated by torch's allocator, from before the model exists to
the end of the last step, so the planner's terms (weights, master copy, gradients, Adam
moments, activations, logprob step, buckets, step temporaries) are all inside it and nothing
else is. On CUDA that is ``torch.cuda.max_memory_allocated``. On CPU, torch keeps no such
counter, so the probe replays the allocator's own allocation and free events recorded by the
profiler (``profile_memory=True``) and takes the high-water mark of their running sum: the CPU
equivalent of the same number. Process RSS is reported beside it (``rss_delta_bytes``) but not
compared: it also holds interpreter and library pages, allocator arenas and the profiler's own
records (on the tiny model that was 260 MiB of RSS growth for a 133 MiB tensor peak).

    python -m sandpiper.trainer.memory_probe --model runs/tiny-model --precision fp32 --json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def workload(
    vocab: int, *, row_tokens: int, rows: int, micro_batches: int, prompt_fraction: float, seed: int
) -> list[Any]:
    """Sequences that pack into ``micro_batches`` x ``rows`` rows of ``row_tokens``: one row of
    one whole sequence, every other row two half-length sequences (position ids restart inside
    the row, so the micro-batch carries a packed mask, as real batches do)."""
    from sandpiper.trainer.packing import TrainSequence

    rng = np.random.default_rng(seed)
    lengths = [row_tokens] + [row_tokens // 2] * (2 * (rows * micro_batches - 1))
    seqs = []
    for i, n in enumerate(lengths):
        ids = rng.integers(10, vocab, n).astype(np.int32)
        mask = np.ones(n, bool)
        mask[: int(n * prompt_fraction)] = False
        behav = np.where(mask, -np.log(vocab), np.nan).astype(np.float32)
        seqs.append(TrainSequence(str(i), ids, mask, behav, float(rng.normal())))
    return seqs


def _ds_config(zero_stage: int, out_dir: Path) -> Path:
    """The shipped DeepSpeed JSON of ``zero_stage`` with ``bf16.enabled = "auto"``: the
    precision is the learner's (``build_engine(precision=...)``)."""
    base = Path(__file__).resolve().parent.parent / "configs" / f"deepspeed_zero{zero_stage}.json"
    config = json.loads(base.read_text())
    config["bf16"] = {**config.get("bf16", {}), "enabled": "auto"}
    path = out_dir / f"deepspeed_zero{zero_stage}.json"
    path.write_text(json.dumps(config))
    return path


class CpuPeak:
    """High-water mark of torch's CPU allocator, from the profiler's memory events."""

    def __enter__(self) -> CpuPeak:
        import torch

        self._prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        self._prof.__enter__()
        self.peak = 0
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        self._prof.__exit__(*exc)
        events = [
            e
            for e in self._prof.profiler.kineto_results.events()  # type: ignore[union-attr]
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        ]
        events.sort(key=lambda e: e.start_ns())
        running = 0
        for event in events:
            running += event.nbytes()  # type: ignore[union-attr]
            self.peak = max(self.peak, running)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the steps; the measured peak, tokens/s and the planner's prediction."""
    import torch

    from sandpiper.trainer.engine import build_engine, init_distributed

    world = init_distributed()
    from transformers import AutoConfig, AutoModelForCausalLM

    from sandpiper.config import LearnerConfig
    from sandpiper.trainer import memory_plan as mp
    from sandpiper.trainer.checkpoint import untie_output_layer
    from sandpiper.trainer.loss import LossConfig, grpo_loss
    from sandpiper.trainer.optimise import build_minibatch, optimise

    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.model)
    on_cuda = world.device.type == "cuda"
    seqs = workload(
        config.get_text_config().vocab_size, row_tokens=args.row_tokens, rows=args.rows,
        micro_batches=args.micro_batches, prompt_fraction=args.prompt_fraction, seed=args.seed,
    )  # fmt: skip
    micro_tokens = args.rows * args.row_tokens
    learner_cfg = LearnerConfig(micro_batch_tokens=micro_tokens, lr=1e-6)
    loss_cfg = LossConfig()

    def loss_fn(logp_T: Any, micro: Any, prox_T: Any) -> Any:
        return grpo_loss(
            logp_T, prox_T, micro.logp_behav_T, micro.advantages_T, micro.loss_mask_T,
            micro.token_scale_T, micro.seq_index_T, micro.num_seqs, loss_cfg,
        )  # fmt: skip

    rss0 = _rss_bytes()
    tracker = CpuPeak() if not on_cuda else None
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(world.device)
    else:
        assert tracker is not None
        tracker.__enter__()
    times: list[float] = []
    tmp = tempfile.mkdtemp(prefix="memory-probe-")
    try:
        with world.device:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        untie_output_layer(model)
        engine = build_engine(
            model, ds_config_path=_ds_config(args.zero_stage, Path(tmp)), world=world, lr=1e-6,
            weight_decay=0.0, max_grad_norm=1.0, precision=args.precision,
            gradient_checkpointing=args.checkpointing,
        )  # fmt: skip
        del model
        for _ in range(args.steps):
            start = time.perf_counter()
            minibatch = build_minibatch(seqs, learner_cfg=learner_cfg, world=world)
            result = optimise(
                engine, [minibatch], loss_fn, epochs=1, logprob_chunk_tokens=args.chunk_tokens
            )
            if on_cuda:
                torch.cuda.synchronize(world.device)
            times.append(time.perf_counter() - start)
        del engine
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if tracker is not None:
            tracker.__exit__(None, None, None)
    peak = torch.cuda.max_memory_allocated(world.device) if on_cuda else tracker.peak  # type: ignore[union-attr]
    shape = mp.model_shape(args.model)
    setup = mp.LearnerSetup(
        precision=args.precision, zero_stage=args.zero_stage, world_size=1,
        micro_batch_tokens=micro_tokens, row_tokens=args.row_tokens, packed=True,
        gradient_checkpointing=args.checkpointing, logprob_chunk_tokens=args.chunk_tokens,
        loss_token_fraction=1.0 - args.prompt_fraction, device="cuda" if on_cuda else "cpu",
    )  # fmt: skip
    gpu_terms, _ = mp.learner_terms(shape, setup)
    # the allocator's count excludes the CUDA context and fragmentation margin: compare tensors
    predicted = mp.learner_peak(gpu_terms, "cpu")
    tokens = sum(len(s.token_ids_T) for s in seqs)
    return {
        "model": str(args.model),
        "device": world.device.type,
        "precision": args.precision,
        "gradient_checkpointing": args.checkpointing,
        "zero_stage": args.zero_stage,
        "params_trained": shape.params_trained,
        "micro_batch_tokens": micro_tokens,
        "micro_batches": args.micro_batches,
        "steps": args.steps,
        "measured_peak_bytes": int(peak),
        "predicted_peak_bytes": int(predicted),
        "rel_error": round((predicted - peak) / peak, 4) if peak else None,
        "terms": gpu_terms,
        "rss_delta_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0,
        "tokens_per_s": round(tokens / times[-1], 1) if times else None,
        "step_s": [round(t, 3) for t in times],
        "loss_tokens": int(result.stats.tokens),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="folder with a config.json (weights unused)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on")
    p.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--row-tokens", type=int, default=512, help="tokens per packed row")
    p.add_argument("--rows", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=2, help="optimiser steps (2: Adam state exists)")
    p.add_argument("--prompt-fraction", type=float, default=0.25, help="tokens outside the loss")
    p.add_argument("--chunk-tokens", type=int, default=1024, help="learner.logprob_chunk_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        result = measure(args)
    finally:
        from sandpiper.trainer.engine import shutdown_distributed

        shutdown_distributed()
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
