"""Asynchronous vs synchronous pipeline: wall time for the same number of learner steps.

    python bench/e2e_bench.py [--steps 6] [--poll-s 0.5] [--json]

One SFT warm start (demonstrations through the real collector, then ``sandpiper learn
--algo sft``), then the GRPO phase of the demo twice from the same checkpoint, in this run:

- **async**: collector and learner overlap; the collector may run ``max_lag = 2`` versions
  ahead of what the learner consumed;
- **sync**: ``max_lag = 0``: the collector fills one batch, then waits while the learner
  trains on it (collect, then train, alternating), as a synchronous trainer does.

Both phases poll the store every ``--poll-s`` (0.5 s; the shipped defaults are 2 s and 1 s),
so that the synchronous baseline does not pay for slow polling at each hand-over.

The time of one phase is measured from its first new policy registration to its last (both
in the store), so the vLLM start-up, identical in both, is excluded. Key: ``async_speedup``
= sync seconds per step / async seconds per step (goal ≥ 1.5). The last line with ``--json``
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def seconds_per_step(store_url: str, run_id: str) -> tuple[float, int]:
    """Mean seconds between consecutive policy registrations after the first GRPO one."""
    from sandpiper.store import Store

    with Store(store_url).connect_readonly() as conn:
        from sqlalchemy import text

        rows = conn.execute(
            text("SELECT version, created_at FROM policies WHERE run_id = :r ORDER BY version"),
            {"r": run_id},
        ).all()
    times = [r[1] for r in rows if r[0] >= 1]  # version 0 is the warm start itself
    if len(times) < 2:
        raise SystemExit(f"{run_id}: fewer than 2 policy versions were registered")
    span_s = (times[-1] - times[0]).total_seconds()
    return span_s / (len(times) - 1), len(times) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="learner steps per phase")
    parser.add_argument("--minutes", type=float, default=15, help="time limit per phase")
    parser.add_argument("--tasks", type=int, default=120)
    parser.add_argument(
        "--poll-s",
        type=float,
        default=0.5,
        help="store polling interval of collector and learner, both phases (a short one keeps "
        "the synchronous baseline from waiting on polls)",
    )
    parser.add_argument("--runs-dir", default=str(REPO / "runs" / "bench-e2e"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from sandpiper.config import load_config
    from sandpiper.demo import run as demo
    from sandpiper.demo.tasks import COMPUTE_FRACTION

    runs = Path(args.runs_dir)
    shutil.rmtree(runs, ignore_errors=True)
    url = f"duckdb:///{runs}/store.duckdb"
    base = load_config(
        REPO / "configs" / "demo.toml",
        ["--runs_dir", str(runs), "--store.url", url, "--name", "bench",
         "--learner.model", str(REPO / "runs" / "tiny-model"), "--tracking.enabled", "false"],
    )  # fmt: skip
    sft, grpo = demo.prepare(base, args.tasks)
    demo.collect_demonstrations(sft, compute_fraction=COMPUTE_FRACTION)
    checkpoint = demo.run_sft(sft, runs / "sft.log")

    per_step: dict[str, float] = {}
    for mode, lag in (("async", 2), ("sync", 0)):
        cfg = grpo.model_copy(deep=True)
        cfg.name = f"bench-{mode}"
        cfg.learner.model = checkpoint
        cfg.learner.max_steps = args.steps + 1
        cfg.learner.max_lag = lag
        cfg.collector.policy_poll_s = cfg.learner.poll_interval_s = args.poll_s
        demo.run_grpo(cfg, minutes=args.minutes, on_tick=lambda: None)
        per_step[mode], steps = seconds_per_step(url, cfg.name)
        print(f"{mode:5s} max_lag={lag}: {per_step[mode]:.1f} s per learner step ({steps} steps)")

    speedup = per_step["sync"] / per_step["async"]
    print(f"async_speedup: {speedup:.2f}x (goal >= 1.5)")
    if args.json:
        print(
            json.dumps(
                {
                    "async_s_per_step": round(per_step["async"], 2),
                    "sync_s_per_step": round(per_step["sync"], 2),
                    "async_speedup": round(speedup, 3),
                    "steps": args.steps,
                    "poll_s": args.poll_s,
                }
            )
        )


if __name__ == "__main__":
    main()
