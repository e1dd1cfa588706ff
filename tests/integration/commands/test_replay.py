"""``sandpiper replay`` end to end: a real DuckDB store trained for two steps by the learner on
the tiny model (one on-policy step, one on groups a version stale), replayed through the CLI.

Cost: ~1-2 min on 2 cores (two in-process learner steps, one CLI process that replays two
steps x 8 variants, one report). The replay must reconstruct exactly what the learner did:
its "as-run" variant reproduces the learner's own importance-weight statistics and
pre-clipping gradient norm of each step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sandpiper.config import to_toml
from tests.conftest import REPO
from tests.fixtures.learner import make_config, sample_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VARIANTS = [
    "as-run:",
    "no-correction: is_mode='none'",
    "tis-token-2: is_cap=2.0",
    "icepop-token: is_mode='mask' is_lo=0.5 is_hi=2.0",
    "m2po-0.04: m2po_tau=0.04 is_mode='none'",
    "cispo: objective='cispo' eps_low=1.0 eps_high=4.0",
    "gspo: objective='gspo' eps_low=3e-4 eps_high=4e-4 loss_agg='sequence_mean'",
]
"""A subset of the built-in variants (each costs one backward pass per micro-batch)."""


def _train_two_steps(tmp_path, model_dir):
    import torch

    from sandpiper.store import Store
    from sandpiper.store.records import RunRecord
    from sandpiper.trainer.engine import init_distributed
    from sandpiper.trainer.learner import Learner

    cfg = make_config(tmp_path, model_dir, groups_per_step=2, micro_batch_tokens=48, lr=3e-3)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(
        update={"enabled": True, "tracking_uri": uri, "experiment": "replay"})})  # fmt: skip
    store = Store(cfg.store.url)
    store.init()
    store.ensure_run(RunRecord("lt", json.dumps(cfg.model_dump(mode="json")), "test"))
    learner = Learner(cfg.for_learner(), store, init_distributed())
    torch.manual_seed(0)
    store.write_groups([sample_group(learner.engine.module, run_id="lt", task=i, seq=i, version=0)
                        for i in range(4)])  # fmt: skip
    metrics = {}
    for step in (1, 2):  # step 2 trains from version 1 on groups sampled by version 0
        batch = store.claims.claim(run_id="lt", learner_id="t", n_groups=2, max_lag=10)
        metrics[step] = learner.train_step(batch)
    return cfg, store, metrics


def test_replay_reconstructs_the_steps_and_compares_variants(tmp_path, learner_tiny_model):
    cfg, store, trained = _train_two_steps(tmp_path, learner_tiny_model)
    config = tmp_path / "run.toml"
    config.write_text(to_toml(cfg))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "sandpiper.cli", "replay", "--config", str(config),
         "--steps", "1:2", "--format", "json", *(a for v in VARIANTS for a in ("-v", v))],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {(r["step"], r["variant"]): r for r in json.loads(proc.stdout)}
    assert {s for s, _ in rows} == {1, 2}

    for step in (1, 2):
        as_run, ref = rows[(step, "as-run")], rows[(step, "reference")]
        learned = trained[step]
        # Same groups, same starting checkpoint, same packing as the learner's step.
        assert as_run["ess_raw"] == pytest.approx(learned["is/ess"], rel=1e-5)
        assert as_run["truncated_frac"] == pytest.approx(learned["is/truncated_frac"], abs=1e-9)
        assert as_run["grad_norm"] == pytest.approx(learned["loss/grad_norm"], rel=1e-4)
        assert ref["cos_ref"] == pytest.approx(1.0) and ref["truncated_frac"] == 0.0
        assert as_run["micro_batches"] >= 2 and as_run["grad_var"] >= 0
        for r in (rows[(step, v)] for _, v in rows if _ == step):
            assert r["clipped_frac"] == 0.0  # the first pass of a step: every ratio is 1
            assert 0.0 <= r["masked_frac"] <= 1.0 and 0.0 <= r["ess"] <= 1.0 + 1e-6

    # Step 1 is on-policy (sampled and trained from version 0): corrections change nothing.
    for v in ("no-correction", "tis-token-2", "icepop-token", "m2po-0.04", "cispo"):
        assert rows[(1, v)]["cos_ref"] == pytest.approx(1.0, abs=1e-6), v
        assert rows[(1, v)]["masked_frac"] == 0.0, v
    # Step 2 is a version stale: the weights are no longer 1 and ignoring them biases.
    assert rows[(2, "reference")]["ess_raw"] < 1.0 - 1e-6
    assert rows[(2, "no-correction")]["cos_ref"] < 1.0 - 1e-9
    assert rows[(2, "no-correction")]["ess"] == pytest.approx(1.0)

    folder = tmp_path / "runs" / "lt" / "replay"
    saved = json.loads((folder / "replay.json").read_text())
    assert {s["variant"] for s in saved["summary"]} >= {"reference", "gspo", "cispo"}
    assert (folder / "replay.png").stat().st_size > 1000

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name("replay")
    runs = client.search_runs([exp.experiment_id], "tags.`sandpiper.kind` = 'replay'")
    assert len(runs) == 1 and "gspo/cos_ref" in runs[0].data.metrics

    from sandpiper.analysis.report import build_report

    report = build_report(store, tmp_path / "report", run_id="lt", replay=folder / "replay.json")
    assert "replay" in report.png_paths
    assert "Estimator replay" in report.html_path.read_text()
