"""Learner process set-up and tear-down: no JIT build of the shm op (a killed build deadlocks
restarts) and no live process group at exit (it aborts a rank at random)."""

from __future__ import annotations

import subprocess
import sys


def _run_probe(probe: str) -> None:
    """Run ``probe`` in a fresh interpreter (a process group or a DeepSpeed import must not
    leak into the test process); it fails by raising."""
    env_run = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert env_run.returncode == 0, env_run.stderr[-2000:]


def test_init_distributed_skips_the_shm_comm_op() -> None:
    probe = (
        "import importlib\n"
        "ds_torch = importlib.import_module('deepspeed.comm.torch')\n"
        "from sandpiper.trainer.engine import disable_shm_comm_op\n"
        "disable_shm_comm_op()\n"
        "assert ds_torch.build_shm_op() is None, 'DeepSpeed would still build the shm op'\n"
    )
    _run_probe(probe)


def test_run_learner_destroys_the_process_group_on_success_and_on_failure() -> None:
    """A learner process leaves its gloo group before the interpreter finalizes: one still
    alive at exit aborts a rank at random ("terminate called without an active exception",
    8 of 40 two-rank runs here). ``_run`` is replaced so only the wrapping is exercised."""
    probe = (
        "import torch.distributed as dist\n"
        "import sandpiper.trainer.main as m\n"
        "seen = []\n"
        "def ok(cfg, world):\n"
        "    seen.append(dist.is_initialized())\n"
        "    return 3\n"
        "def fail(cfg, world):\n"
        "    seen.append(dist.is_initialized())\n"
        "    raise RuntimeError('boom')\n"
        "m._run = ok\n"
        "assert m.run_learner(None) == 3\n"
        "assert not dist.is_initialized(), 'left alive after a clean run'\n"
        "m._run = fail\n"
        "try:\n"
        "    m.run_learner(None)\n"
        "except RuntimeError:\n"
        "    pass\n"
        "assert not dist.is_initialized(), 'left alive after a failed run'\n"
        "assert seen == [True, True], seen\n"
    )
    _run_probe(probe)
