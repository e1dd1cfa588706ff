"""Learner-step metrics are declared once (``store.step_metrics.StepMetrics``): the learner
writes by it, the store keeps its JSON, the analysis views take their columns from it."""

from __future__ import annotations

import pytest

from sandpiper.analysis.views import IMPORTANCE_METRICS
from sandpiper.store.step_metrics import StepMetrics
from sandpiper.trainer.loss import LossStats


def test_the_view_reads_declared_keys_that_the_loss_writes() -> None:
    written = LossStats(tokens=10.0).summary()
    metrics = StepMetrics()
    metrics.update(written)  # every key the loss writes is declared (else KeyError)
    assert StepMetrics.view_columns() == IMPORTANCE_METRICS
    assert set(IMPORTANCE_METRICS.values()) <= set(written)
    assert set(IMPORTANCE_METRICS.values()) <= set(metrics.to_json())


def test_undeclared_keys_are_refused_and_json_round_trips() -> None:
    with pytest.raises(KeyError, match="undeclared learner metric 'is/new'"):
        StepMetrics().update({"is/new": 1.0})
    m = StepMetrics(reward_mean=0.5, groups=8, lag_counts={0: 6.0, 2: 2.0})
    m.update({"is/ess": 0.9, "staleness/lag_1": 1.0})
    stored = m.to_json()
    assert stored == {
        "batch/groups": 8.0, "reward/mean": 0.5, "staleness/lag_0": 6.0,
        "staleness/lag_1": 1.0, "staleness/lag_2": 2.0, "is/ess": 0.9,
    }  # fmt: skip
    assert "sft/nll" not in stored  # unset metrics are left out, not stored as 0
    assert StepMetrics.from_json({**stored, "future/key": 3.0}) == m
