"""``bench/collector_bench.py`` still runs against the real collector (a smoke test: it once
broke silently when the daemon started routing sandboxes through per-image pools)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(600)]


def test_collector_bench_runs_episodes_and_prints_its_figures(vllm_server, sandbox_image) -> None:
    cmd = [
        sys.executable, str(REPO / "bench" / "collector_bench.py"), "--json",
        "--url", vllm_server.url, "--model-dir", str(vllm_server.model_dir),
        "--episodes", "8", "--baseline-episodes", "2", "--in-flight", "4", "--group-size", "2",
        "--spare-sandboxes", "1", "--turns", "2", "--max-tokens", "16", "--tool-command", "true",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["episodes"] == 8 and result["valid_fraction"] == 1.0, result
    assert result["stop_reasons"] == {"submitted": 8}, result
    assert 0.0 < result["inference_busy_fraction"] <= 1.0
    assert result["speedup_vs_one_in_flight"] > 0
