"""Resume: ``sandpiper learn`` is killed with SIGKILL at several points and restarted; the
run ends with every group consumed by exactly one registered step and contiguous versions.

Real DuckDB store; the learner runs as a subprocess through the real CLI.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from sandpiper.config import to_toml
from tests.conftest import REPO
from tests.fixtures.learner import make_config, sample_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_GROUPS, PER_STEP = 12, 2
STEPS = N_GROUPS // PER_STEP


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
    latest = store.latest_policy("lt")
    return -1 if latest is None else latest.version


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # our own child's process group, by pid
    proc.wait(timeout=30)


def test_kill_9_at_several_points_loses_and_repeats_nothing(tmp_path, learner_tiny_model):
    from store import Store
    from store import schema as T
    from trainer.checkpoint import load_model

    cfg = make_config(
        tmp_path, learner_tiny_model, groups_per_step=PER_STEP, max_steps=STEPS,
        max_idle_s=3.0, lr=1e-3,
    )  # fmt: skip
    config = tmp_path / "run.toml"
    config.write_text(to_toml(cfg))
    store = Store(cfg.store.url)
    store.init()
    model = load_model(learner_tiny_model)
    store.write_groups(
        [sample_group(model, run_id="lt", task=i, seq=i, version=0) for i in range(N_GROUPS)]
    )
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
    proc = _start(config, log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]

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
    per_step = sorted(c for _, c in groups)
    assert per_step == sorted(list(range(1, STEPS + 1)) * PER_STEP)
    leftovers = [p.name for p in (tmp_path / "runs/lt/policies").iterdir()]
    assert sorted(leftovers) == [f"v{v:06d}" for v in range(STEPS + 1)]
