"""The learner never JIT-builds DeepSpeed's shm op on CPU (a killed build deadlocks restarts)."""

from __future__ import annotations

import subprocess
import sys


def test_init_distributed_skips_the_shm_comm_op() -> None:
    probe = (
        "import importlib\n"
        "ds_torch = importlib.import_module('deepspeed.comm.torch')\n"
        "from trainer.engine import disable_shm_comm_op\n"
        "disable_shm_comm_op()\n"
        "assert ds_torch.build_shm_op() is None, 'DeepSpeed would still build the shm op'\n"
    )
    env_run = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert env_run.returncode == 0, env_run.stderr[-2000:]
