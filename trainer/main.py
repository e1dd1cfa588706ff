"""Learner process entry point: ``python -m sandpiper.trainer --config run.toml [--algo sft] [overrides]``.

``sandpiper learn`` calls :func:`run_learner` in-process for one process, or starts
``deepspeed --num_gpus N --no_local_rank --module sandpiper.trainer ...`` for several (the DeepSpeed
launcher sets RANK / WORLD_SIZE / ... for each process; ``torchrun -m sandpiper.trainer`` works too).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from sandpiper.config import LearnerSettings, load_config, write_resolved
from sandpiper.version import code_version

if TYPE_CHECKING:  # torch is imported late: `sandpiper --help` stays fast
    from sandpiper.trainer.engine import World


def run_learner(cfg: LearnerSettings) -> int:
    """Run GRPO (until ``max_steps`` / ``max_idle_s``) or one SFT pass; returns steps done."""
    from sandpiper.trainer.engine import init_distributed, shutdown_distributed
    from sandpiper.trainer.ranks import mark_failed

    lc = cfg.learner
    # before anything imports deepspeed with the wrong accelerator
    world = init_distributed(lc.device, collective_timeout_s=lc.collective_timeout_s)
    clean = False
    try:
        steps = _run(cfg, world)
        clean = True
        return steps
    except BaseException as e:
        # The failed run's frames (its traceback) hold the learner, so its engine and its
        # process groups: clear their locals, or the groups' gloo threads outlive the
        # shutdown below and the exit can abort (SIGABRT) instead of reporting the error.
        traceback.clear_frames(e.__traceback__)
        mark_failed(world.rank)  # the other ranks stop waiting for this one
        raise
    finally:
        shutdown_distributed(clean=clean)


def _run(cfg: LearnerSettings, world: World) -> int:
    _log_to_stderr()

    from sandpiper.store import Store
    from sandpiper.store.records import RunRecord
    from sandpiper.trainer.learner import Learner
    from sandpiper.trainer.sft import run_sft
    from sandpiper.trainer.tracking import Tracker

    store = None
    if world.is_main:
        write_resolved(cfg)
        store = Store(cfg.store.url, lock_timeout_s=cfg.store.lock_timeout_s)
        store.init()
        store.ensure_run(RunRecord(cfg.name, cfg.resolved_json, code_version()))
    learner = Learner(cfg, store, world)
    tracker = Tracker(
        cfg.tracking,
        runs_dir=cfg.runs_dir,
        run_name=f"{cfg.name}-{cfg.learner.algo}",
        params=json.loads(cfg.resolved_json),
        active=world.is_main,
    )
    status = "FAILED"
    try:
        if cfg.learner.algo == "sft":
            learner.tracker = tracker
            run_sft(learner)
            learner.finish()
            steps = 1
        else:
            steps = learner.run(tracker)
        status = "FINISHED"
        return steps
    finally:
        learner.close(release=True)  # a standby takes over at once, not after the lease
        tracker.close(status)


def _log_to_stderr() -> None:
    """The learner's own INFO lines (leadership, resume, retention) on stderr, once each:
    through the root handler of :func:`setup_logging` (which adds the rank when there are
    several), set up here too when the learner runs without the CLI."""
    from transformers.utils import logging as hf_logging

    from sandpiper.logs import setup_logging

    setup_logging()  # idempotent: the CLI's handler stays the only one
    hf_logging.disable_progress_bar()  # one bar per checkpoint save/load otherwise


def main(argv: list[str] | None = None) -> None:
    from sandpiper.logs import setup_logging

    setup_logging()  # launched by deepspeed/torchrun, not through the sandpiper CLI
    args = list(sys.argv[1:] if argv is None else argv)
    config: Path | None = None
    if "--config" in args:
        i = args.index("--config")
        config = Path(args[i + 1])
        del args[i : i + 2]
    if "--algo" in args:
        i = args.index("--algo")
        args[i] = "--learner.algo"
    run_learner(load_config(config, args).for_learner())


if __name__ == "__main__":
    main()
