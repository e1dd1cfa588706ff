"""bench/race_bench.py end to end, very short: both sides launched for real (``sandpiper
collect`` + ``sandpiper learn`` with vLLM; TRL's GRPOTrainer on podman sandboxes), the one
eval harness (vLLM + ``sandpiper collect --eval``) and the figures written.

Half a minute per side on an untrained tiny model: the point is the plumbing (both sides run
and stop at the budget, the start checkpoint is evaluated with real episodes, the JSON and
the PNG are written, both configs printed side by side), not who wins."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require
from tests.fixtures.vllm import tiny_model_copy

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.long]

REPO = Path(__file__).resolve().parents[3]


def test_a_short_race_writes_both_curves(tmp_path: Path) -> None:
    require("podman", shutil.which("podman") is not None)
    require("vLLM", importlib.util.find_spec("vllm") is not None, "install the `cpu` extra")
    require("TRL", importlib.util.find_spec("trl") is not None, "install the `dev` extra")
    model = tiny_model_copy(tmp_path / "tiny")
    runs = tmp_path / "runs"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "race_bench.py"), "--minutes", "0.5",
         "--eval-marks", "1", "--seeds", "1", "--train-tasks", "8", "--heldout-tasks", "2",
         "--runs-dir", str(runs), "--start", str(model), "--json"],
        capture_output=True, text=True, timeout=1800, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "samples per step" in done.stdout and "DIFFERS" not in done.stdout
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"trl_samples_per_hour", "sandpiper_samples_per_hour"} <= set(summary)
    result = json.loads((runs / "tiny-sum" / "race.json").read_text())
    for side in ("trl", "sandpiper"):
        (points,) = result["curves"][side].values()  # one seed
        assert [p["t_s"] for p in points] == [0.0, 30.0]
        assert points[0]["n_valid"] == 4  # 2 held-out tasks x 2 samples, real episodes
        assert points[0]["n"] == 4 and {"lo", "hi", "interval"} <= set(points[0])
        assert [p["t_s"] for p in result["mean_curves"][side]] == [0.0, 30.0]
    assert (runs / "tiny-sum" / "race.png").stat().st_size > 0
