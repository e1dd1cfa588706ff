"""Resume and takeover: ``sandpiper learn`` killed with SIGKILL and restarted, or killed while
a second ``sandpiper learn`` waits as a standby, ends with every group consumed by exactly
one registered step, contiguous versions with the right parents, and the SAME weights as an
uninterrupted learner on the same batches (optimiser and RNG state travel with each version).

Real DuckDB store; the learners run as subprocesses through the real CLI. Cost: about 8
learner process starts on the tiny model (a few minutes on 2 busy cores).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
import torch

from sandpiper.config import to_toml
from tests.conftest import REPO
from tests.fixtures.learner import make_config, sample_group

# The module fixtures (sampling, an uninterrupted reference run) count against the first test.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

N_GROUPS, PER_STEP = 12, 2
STEPS = N_GROUPS // PER_STEP
TRAINING = dict(groups_per_step=PER_STEP, max_steps=STEPS, lr=1e-3, minibatches=2)
"""The same training settings for every run, so that the weights must agree."""


def _start(config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "sandpiper.cli", "learn", "--config", str(config)]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def _latest(store) -> int:
    latest = store.policy_versions.latest("lt")
    return -1 if latest is None else latest.version


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # our own child's process group, by pid
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def groups_pkl(tmp_path_factory, learner_tiny_model) -> Path:
    from sandpiper.trainer.checkpoint import load_model

    torch.manual_seed(0)
    model = load_model(learner_tiny_model)
    groups = [sample_group(model, run_id="lt", task=i, seq=i, version=0) for i in range(N_GROUPS)]
    path = tmp_path_factory.mktemp("resume-groups") / "groups.pkl"
    path.write_bytes(pickle.dumps(groups))
    return path


def _setup(tmp: Path, model: Path, groups_pkl: Path, **extra):
    """A run config and a DuckDB store holding the pickled groups (one commit: same order)."""
    from sandpiper.store import Store

    cfg = make_config(tmp, model, max_idle_s=3.0, **TRAINING, **extra)
    config = tmp / "run.toml"
    config.write_text(to_toml(cfg))
    store = Store(cfg.store.url)
    store.init()
    store.write_groups(pickle.loads(groups_pkl.read_bytes()))
    return config, store


def _final_weights(store) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(
        str(Path(store.policy_versions.latest("lt").checkpoint_uri) / "model.safetensors")
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, learner_tiny_model, groups_pkl) -> dict[str, torch.Tensor]:
    """Weights of one uninterrupted learner over all the batches."""
    tmp = tmp_path_factory.mktemp("resume-ref")
    config, store = _setup(tmp, learner_tiny_model, groups_pkl)
    log = tmp / "learner.log"
    assert _start(config, log).wait(timeout=600) == 0, log.read_text()[-3000:]
    assert _latest(store) == STEPS
    return _final_weights(store)


def _assert_history(store, tmp: Path) -> None:
    """Versions 0..STEPS with the right parents, each group consumed once, no stray folder."""
    from sandpiper.store import schema as T

    with store.connect_readonly() as conn:
        policies = conn.execute(
            sa.select(T.policies.c.version, T.policies.c.parent_version)
            .where(T.policies.c.run_id == "lt")
            .order_by(T.policies.c.version)
        ).all()
        steps = conn.execute(
            sa.select(T.learner_steps.c.step, T.learner_steps.c.n_groups)
            .where(T.learner_steps.c.run_id == "lt")
            .order_by(T.learner_steps.c.step)
        ).all()
        groups = conn.execute(
            sa.select(T.group_states.c.status, T.group_states.c.consumed_by_step).where(
                T.group_states.c.run_id == "lt"
            )
        ).all()
    assert [v for v, _ in policies] == list(range(STEPS + 1))
    assert [p for _, p in policies] == [None, *range(STEPS)]
    assert [tuple(s) for s in steps] == [(i, PER_STEP) for i in range(1, STEPS + 1)]
    assert {s for s, _ in groups} == {"consumed"} and len(groups) == N_GROUPS
    assert sorted(c for _, c in groups) == sorted(list(range(1, STEPS + 1)) * PER_STEP)
    # Every folder left is a registered version (grace keeps them all in a short test);
    # a killed learner's unregistered or half-written folders were swept.
    registered = {Path(p.checkpoint_uri).name for p in store.policy_versions.all("lt")}
    assert {p.name for p in (tmp / "runs/lt/policies").iterdir()} == registered


def _assert_same_weights(store, reference) -> None:
    got = _final_weights(store)
    assert got.keys() == reference.keys()
    for name, want in reference.items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.long
def test_kill_9_at_several_points_resumes_exactly(tmp_path, learner_tiny_model, groups_pkl,
                                                  reference):  # fmt: skip
    # A short lease: each restarted learner waits for its killed predecessor's to lapse.
    config, store = _setup(tmp_path, learner_tiny_model, groups_pkl, leader_lease_s=3.0)
    log = tmp_path / "learner.log"
    # Kill points: during start-up (before version 0 exists), right after a version was
    # registered, and part-way into later steps.
    # (the last kill leaves at least two steps, so a fast machine cannot finish first)
    kill_plans = [("startup", 2.0), ("after", 1), ("after", 2), ("into", 0.3)]
    for kind, value in kill_plans:
        proc = _start(config, log)
        try:
            if kind == "startup":
                time.sleep(value)
            else:
                target = value if kind == "after" else _latest(store) + 1
                deadline = time.monotonic() + 240
                while _latest(store) < target and proc.poll() is None:
                    assert time.monotonic() < deadline, log.read_text()[-3000:]
                    time.sleep(0.05)
                if kind == "into":
                    time.sleep(value)
            assert proc.poll() is None, "learner finished before it could be killed"
        finally:
            if proc.poll() is None:
                _kill(proc)

    assert _latest(store) >= 3  # the killed learners did register progress
    proc = _start(config, log)  # a killed leader's lease lapses first: it waits, then leads
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    _assert_history(store, tmp_path)
    _assert_same_weights(store, reference)


def test_standby_takes_over_when_the_leader_is_killed(tmp_path, learner_tiny_model, groups_pkl,
                                                      reference):  # fmt: skip
    config, store = _setup(tmp_path, learner_tiny_model, groups_pkl, leader_lease_s=4.0)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [_start(config, logs[0]), _start(config, logs[1])]
    try:
        deadline = time.monotonic() + 300
        while _latest(store) < 2:
            assert time.monotonic() < deadline, logs[0].read_text()[-2000:]
            assert all(p.poll() is None for p in procs), [x.read_text()[-2000:] for x in logs]
            time.sleep(0.05)
        lease = store.leases.current("lt")
        leader_pid = int(lease.learner_id.split(":")[1])  # host:pid:start:random
        leader = next(i for i, p in enumerate(procs) if p.pid == leader_pid)
        standby = 1 - leader
        time.sleep(0.3)  # part-way into step 3
        _kill(procs[leader])
        killed_at = _latest(store)
        assert killed_at < STEPS
        assert procs[standby].wait(timeout=600) == 0, logs[standby].read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
    text = logs[standby].read_text()
    assert f"standby: run lt is led by learner {lease.learner_id} (term 1" in text
    assert store.leases.current("lt").term == 2
    # The standby registered every version after the kill, under its own term.
    names = [Path(p.checkpoint_uri).name for p in store.policy_versions.all("lt")]
    assert all(n.endswith("-t0002") for n in names[killed_at + 1 :]), names
    assert all(n.endswith("-t0001") for n in names[: killed_at + 1]), names
    _assert_history(store, tmp_path)
    _assert_same_weights(store, reference)
