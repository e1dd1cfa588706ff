"""The learner writes the metric keys the analysis views read (they are two parts that meet
only in the store, so only a test can hold them together)."""

from __future__ import annotations

from sandpiper.analysis.views import IMPORTANCE_METRICS
from sandpiper.trainer.loss import LossStats


def test_importance_weight_view_reads_keys_the_learner_writes() -> None:
    written = set(LossStats(tokens=10.0).summary())
    assert set(IMPORTANCE_METRICS.values()) <= written, set(IMPORTANCE_METRICS.values()) - written
