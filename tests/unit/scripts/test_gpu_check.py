"""scripts/gpu_check.sh's code path, run here on CPU with the tiny model (--dry-run)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.long
def test_dry_run_prints_one_json_line_that_passes() -> None:
    if not (REPO / "runs" / "tiny-model" / "config.json").is_file():
        pytest.skip("runs/tiny-model is built by scripts/setup.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"],
        capture_output=True, text=True, timeout=480, cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    # DeepSpeed writes its accelerator warning to stdout; the check's own output is one line
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(lines) == 1, (done.stdout[-2000:], done.stderr[-2000:])
    result = json.loads(lines[0])
    assert result["ok"], result
    assert abs(result["step"]["rel_error"]) <= 0.25
    assert result["checkpointing_equality"]["equal"]


def test_a_missing_piece_is_a_json_error(tmp_path: Path) -> None:
    env = {**os.environ}
    done = subprocess.run(
        [str(REPO / ".venv" / "bin" / "python"), str(REPO / "scripts" / "gpu_check.py"),
         "--model", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env,
    )  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" in result  # no CUDA here, or no config.json in tmp_path
