"""``sandpiper learn`` end to end on a DuckDB store: SFT warm start, then a GRPO step, with
MLflow tracking into a local SQLite store; the checkpoints load with transformers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sandpiper.config import to_toml
from tests.conftest import REPO
from tests.fixtures.learner import make_config, sample_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _learn(config, *extra: str) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "sandpiper.cli", "learn", "--config", str(config), *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.long
def test_sft_then_grpo_through_the_cli(tmp_path, learner_tiny_model) -> None:
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sandpiper.store import Store
    from sandpiper.trainer.checkpoint import load_model

    cfg = make_config(tmp_path, learner_tiny_model, groups_per_step=2, max_steps=2,
                      max_idle_s=2.0, sft_min_reward=0.5)  # fmt: skip
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(
        update={"enabled": True, "tracking_uri": uri, "experiment": "lt"})})  # fmt: skip
    config = tmp_path / "run.toml"
    config.write_text(to_toml(cfg))
    store = Store(cfg.store.url)
    store.init()
    model = load_model(learner_tiny_model)
    store.write_groups([sample_group(model, run_id="lt", task=i, seq=i, version=0)
                        for i in range(2)])  # fmt: skip

    _learn(config, "--algo", "sft")
    assert store.policy_versions.latest("lt").version == 1
    _learn(config)  # GRPO: version 2 from the two ready groups, then max_steps stops it
    latest = store.policy_versions.latest("lt")
    assert latest.version == 2 and latest.parent_version == 1

    AutoTokenizer.from_pretrained(latest.checkpoint_uri)
    loaded = AutoModelForCausalLM.from_pretrained(latest.checkpoint_uri)
    assert loaded.config.tie_word_embeddings is False
    assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("lt")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"lt-sft", "lt-grpo"}
    grpo = runs["lt-grpo"]
    assert grpo.data.params["learner.is_mode"] == "truncate"
    for key in (
        "is/w_mean",
        "is/ess",
        "loss/clipped_frac",
        "kl/sampler_vs_learner",
        "staleness/lag_1",
        "reward/mean",
        "perf/tokens_per_s",
        "perf/step_s",
    ):
        assert key in grpo.data.metrics, key
    assert "sft/nll" in runs["lt-sft"].data.metrics
