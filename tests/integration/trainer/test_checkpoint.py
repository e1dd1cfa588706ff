"""Publishing at size, two ranks on CPU (gloo, DeepSpeed launcher):

- under ZeRO-3 the weights are gathered one submodule at a time onto rank 0 only, so rank 1's
  host memory does not grow by the model's size during a save (it did when every parameter
  was gathered at once, which the same run measures too);
- a two-rank learner whose collectives time out after one second still trains when its
  first batch comes ten seconds after it started waiting (ranks meet in the rendezvous store
  before a collective, ``trainer/ranks.py``).

Cost: one 2-process ZeRO-3 engine on a 75 MB model (~1 min) and one 2-process learner run
on the tiny model (~1-2 min).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sandpiper.config import to_toml
from tests.conftest import REPO, require
from tests.fixtures.learner import make_config, sample_group
from tests.fixtures.vllm import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.long]

VENV_BIN = Path(sys.executable).parent


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    return {**env, **extra}


def _launcher() -> str:
    exe = shutil.which("deepspeed", path=str(VENV_BIN))
    require("deepspeed launcher", exe is not None, "not installed in the venv")
    assert exe is not None
    return exe


def test_zero3_save_gathers_onto_rank0_only(tmp_path):
    cmd = [_launcher(), "--num_gpus", "2", "--no_local_rank", "--master_port", str(free_port()),
           "--module", "tests.fixtures.publish_memory", str(tmp_path)]  # fmt: skip
    # Large allocations straight from mmap and back at free: the resident set then shows
    # what is live, not what glibc's heap kept from an earlier free.
    env = _env(MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    model = r1["model_bytes"]
    assert r0["keys_match"] and r0["weights_equal"]
    assert r1["module"] < model / 4, (r1, "rank 1 held more than a submodule at a time")
    assert r1["whole"] > model, (r1, "the measurement must see a whole-model gather")
    assert r0["module"] > model * 0.9  # rank 0 does hold the copy it writes


@pytest.fixture(scope="module")
def groups(learner_tiny_model) -> bytes:
    from sandpiper.trainer.checkpoint import load_model

    torch.manual_seed(0)
    model = load_model(learner_tiny_model)
    return pickle.dumps([sample_group(model, run_id="lt", task=t, seq=t, version=0)
                         for t in range(2)])  # fmt: skip


def test_ranks_outwait_a_one_second_collective_timeout(tmp_path, learner_tiny_model, groups):
    from sandpiper.store import Store

    cfg = make_config(
        tmp_path, learner_tiny_model, groups_per_step=2, max_steps=1, collective_timeout_s=1.0,
        device="cpu",
    )  # fmt: skip
    config = tmp_path / "run.toml"
    config.write_text(to_toml(cfg))
    store = Store(cfg.store.url)
    store.init()
    log = tmp_path / "learner.log"
    cmd = [sys.executable, "-m", "sandpiper.cli", "learn", "-c", str(config), "--nproc", "2"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while store.policy_versions.latest("lt") is None:  # the learner is up and waits for a batch
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(10)  # ten timeouts' worth of waiting for the batch
        assert proc.poll() is None, log.read_text()[-3000:]
        store.write_groups(pickle.loads(groups))
        assert proc.wait(timeout=300) == 0, log.read_text()[-5000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)  # our own child's process group, by pid
            proc.wait(timeout=30)
    text = log.read_text()
    assert "learner trains on cpu" in text, text[-3000:]
    assert store.policy_versions.latest("lt").version == 1, text[-3000:]
    assert "written (float32 weights" in text, text[-3000:]
