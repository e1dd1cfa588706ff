"""Does a real model learn a real task family on CPU? SmolLM2-135M on a family it did not write.

    python bench/learns_bench.py [--suite peer|reasoning-gym:products] [--minutes 30]
                                 [--train-tasks 64] [--heldout-tasks 128]
                                 [--runs-dir runs/learns] [--out FILE] [--json]

1. The suite:
   - ``peer`` (bench/race_setup.py): LLM-in-Sandbox-RL rows of the "sum the numbers in
     numbers.txt" family, imported unchanged with ``sandpiper tasks import``; the held-out
     tasks come from another seed and other ids (checked: no id and no answer shared).
   - ``reasoning-gym:products``: reasoning-gym's ``products`` dataset (multiply two numbers
     of up to five digits), imported with ``sandpiper tasks import reasoning-gym:products
     --validation-size N``; the held-out items are the importer's validation split, built
     from a seed range that cannot meet the training one (checked: no id and no question
     shared). The reward is the library's own ``score_answer``, partial credit kept.
2. A warm start: SmolLM2-135M, SFT (``sandpiper learn --algo sft``) on the demo's scripted
   weak teacher (bash blocks, computing in 30 % of its episodes, guessing a number in the
   rest; for ``products`` it computes ``python3 -c 'print(A * B)'`` with the numbers of the
   question) on the TRAIN tasks only.
   SmolLM2 makes no tool calls of its own, so without it there is no reward signal.
   Cached in ``<runs-dir>/start``: a rerun skips it.
3. Held-out pass@1 BEFORE (the warm start): the race's eval harness (bench/race_eval.py,
   ``sandpiper collect --eval``), one sample per held-out task.
4. ``sandpiper collect`` + ``sandpiper learn`` (GRPO, the demo's launcher) for ``--minutes``
   on the train tasks.
5. Held-out pass@1 AFTER, on the newest checkpoint, same harness and sampling.
6. n, passes, pass@1 (reward >= 1) with a 95 % Wilson interval before and after, the
   difference with a 95 % interval (Newcombe's hybrid score method) and McNemar's
   discordant counts (the same tasks are scored twice) with the exact two-sided p-value;
   the mean score (partial credit counted) with a 95 % Student-t interval before and after,
   and the paired difference of the per-task scores with its 95 % t interval.

Each finished phase is recorded in ``<runs-dir>/phases.json``; a rerun with the same
arguments resumes after the last finished one (delete the folder to start over).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from race_setup import MODELS, RaceSettings, model_hash  # noqa: E402  (bench scripts import their siblings)
from race_stats import Z95, t_interval, wilson  # noqa: E402  (one copy, also the race's)
from race_suites import import_reasoning_gym, prepare_suite, task_ids  # noqa: E402
from warm_start import TEACHERS, Teacher, sft_warm_start, teacher_record  # noqa: E402

from sandpiper.errors import SandpiperError  # noqa: E402

SEED = 0


# --- intervals (pure) --------------------------------------------------------------------


def newcombe_difference(
    passes_a: int, n_a: int, passes_b: int, n_b: int, z: float = Z95
) -> tuple[float, float, float]:
    """(p_a - p_b, lower, upper): Newcombe's hybrid score interval (1998, method 10).

    Built from the two Wilson intervals; it treats the samples as independent, which for
    paired samples (the same tasks before and after) that agree more than chance makes it
    wider, not narrower, than a paired interval."""
    p_a, p_b = passes_a / n_a, passes_b / n_b
    lo_a, hi_a = wilson(passes_a, n_a, z)
    lo_b, hi_b = wilson(passes_b, n_b, z)
    diff = p_a - p_b
    lower = diff - math.sqrt((p_a - lo_a) ** 2 + (hi_b - p_b) ** 2)
    upper = diff + math.sqrt((hi_a - p_a) ** 2 + (p_b - lo_b) ** 2)
    return diff, lower, upper


def mcnemar_exact_p(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (binomial, p = 1/2)."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def passed(score: float | bool) -> bool:
    """A pass: the full reward (a float score of 1, or an older run's boolean)."""
    return float(score) >= 1.0


def compare(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Before and after (task id -> score): pass@1 and mean score, their intervals, the
    paired counts and the paired score difference."""

    def one(scores: dict[str, float]) -> dict[str, Any]:
        n, k = len(scores), sum(passed(v) for v in scores.values())
        lo, hi = wilson(k, n)
        mean, m_lo, m_hi = t_interval([float(v) for v in scores.values()])
        return {"n": n, "passes": k, "pass_at_1": k / n, "wilson95": [lo, hi],
                "mean_score": mean, "mean_score_t95": [m_lo, m_hi]}  # fmt: skip

    diff, lo, hi = newcombe_difference(
        sum(map(passed, after.values())),
        len(after),
        sum(map(passed, before.values())),
        len(before),
    )
    paired = sorted(set(before) & set(after))
    only_after = sum(passed(after[t]) and not passed(before[t]) for t in paired)
    only_before = sum(passed(before[t]) and not passed(after[t]) for t in paired)
    d_mean, d_lo, d_hi = t_interval([float(after[t]) - float(before[t]) for t in paired])
    return {
        "before": one(before),
        "after": one(after),
        "difference": {"after_minus_before": diff, "newcombe95": [lo, hi]},
        "score_difference": {
            "paired_tasks": len(paired),
            "mean_after_minus_before": d_mean,
            "paired_t95": [d_lo, d_hi],
        },
        "mcnemar": {
            "paired_tasks": len(paired),
            "pass_after_only": only_after,
            "pass_before_only": only_before,
            "exact_p_two_sided": mcnemar_exact_p(only_after, only_before),
        },
    }


# --- the run -----------------------------------------------------------------------------


def prepare(suite: Teacher, settings: RaceSettings, root: Path) -> tuple[Path, Path]:
    """(train tasks, held-out tasks) of ``suite`` under ``root`` (idempotent)."""
    if suite.name == "peer":
        return prepare_suite(settings, root)
    return import_reasoning_gym(suite.name.split(":", 1)[1], settings, root)


def base_config(runs_dir: Path, name: str, tasks: Path, model: Path) -> Any:
    """``configs/demo-smollm2.toml`` (bash blocks) on ``tasks``, its store in its run folder."""
    from sandpiper.config import load_config

    cfg = load_config(REPO / "configs" / "demo-smollm2.toml",
                      ["--runs_dir", str(runs_dir), "--name", name,
                       "--store.url", f"duckdb:///{runs_dir}/{name}/store.duckdb",
                       "--tracking.enabled", "false"])  # fmt: skip
    cfg.collector.tasks, cfg.collector.validation_fraction = str(tasks), 0.0
    cfg.learner.model = str(model)
    return cfg


def check_disjoint(train: Path, heldout: Path, field: str = "answer") -> None:
    """Refuse a suite where a held-out task shares an id, or its answer or prompt (``field``),
    with a train task. (Two products items may share an answer, 2 * 6 and 3 * 4, but never a
    question.)"""
    from sandpiper.collector.tasks.loading import load_tasks

    train_ids, held_ids = set(task_ids(train)), set(task_ids(heldout))
    if train_ids & held_ids:
        raise SandpiperError(f"train and held-out share ids: {sorted(train_ids & held_ids)[:5]}")

    def values(source: Path) -> set[str]:
        if field == "prompt":
            return {t.instruction for t in load_tasks(source)}
        return {str(getattr(t.reference, "answer", None)) for t in load_tasks(source)}

    shared = values(train) & values(heldout)
    if shared:
        raise SandpiperError(f"train and held-out share {field}s: {sorted(shared)[:5]}")


def warm_start(root: Path, train: Path, suite: Teacher, log: Any) -> tuple[Path, dict[str, Any]]:
    """SFT on the scripted teacher's episodes on the train tasks (bench/warm_start.py);
    cached in ``root/start``."""
    from sandpiper.demo import run as demo
    from sandpiper.demo.tasks import COMPUTE_FRACTION

    start = root / "start"
    cfg = base_config(root, "warmstart", train, MODELS["smollm2"])
    if not (start / "config.json").is_file():
        demo.ensure_model(str(MODELS["smollm2"]))
        log(f"warm start: {len(task_ids(train))} teacher episodes "
            f"(computing in {COMPUTE_FRACTION:.0%}), then SFT")  # fmt: skip
        checkpoint = sft_warm_start(
            cfg,
            sft_learner=demo.DEMO_MODELS["smollm2"].sft_learner,
            log_path=root / "warmstart.log",
            instruction=suite.instruction,
            compute_command=suite.compute_command,
        )
        shutil.copytree(checkpoint, start, ignore=shutil.ignore_patterns("train_state"))
    info = {"checkpoint": str(start), "sha256_16": model_hash(start),
            **teacher_record(cfg.store.url, cfg.name)}  # fmt: skip
    return start, info


def evaluate(cfg: Any, checkpoint: Path, heldout: Path, out: Path, label: str) -> dict[str, Any]:
    """Held-out score of one checkpoint (task id -> reward, partial credit kept; an episode
    with no reward scores 0): a fresh eval harness, one sample per task."""
    from race_eval import Checkpoint, Harness

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.time()
    with Harness(cfg, start=checkpoint, heldout=heldout, out=out, samples=1) as harness:
        result = harness.evaluate(Checkpoint(label, str(checkpoint), 0.0, label))
    from sandpiper.analysis import api

    frame = api.episodes(f"duckdb:///{out}/eval.duckdb", run_id=result["run_id"])
    per_task: dict[str, float] = {}
    for row in frame.iter_rows(named=True):
        if row["valid"]:
            per_task[row["task_id"]] = float(row["reward"] or 0.0)
    return {**result, "wall_s": time.time() - t0, "per_task": per_task}


def train(cfg: Any, minutes: float) -> dict[str, Any]:
    """``sandpiper collect`` + ``sandpiper learn`` (GRPO) for ``minutes``; what it made."""
    from race_eval import _free_port

    from sandpiper.analysis import api
    from sandpiper.demo import run as demo
    from sandpiper.store import Store

    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    cfg.learner.max_steps = 0  # the wall-clock budget ends the run
    cfg.inference.base_port = _free_port()  # other runs on this machine may hold 8100
    t0 = time.time()
    demo.run_grpo(cfg, minutes=minutes, on_tick=lambda: None)
    wall_s = time.time() - t0
    latest = Store(cfg.store.url).policy_versions.latest(cfg.name)
    episodes = api.episodes(cfg.store.url, run_id=cfg.name)
    by_version = demo.reward_table(cfg.store.url, cfg.name)
    return {
        "wall_s": wall_s,
        "versions_trained": latest.version if latest else 0,
        "newest_checkpoint": latest.checkpoint_uri if latest and latest.version else None,
        "episodes": episodes.height,
        "train_reward_by_version": by_version.to_dicts(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--suite", choices=sorted(TEACHERS), default="peer", help="the task family (default: peer)"
    )
    parser.add_argument("--minutes", type=float, default=30.0, help="GRPO wall-clock budget")
    parser.add_argument("--train-tasks", type=int, default=64)
    parser.add_argument("--heldout-tasks", type=int, default=128, help="one sample each")
    parser.add_argument(
        "--runs-dir", type=Path, help="the run's folder (default: runs/learns/<suite>)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON, last")
    parser.add_argument("--out", type=Path, help="also write the result (JSON) to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    suite = TEACHERS[args.suite]
    slug = suite.name.replace(":", "-")
    root = (args.runs_dir or REPO / "runs" / "learns" / slug).resolve()
    root.mkdir(parents=True, exist_ok=True)
    state_path = root / "phases.json"
    state: dict[str, Any] = json.loads(state_path.read_text()) if state_path.is_file() else {}
    wanted = {"suite": suite.name, "minutes": args.minutes, "train_tasks": args.train_tasks,
              "heldout_tasks": args.heldout_tasks}  # fmt: skip
    if state.get("args", wanted) != wanted:
        raise SystemExit(f"{root} holds a run with {state['args']}; give another --runs-dir")
    state["args"] = wanted
    t_start = time.time()

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    def save() -> None:
        state_path.write_text(json.dumps(state, indent=2))

    settings = RaceSettings(model="smollm2", suite="peer", minutes=args.minutes,
                            train_tasks=args.train_tasks, heldout_tasks=args.heldout_tasks,
                            seed=SEED)  # fmt: skip
    train_dir, heldout = prepare(suite, settings, root / "tasks")
    check_disjoint(train_dir, heldout, suite.shared_field)
    log(f"{suite.name}: {len(task_ids(train_dir))} train, {len(task_ids(heldout))} held-out")
    if "warm_start" not in state:
        t0 = time.time()
        start, info = warm_start(root, train_dir, suite, log)
        state["warm_start"] = {**info, "wall_s": time.time() - t0}
        save()
    start = Path(state["warm_start"]["checkpoint"])
    log(f"warm start {start} sha256 {state['warm_start']['sha256_16']} "
        f"(teacher passes {state['warm_start']['teacher_passes']}/"
        f"{state['warm_start']['teacher_episodes']})")  # fmt: skip
    grpo_cfg = base_config(root, "grpo", train_dir, start)
    if "before" not in state:
        log(f"held-out pass@1 before: {len(task_ids(heldout))} tasks")
        state["before"] = evaluate(grpo_cfg, start, heldout, root / "eval-before", "before")
        save()
    before_scores = state["before"]["per_task"].values()
    log(f"before: {sum(map(passed, before_scores))}/{len(before_scores)} passed")
    if "train" not in state:
        log(f"GRPO for {args.minutes:g} min on the train tasks")
        state["train"] = train(grpo_cfg, args.minutes)
        save()
    newest = state["train"]["newest_checkpoint"]
    log(f"trained {state['train']['versions_trained']} versions, "
        f"{state['train']['episodes']} episodes; newest {newest}")  # fmt: skip
    if newest is None:
        raise SystemExit("GRPO made no new version: nothing to evaluate after")
    if "after" not in state:
        state["after"] = evaluate(grpo_cfg, Path(newest), heldout, root / "eval-after", "after")
        save()
    result = {
        "model": "SmolLM2-135M-Instruct (runs/smollm2-135m)",
        "suite": suite.description,
        "action_format": grpo_cfg.collector.tool_parser,
        "sampling": {
            "temperature": grpo_cfg.collector.temperature,
            "top_p": grpo_cfg.collector.top_p,
            "samples_per_task": 1,
        },
        **wanted,
        "warm_start": state["warm_start"],
        "train": state["train"],
        **compare(state["before"]["per_task"], state["after"]["per_task"]),
        "eval_wall_s": {"before": state["before"]["wall_s"], "after": state["after"]["wall_s"]},
        "wall_s_this_invocation": time.time() - t_start,
    }
    print_result(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    return result


def print_result(r: dict[str, Any]) -> None:
    def line(name: str, one: dict[str, Any]) -> str:
        lo, hi = one["wilson95"]
        m_lo, m_hi = one["mean_score_t95"]
        return (f"{name:<7} pass@1 {one['pass_at_1']:.3f} ({one['passes']}/{one['n']}), "
                f"95% Wilson [{lo:.3f}, {hi:.3f}]; mean score {one['mean_score']:.3f}, "
                f"95% t [{m_lo:.3f}, {m_hi:.3f}]")  # fmt: skip

    d, m = r["difference"], r["mcnemar"]
    print(line("before", r["before"]))
    print(line("after", r["after"]))
    print(f"after - before {d['after_minus_before']:+.3f}, 95% Newcombe "
          f"[{d['newcombe95'][0]:+.3f}, {d['newcombe95'][1]:+.3f}]; McNemar: "
          f"{m['pass_after_only']} pass only after, {m['pass_before_only']} only before "
          f"(exact p = {m['exact_p_two_sided']:.3g})")  # fmt: skip
    sd = r["score_difference"]
    print(f"mean score after - before (paired, {sd['paired_tasks']} tasks) "
          f"{sd['mean_after_minus_before']:+.3f}, 95% t [{sd['paired_t95'][0]:+.3f}, "
          f"{sd['paired_t95'][1]:+.3f}]")  # fmt: skip
    t = r["train"]
    print(f"GRPO: {t['versions_trained']} versions, {t['episodes']} episodes, "
          f"{t['wall_s']:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
