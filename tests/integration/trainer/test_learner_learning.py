"""(d) Learning: on the bandit task, the tiny model's reward rises over a few dozen steps.

Real DuckDB store and the real learner (DeepSpeed ZeRO-0, one process); sampling is done
with transformers from the learner's own weights, tagged with the policy version. The run is
30 learner steps of 4 groups of 8, whatever the machine's speed; whether the reward rose is
a one-sided test at 1 % of the last five steps' episodes against the first five's
(``tests/fixtures/_learning.py``); the same run with a learning rate of 0 must not pass it.
"""

from __future__ import annotations

import pytest

from tests.fixtures._learning import reward_rise
from tests.fixtures.learner import make_config, sample_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize(
    "lr", [3e-3, pytest.param(0.0, marks=pytest.mark.long)], ids=["learns", "control-lr-0"]
)
def test_reward_rises_on_bandit(tmp_path, learner_tiny_model, lr: float) -> None:
    """On the real store only: the same 30 steps on ``MemoryStore`` were a second copy of
    this run that checked nothing more (the learner's loop on ``MemoryStore`` is covered by
    tests/unit/trainer/test_learner.py; docs/testing.md lists the merges)."""
    from sandpiper.store import Store
    from sandpiper.trainer.engine import init_distributed
    from sandpiper.trainer.learner import Learner

    cfg = make_config(tmp_path, learner_tiny_model, lr=lr, groups_per_step=4, max_lag=1)
    store = Store(cfg.store.url)
    store.init()
    learner = Learner(cfg.for_learner(), store, init_distributed())
    assert learner.version == 0 and store.policy_versions.latest("lt").version == 0
    steps: list[list[tuple[float, str]]] = []  # per step: (reward, group id) per episode
    seq = 0
    for step in range(30):
        groups = []
        for task in range(4):
            groups.append(
                sample_group(learner.engine.module, run_id="lt", task=task, seq=seq,
                             version=learner.version)
            )  # fmt: skip
            seq += 1
        store.write_groups(groups)
        batch = store.claims.claim(run_id="lt", learner_id="t", n_groups=4, max_lag=1)
        assert batch is not None and batch.dropped_stale == 0
        metrics = learner.train_step(batch)
        steps.append([(e.reward, g.group_id) for g in groups for e in g.episodes])
        assert metrics["is/w_mean"] == pytest.approx(1.0, abs=1e-3)  # sampled on-policy
        assert learner.version == step + 1
    assert store.policy_versions.latest("lt").version == 30
    early = [e for step in steps[:5] for e in step]
    late = [e for step in steps[-5:] for e in step]
    rise = reward_rise(
        [r for r, _ in early], [g for _, g in early], [r for r, _ in late], [g for _, g in late]
    )
    print(rise)
    # with a learning rate of 0 the test that a learning run must pass fails (1 - alpha)
    assert rise.rose == (lr > 0), rise
