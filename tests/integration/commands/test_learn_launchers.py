"""The README's multi-process launch lines, as written, with 2 processes on this machine (gloo,
CPU): ``deepspeed --module sandpiper.cli learn ...`` (the launcher appends ``--local_rank``)
and ``torchrun -m sandpiper.cli learn ...``. Both must train the same batches into the same
weights, each rank reporting its steps.

Both launches run with the same ``OMP_NUM_THREADS`` (1 per rank). Left unset, ``torchrun``
sets it to 1 for each of its processes while ``deepspeed``'s launcher leaves it, so its ranks
run torch's default (one thread per core): the CPU matmuls then sum their partial products
in another order, and after two Adam steps 2-6 of 49,152 elements of a weight differed by up
to 1.03e-5 (measured on the 2-core CI machine, past the former rtol 1e-5; a tolerance fitted
to that would hold on one machine only). With the thread count fixed, nothing else differs
between the two runs: the same program, the same groups in the same order, and a gloo
all-reduce over two ranks, whose one addition gives the same bits in either order. So the
weights must be bit-identical, and the test compares them exactly: any difference is a real
divergence between the launchers, not rounding, on any machine.

Cost: two 2-process learner runs of 2 steps on the tiny model (about 1-2 minutes).
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sandpiper.config import to_toml
from tests.conftest import REPO, require
from tests.fixtures.learner import make_config, sample_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VENV_BIN = Path(sys.executable).parent


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def groups(learner_tiny_model):
    from sandpiper.trainer.checkpoint import load_model

    torch.manual_seed(0)
    model = load_model(learner_tiny_model)
    return pickle.dumps([sample_group(model, run_id="lt", task=t, seq=t, version=0)
                         for t in range(4)])  # fmt: skip


def _launch(tmp: Path, model: Path, groups: bytes, launcher: str) -> dict:
    from safetensors.torch import load_file

    from sandpiper.store import Store

    exe = shutil.which(launcher, path=str(VENV_BIN))
    require(f"{launcher} launcher", exe is not None, "not installed in the venv")
    tmp.mkdir()
    cfg = make_config(tmp, model, groups_per_step=2, max_steps=2, max_idle_s=5.0, lr=1e-3)
    config = tmp / "run.toml"
    config.write_text(to_toml(cfg))
    store = Store(cfg.store.url)
    store.init()
    store.write_groups(pickle.loads(groups))
    if launcher == "deepspeed":  # README: deepspeed --module sandpiper.cli learn -c run.toml
        cmd = [exe, "--num_gpus", "2", "--master_port", _port(), "--module"]
    else:  # README: torchrun --nproc_per_node N -m sandpiper.cli learn -c run.toml
        cmd = [exe, "--nproc_per_node", "2", "--master_port", _port(), "-m"]
    cmd += ["sandpiper.cli", "learn", "-c", str(config)]
    # the same thread setting under both launchers (see the module docstring)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["TMPDIR"] = str(tmp)  # torchrun leaves a torchelastic_* folder in it, never removed
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "No such option" not in out
    assert out.count("learner finished after 2 step(s) in this process") == 2, out[-3000:]
    # every rank freed its gloo groups before exiting (trainer.engine.shutdown_distributed)
    assert "outlive the process group" not in out, out[-3000:]
    latest = store.policy_versions.latest("lt")
    assert latest.version == 2 and store.claims.group_counts("lt")["consumed"] == 4
    return load_file(str(Path(latest.checkpoint_uri) / "model.safetensors"))


@pytest.mark.long
def test_deepspeed_and_torchrun_launch_lines_work(tmp_path, learner_tiny_model, groups):
    ds = _launch(tmp_path / "ds", learner_tiny_model, groups, "deepspeed")
    tr = _launch(tmp_path / "tr", learner_tiny_model, groups, "torchrun")
    assert ds.keys() == tr.keys()
    for name, want in ds.items():
        # exact: same threads, same data order, an order-free 2-rank sum (module docstring)
        torch.testing.assert_close(tr[name], want, rtol=0, atol=0, msg=name)
