"""Peak CPU memory of the learner's logprob step and of activations, one subprocess per variant.

Each variant runs in a fresh interpreter and reports the high-water mark of what torch's CPU
allocator held for the step beyond what was allocated before it (the profiler's memory
events, :class:`sandpiper.trainer.memory_probe.CpuPeak`: on a GPU the same quantity is
``torch.cuda.max_memory_allocated``). The growth of ``ru_maxrss`` was tried first and is
useless here: the interpreter's import-time peak already exceeds a chunked step, which then
showed as 0 bytes, and freed pages made the activation figure negative.

- ``logprob``: selected-token logprobs, forward and backward, of ``--tokens`` loss tokens
  through an output layer of SmolLM2's shape (hidden 576, V = 49,152; random weights: the
  memory does not depend on their values). ``full`` is the learner's computation before
  chunking (logits of every position, then the loss rows, then the cross-entropy);
  ``chunked`` is :func:`sandpiper.trainer.logprobs.selected_logprobs`.
- ``activations``: one forward and backward of the bench model on ``--tokens`` packed tokens,
  with and without gradient checkpointing; the parameters' gradients (their exact size) are
  subtracted, so what remains is activations and temporaries.

    .venv/bin/python bench/learner_memory.py logprob --variant chunked --tokens 8192
    .venv/bin/python bench/learner_memory.py activations --model-dir runs/tiny-model --variant checkpointed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SMOLLM2_HIDDEN, SMOLLM2_VOCAB = 576, 49_152


def logprob_step(variant: str, tokens: int, chunk_tokens: int) -> int:
    """Bytes the logprob step (forward + backward) added to the peak resident set."""
    import torch
    import torch.nn.functional as F

    from sandpiper.trainer.logprobs import selected_logprobs
    from sandpiper.trainer.memory_probe import CpuPeak

    torch.manual_seed(0)
    head = torch.nn.Linear(SMOLLM2_HIDDEN, SMOLLM2_VOCAB, bias=False)
    hidden = torch.randn(1, tokens, SMOLLM2_HIDDEN, requires_grad=True)
    targets = torch.randint(0, SMOLLM2_VOCAB, (tokens,))
    needed = torch.ones(1, tokens, dtype=torch.bool)
    head.weight.grad = torch.zeros_like(head.weight)  # allocated before the baseline
    hidden.grad = torch.zeros_like(hidden)
    with CpuPeak() as peak:
        if variant == "full":
            logits = head(hidden)  # (1, T, V): every position, as the model's head did
            picked = -F.cross_entropy(logits[needed].float(), targets, reduction="none")
        else:
            picked = selected_logprobs(head, hidden[needed], targets, chunk_tokens=chunk_tokens)
        picked.sum().backward()
    return peak.peak


def activation_step(variant: str, model_dir: str, tokens: int) -> int:
    """Bytes one forward + backward added to the peak, less the parameters' gradients."""
    import torch

    from sandpiper.trainer.checkpoint import load_model
    from sandpiper.trainer.memory_probe import CpuPeak
    from sandpiper.trainer.packing import TrainSequence, pack, packed_logprobs

    torch.manual_seed(0)
    model = load_model(model_dir)
    if variant == "checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    vocab = model.config.vocab_size
    import numpy as np

    rng = np.random.default_rng(0)
    n_seq, length = 4, tokens // 4
    seqs = []
    for i in range(n_seq):
        mask = np.r_[np.zeros(length // 2, bool), np.ones(length - length // 2, bool)]
        ids = rng.integers(1, vocab, length).astype(np.int32)
        seqs.append(TrainSequence(str(i), ids, mask, np.where(mask, -1.0, np.nan), 0.0))
    micro = pack(seqs, [1.0] * n_seq)
    for p in model.parameters():  # allocated before the measurement: not activations
        p.grad = torch.zeros_like(p)
    with CpuPeak() as peak:
        packed_logprobs(model, micro).sum().backward()
    return peak.peak


def measure(kind: str, variant: str, **options: object) -> int:
    """Run one variant in a fresh interpreter; its peak growth in bytes."""
    cmd = [sys.executable, __file__, kind, "--variant", variant]
    for key, value in options.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=900)
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"])


def logprob_peak_mem_ratio(tokens: int = 8192, chunk_tokens: int = 1024) -> dict[str, float]:
    """Full-logits / chunked peak of the logprob step at SmolLM2's vocabulary."""
    full = measure("logprob", "full", tokens=tokens, chunk_tokens=chunk_tokens)
    chunked = measure("logprob", "chunked", tokens=tokens, chunk_tokens=chunk_tokens)
    return {
        "logprob_peak_mem_full_bytes": full,
        "logprob_peak_mem_chunked_bytes": chunked,
        "logprob_peak_mem_ratio": round(full / max(chunked, 1), 2),
    }


def checkpointing_activation_mem_ratio(model_dir: Path, tokens: int) -> dict[str, float]:
    """Activation peak without / with gradient checkpointing on ``model_dir``."""
    plain = measure("activations", "plain", model_dir=model_dir, tokens=tokens)
    ckpt = measure("activations", "checkpointed", model_dir=model_dir, tokens=tokens)
    return {
        "activation_mem_plain_bytes": plain,
        "activation_mem_checkpointed_bytes": ckpt,
        "checkpointing_activation_mem_ratio": round(plain / max(ckpt, 1), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=["logprob", "activations"])
    parser.add_argument("--variant", required=True,
                        choices=["full", "chunked", "plain", "checkpointed"])  # fmt: skip
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--model-dir", default="runs/tiny-model")
    args = parser.parse_args()
    if args.kind == "logprob":
        peak = logprob_step(args.variant, args.tokens, args.chunk_tokens)
    else:
        peak = activation_step(args.variant, args.model_dir, args.tokens)
    print(json.dumps({"peak_bytes": peak}))


if __name__ == "__main__":
    main()
