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
        "from sandpiper.config import RunConfig\n"
        "cfg = RunConfig().for_learner()  # run_learner reads the device and timeout first\n"
        "seen = []\n"
        "def ok(cfg, world):\n"
        "    seen.append(dist.is_initialized())\n"
        "    return 3\n"
        "def fail(cfg, world):\n"
        "    seen.append(dist.is_initialized())\n"
        "    held = dist.group.WORLD  # as a failed learner's frames hold its engine's groups\n"
        "    raise RuntimeError('boom')\n"
        "import sandpiper.trainer.engine as engine\n"
        "left, shutdown = [], engine.shutdown_distributed\n"
        "engine.shutdown_distributed = lambda **kw: left.append(shutdown(**kw))\n"
        "m._run = ok\n"
        "assert m.run_learner(cfg) == 3\n"
        "assert not dist.is_initialized(), 'left alive after a clean run'\n"
        "m._run = fail\n"
        "try:\n"
        "    m.run_learner(cfg)\n"
        "except RuntimeError:\n"
        "    pass\n"
        "assert not dist.is_initialized(), 'left alive after a failed run'\n"
        "assert seen == [True, True], seen\n"
        "assert left == [0, 0], f'gloo threads outlived the shutdown: {left}'\n"
    )
    _run_probe(probe)


def test_comm_threads_counts_threads_by_their_native_name() -> None:
    """``shutdown_distributed`` reports gloo / c10d-store threads by the name the OS knows
    them by (``/proc/self/task/*/comm``); a thread named like gloo's is counted."""
    probe = (
        "import ctypes, threading, time\n"
        "from sandpiper.trainer.engine import comm_threads\n"
        "before = comm_threads()\n"
        "named, done = threading.Event(), threading.Event()\n"
        "def body():\n"
        "    ctypes.CDLL(None).prctl(15, b'pt_gloo_runloop', 0, 0, 0)  # PR_SET_NAME\n"
        "    named.set(); done.wait()\n"
        "t = threading.Thread(target=body); t.start(); named.wait()\n"
        "assert comm_threads() == before + 1, (before, comm_threads())\n"
        "done.set(); t.join()\n"
        # join returns when the thread's Python work ends; its OS task leaves /proc a moment
        # later (seen under load: one more thread counted right after the join)
        "deadline = time.monotonic() + 10\n"
        "while comm_threads() != before and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "assert comm_threads() == before, (before, comm_threads())\n"
    )
    _run_probe(probe)


def test_a_destroyed_zero3_engine_is_freed_with_its_process_group(learner_tiny_model) -> None:
    """After ``destroy_engine`` nothing holds a ZeRO-3 engine (DeepSpeed's module-level
    stack and lru_cache did), and ``shutdown_distributed`` leaves no gloo thread: one left
    runs into the interpreter's teardown and can abort the exit (seen in CI)."""
    from tests.conftest import REPO

    probe = (
        "import gc, weakref, torch\n"
        "from sandpiper.trainer.checkpoint import load_model\n"
        "from sandpiper.trainer.engine import (build_engine, comm_threads, destroy_engine,\n"
        "    init_distributed, shutdown_distributed)\n"
        "world = init_distributed()\n"
        f"engine = build_engine(load_model({str(learner_tiny_model)!r}),\n"
        f"    ds_config_path={str(REPO / 'configs/deepspeed_zero3.json')!r}, world=world,\n"
        "    lr=1e-3, weight_decay=0.0, max_grad_norm=1.0)\n"
        "loss = engine(input_ids=torch.tensor([[5, 17, 33, 9]])).logits.float().mean()\n"
        "engine.backward(loss); engine.step()\n"
        "assert comm_threads() > 0, 'gloo threads are not named as expected'\n"
        "destroy_engine(engine)\n"
        "freed = weakref.ref(engine)\n"
        "del engine, loss\n"
        "left = shutdown_distributed()\n"
        "assert freed() is None, 'the engine is still referenced'\n"
        "assert left == 0 == comm_threads(), left\n"
    )
    _run_probe(probe)
