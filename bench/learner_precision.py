"""Is bf16 faster than fp32 for the learner on this CPU? One forward + backward per step.

DeepSpeed's bf16 mode runs the module in bf16 (the fp32 master copy only meets the
optimiser), so the compute that differs is a forward + backward of the model cast to bf16
against the fp32 model: that is what is timed here, on packed sequences through the
learner's own :func:`~sandpiper.trainer.packing.packed_logprobs`. The median of
``--repeats`` steps after one warm-up; ``trainer/engine.py``'s ``CPU_AUTO_PRECISION`` (what
``learner.precision = "auto"`` means on a CPU) follows from the ratio.

    .venv/bin/python bench/learner_precision.py --model-dir runs/tiny-model --tokens 4096
    .venv/bin/python bench/learner_precision.py --model-dir runs/smollm2-135m --tokens 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def step_seconds(model_dir: str, dtype: str, tokens: int, repeats: int) -> float:
    import torch

    from sandpiper.trainer.checkpoint import load_model
    from sandpiper.trainer.packing import TrainSequence, pack, packed_logprobs

    model = load_model(model_dir).to(getattr(torch, dtype)).train()
    rng = np.random.default_rng(0)
    length = tokens // 4
    mask = np.r_[np.zeros(length // 2, bool), np.ones(length - length // 2, bool)]
    seqs = [
        TrainSequence(str(i), rng.integers(1, model.config.vocab_size, length).astype(np.int32),
                      mask, np.where(mask, -1.0, np.nan).astype(np.float32), 1.0)
        for i in range(4)
    ]  # fmt: skip
    micro = pack(seqs, [1.0] * 4)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        packed_logprobs(model, micro).sum().backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default="runs/tiny-model")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    fp32 = step_seconds(args.model_dir, "float32", args.tokens, args.repeats)
    bf16 = step_seconds(args.model_dir, "bfloat16", args.tokens, args.repeats)
    print(json.dumps({
        "model_dir": args.model_dir, "tokens": args.tokens, "fp32_step_s": round(fp32, 4),
        "bf16_step_s": round(bf16, 4), "bf16_speedup": round(fp32 / bf16, 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
