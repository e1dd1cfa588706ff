"""`sandpiper config check` on every shipped config and compose.yaml: each vLLM launch line
goes through the installed vLLM's own argument parser and model-config validation (the CPU
build shares that code with the CUDA one), offline, from the shipped model config.json files.

Importing vLLM takes a minute or more here, so one process checks everything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
SHIPPED = sorted((REPO / "configs").glob("*.toml"))

pytestmark = [pytest.mark.slow, pytest.mark.long]


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "sandpiper.cli", "config", "check", *args],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600,
    )  # fmt: skip


def test_every_shipped_launch_line_passes_vllms_own_checks(tmp_path: Path) -> None:
    """Plus one that must fail: a context past the model's positions (Qwen3-4B: 40,960)."""
    (tmp_path / "model").symlink_to(REPO / "configs" / "models" / "qwen3-4b")
    too_long = tmp_path / "too-long.toml"
    text = (REPO / "configs" / "gpu-1xh200-qwen3-4b.toml").read_text()
    too_long.write_text(
        text.replace("max_model_len = 8192", "max_model_len = 65536")
        .replace("micro_batch_tokens = 8192", "micro_batch_tokens = 65536")
        .replace("max_episode_tokens = 8192", "max_episode_tokens = 65536")
    )
    args = [a for c in SHIPPED for a in ("-c", str(c))]
    out = _check(*args, "-c", str(too_long), "--compose", str(REPO / "compose.yaml"))
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    report = out.stdout
    for config in SHIPPED:
        if "server_urls" not in config.read_text():
            assert f"{config}: server" in report, report
    assert "compose.yaml: vllm: ok" in report, report
    bad = [line for line in report.splitlines() if not line.endswith(": ok")]
    assert len(bad) == 1 and str(too_long) in bad[0] and "max_model_len" in bad[0], report
