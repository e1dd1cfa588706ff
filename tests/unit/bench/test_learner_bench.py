"""bench/learner_bench.py: one real step of each side on the tiny model, and how the per-variant
runs become the recorded keys (``bf16_speedup_vs_trl``, ...)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[3]


def _load():
    path = REPO / "bench" / "learner_bench.py"
    spec = importlib.util.spec_from_file_location("learner_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_variant_is_recorded_under_its_own_keys(monkeypatch):
    bench = _load()
    runs = {
        "fp32": {"sandpiper_tokens_per_s": 100.0, "trl_tokens_per_s": 50.0, "speedup_vs_trl": 2.0},
        "bf16": {"sandpiper_tokens_per_s": 4.0, "trl_tokens_per_s": 5.0, "speedup_vs_trl": 0.8},
    }
    argvs = []

    def fake_run(argv, **_):
        argvs.append(argv)
        variant = argv[argv.index("--variants") + 1]
        row = {"variant": variant, "sandpiper_step_peak_bytes": 1, "trl_step_peak_bytes": 2,
               **runs[variant]}  # fmt: skip
        return SimpleNamespace(stdout="noise\n" + json.dumps(row) + "\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = SimpleNamespace(model="smollm2", groups=None, group_size=3, repeats=None)
    result = bench.run_variants(args, ["fp32", "bf16"])
    assert all("--no-memory" in a and a[a.index("--group-size") + 1] == "3" for a in argvs)
    assert result["speedup_vs_trl"] == 2.0  # fp32 keeps the plain keys
    assert result["bf16_speedup_vs_trl"] == 0.8
    assert result["trl_bf16_tokens_per_s"] == 5.0
    assert result["bf16_speedup_vs_trl_best"] == round(4.0 / 50.0, 3)  # against TRL's fp32
    assert "variant" not in result


@pytest.mark.slow
def test_one_real_step_a_side_on_the_tiny_model(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "learner_bench.py"), "--model", "tiny",
         "--variants", "fp32", "--groups", "1", "--group-size", "2", "--repeats", "1",
         "--no-memory", "--json"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["sequences"] == 2 and result["tokens"] > 0
    assert result["sandpiper_tokens_per_s"] > 0 and result["trl_tokens_per_s"] > 0
    assert result["speedup_vs_trl"] == pytest.approx(
        result["trl_step_s"] / result["sandpiper_step_s"], rel=0.01
    )
    assert result["sandpiper_step_peak_bytes"] > 0 and result["trl_step_peak_bytes"] > 0
