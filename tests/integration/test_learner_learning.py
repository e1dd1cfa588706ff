"""(d) Learning: on the bandit task, the tiny model's reward rises over a few dozen steps.

Real DuckDB store and the real learner (DeepSpeed ZeRO-0, one process); sampling is done
with transformers from the learner's own weights, tagged with the policy version.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.fixtures.learner import make_config, sample_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_reward_rises_on_bandit(tmp_path, learner_tiny_model) -> None:
    """On the real store only: the same 30 steps on ``MemoryStore`` were a second copy of
    this run that checked nothing more (the learner's loop on ``MemoryStore`` is covered by
    tests/unit/test_trainer_learner.py; docs/testing.md lists the merges)."""
    from sandpiper.store import Store
    from sandpiper.trainer.engine import init_distributed
    from sandpiper.trainer.learner import Learner

    cfg = make_config(tmp_path, learner_tiny_model, lr=3e-3, groups_per_step=4, max_lag=1)
    store = Store(cfg.store.url)
    store.init()
    learner = Learner(cfg.for_learner(), store, init_distributed())
    assert learner.version == 0 and store.latest_policy("lt").version == 0
    rewards, seq = [], 0
    for step in range(30):
        groups = []
        for task in range(4):
            groups.append(
                sample_group(learner.engine.module, run_id="lt", task=task, seq=seq,
                             version=learner.version)
            )  # fmt: skip
            seq += 1
        store.write_groups(groups)
        batch = store.claim_batch(run_id="lt", learner_id="t", n_groups=4, max_lag=1)
        assert batch is not None and batch.dropped_stale == 0
        metrics = learner.train_step(batch)
        rewards.append(metrics["reward/mean"])
        assert metrics["is/w_mean"] == pytest.approx(1.0, abs=1e-3)  # sampled on-policy
        assert learner.version == step + 1
    assert store.latest_policy("lt").version == 30
    early, late = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert late > early + 0.15, rewards
