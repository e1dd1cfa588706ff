"""Prefix sharing in the learner: one optimisation step with and without ``share_prefix``.

The batch is GRPO-structured as an agent's is: groups of ``--group-size`` samples that share
a prompt of ``--prompt`` tokens (system prompt with tool schemas plus the task: most of
each sequence), each with its own completion (``--completion-min``..``--completion-max``
tokens, the loss tokens). One DeepSpeed (ZeRO-0, CPU/gloo or GPU) engine runs GRPO steps
(``trainer.optimise``, the learner's path: ``build_minibatch`` + ``optimise``) on that
batch, alternating the unshared packing and the shared one, so the two are paired in time.
The learning rate is 0, so every step sees the same weights and the two sides' loss and
gradient norm can be compared: equal results, not only speed.

Reported: the median step time of each side and their ratio (``speedup``), the tokens each
pushed through the model, the step's peak allocator bytes above its start, and the largest
relative differences of the loss statistics and gradient norm.

    .venv/bin/python bench/prefix_share_bench.py --json
    .venv/bin/python bench/prefix_share_bench.py --checkpointing --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def make_groups(
    rng: np.random.Generator, *, groups: int, group_size: int, prompt: int, completion: tuple[int, int],
    vocab: int,
) -> list:  # fmt: skip
    """TrainSequences: ``groups`` prompts, ``group_size`` completions each."""
    from sandpiper.trainer.packing import TrainSequence

    seqs = []
    for g in range(groups):
        head = rng.integers(10, vocab, prompt).astype(np.int32)
        rewards = rng.random(group_size)
        advs = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for k, a in enumerate(advs):
            tail = rng.integers(10, vocab, rng.integers(completion[0], completion[1] + 1))
            ids = np.concatenate([head, tail.astype(np.int32)])
            mask = np.r_[np.zeros(prompt, bool), np.ones(len(tail), bool)]
            # near the random model's own logprobs (~ -log V), as a sampler's would be
            behav = np.where(mask, -np.log(vocab) + rng.normal(0, 0.05, len(ids)), np.nan)
            seqs.append(TrainSequence(f"{g}/{k}", ids, mask, behav.astype(np.float32), float(a)))
    return seqs


def make_step(model_dir: Path, seqs: list, *, checkpointing: bool, micro_batch_tokens: int):
    """``step(share) -> (PassResult, forward tokens)`` on one engine (lr 0)."""
    from sandpiper.config import LearnerConfig
    from sandpiper.trainer.checkpoint import load_model
    from sandpiper.trainer.engine import build_engine, init_distributed
    from sandpiper.trainer.loss import LossConfig, grpo_loss
    from sandpiper.trainer.optimise import build_minibatch, optimise
    from sandpiper.trainer.prefix import Sharing, attention_tokens

    world = init_distributed()
    lc = LearnerConfig(micro_batch_tokens=micro_batch_tokens, lr=0.0)
    engine = build_engine(
        load_model(model_dir), ds_config_path=REPO_ROOT / lc.deepspeed_config, world=world,
        lr=0.0, weight_decay=0.0, max_grad_norm=1.0, precision="fp32",
        gradient_checkpointing=checkpointing,
    )  # fmt: skip
    loss_cfg = LossConfig()

    def loss_fn(logp_T, micro, prox_T):
        return grpo_loss(
            logp_T, prox_T, micro.logp_behav_T, micro.advantages_T, micro.loss_mask_T,
            micro.token_scale_T, micro.seq_index_T, micro.num_seqs, loss_cfg,
        )  # fmt: skip

    # as the learner builds it (Learner._sharing), rows within the micro-batch
    sharing = Sharing(micro_batch_tokens, attention_tokens(engine.module.config))

    def step(share: bool):
        micros = build_minibatch(
            seqs, learner_cfg=lc, world=world, sharing=sharing if share else None
        )
        result = optimise(
            engine, [micros], loss_fn, epochs=1, logprob_chunk_tokens=lc.logprob_chunk_tokens
        )
        return result

    return step


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def run(args: argparse.Namespace) -> dict:
    from bench.learner_bench import bench_model, step_peak_bytes
    from sandpiper.trainer.engine import shutdown_distributed

    with tempfile.TemporaryDirectory(prefix="prefix-share-bench-") as tmp:
        model_dir, vocab = bench_model(args.model, Path(tmp))
        seqs = make_groups(
            np.random.default_rng(0), groups=args.groups, group_size=args.group_size,
            prompt=args.prompt, completion=(args.completion_min, args.completion_max), vocab=vocab,
        )  # fmt: skip
        step = make_step(
            model_dir, seqs, checkpointing=args.checkpointing,
            micro_batch_tokens=args.micro_batch_tokens,
        )  # fmt: skip
        results = {share: step(share) for share in (False, True)}  # warm-up (optimiser state)
        peaks = {share: step_peak_bytes(lambda s=share: step(s)) for share in (False, True)}
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for share in (False, True):
                start = time.perf_counter()
                results[share] = step(share)
                times[share].append(time.perf_counter() - start)
            print(f"step_s plain={times[False][-1]:.3f} shared={times[True][-1]:.3f}",
                  file=sys.stderr)  # fmt: skip
    step = None  # holds the engine, and the engine its process group
    shutdown_distributed()
    plain, shared = results[False], results[True]
    plain_s, shared_s = statistics.median(times[False]), statistics.median(times[True])
    tokens = sum(len(s.token_ids_T) for s in seqs)
    return {
        "model": args.model,
        "checkpointing": args.checkpointing,
        "sequences": len(seqs),
        "tokens": tokens,
        "prompt_share": round(args.groups * args.group_size * args.prompt / tokens, 3),
        "plain_forward_tokens": plain.forward_tokens,
        "shared_forward_tokens": shared.forward_tokens,
        "plain_step_s": round(plain_s, 4),
        "shared_step_s": round(shared_s, 4),
        "speedup": round(plain_s / shared_s, 3),
        "plain_step_peak_bytes": peaks[False],
        "shared_step_peak_bytes": peaks[True],
        "loss_tokens_equal": plain.stats.tokens == shared.stats.tokens,
        "grad_norm_rel_diff": float(f"{rel(shared.grad_norm, plain.grad_norm):.2e}"),
        "w_sum_rel_diff": float(f"{rel(shared.stats.w_sum, plain.stats.w_sum):.2e}"),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=768, help="shared prompt tokens")
    parser.add_argument("--completion-min", type=int, default=32)
    parser.add_argument("--completion-max", type=int, default=192)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()
    result = run(args)
    for key, value in result.items():
        print(f"{key}: {value}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
