"""``trainer/ranks.py``: two gloo processes whose collectives time out after three seconds meet
before a broadcast that rank 0 reaches nine seconds late, and a rank that fails releases
the one waiting for it. Plain torch.distributed (no DeepSpeed), about 15 s.

Three seconds, not one: with one, the broadcast itself timed out once under a loaded suite
(a rank not scheduled for a second on two busy cores); the proof is the same at any timeout
shorter than rank 0's lateness."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.conftest import REPO
from tests.fixtures.vllm import free_port

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from sandpiper.errors import LearnerError
    from sandpiper.trainer import ranks
    from sandpiper.trainer.engine import World, broadcast_from_main

    rank, mode = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    # what init_distributed does with learner.collective_timeout_s
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=3))
    world = World(rank, 2, None)
    if mode == "late":
        if rank == 0:
            time.sleep(9)  # three timeouts' worth: a plain broadcast would fail on rank 1
        print("got", broadcast_from_main("hello" if rank == 0 else None, world), flush=True)
    else:  # rank 1 fails, rank 0 waits for it
        if rank == 1:
            ranks.mark_failed(1)
            time.sleep(2)  # keep the group up while rank 0 reads the mark
            sys.exit(3)
        try:
            ranks.arrive_together(2, rank=0)
        except LearnerError as e:
            print("stopped:", e, flush=True)
    """
)


def _pair(mode: str) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": str(REPO)}  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, "-c", SCRIPT, str(r), mode], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)
    ]  # fmt: skip
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    return out


def test_ranks_meet_before_a_late_broadcast():
    r0, r1 = _pair("late")
    assert r0.returncode == 0 and r1.returncode == 0, r0.stdout[-2000:] + r1.stdout[-2000:]
    assert "got hello" in r0.stdout and "got hello" in r1.stdout


def test_a_failed_rank_releases_the_waiting_one():
    r0, r1 = _pair("failed")
    assert r1.returncode == 3
    assert "stopped: rank 1 failed; rank 0 stops waiting for it" in r0.stdout, r0.stdout[-2000:]
