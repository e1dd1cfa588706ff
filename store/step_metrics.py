"""One learner step's metrics, declared once: :class:`StepMetrics`.

The learner fills one per step and registers it with the new policy version; the store keeps
it as JSON in ``learner_steps.metrics``, keyed by the names MLflow shows (``reward/mean``,
``is/ess``, ...); the analysis views take their columns from it
(:meth:`StepMetrics.view_columns`), so the learner and the analysis — two parts that meet only
in the store — cannot drift apart on a key: a field the view reads is a field the learner
writes, and the learner cannot write a key that is not declared here.

A field is None when that step did not produce it (GRPO steps have no ``sft/*`` values, SFT
steps no importance weights); None fields are left out of the JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["StepMetrics"]

_LAG_PREFIX = "staleness/lag_"


def _metric(key: str, column: str | None = None) -> Any:
    """A metric stored under ``key``; ``column``: its name in the ``importance_weights`` view."""
    return field(default=None, metadata={"key": key, "column": column})


@dataclass(slots=True)
class StepMetrics:
    """See the module docstring. Fields in the order the learner produces them."""

    # the batch (trainer.learner.Learner.sequences)
    groups: float | None = _metric("batch/groups")
    groups_zero_variance: float | None = _metric("batch/groups_zero_variance")
    groups_too_few_valid: float | None = _metric("batch/groups_too_few_valid")
    groups_dropped_stale: float | None = _metric("batch/groups_dropped_stale")
    episodes_invalid: float | None = _metric("batch/episodes_invalid")
    sequences: float | None = _metric("batch/sequences")
    reward_mean: float | None = _metric("reward/mean")
    reward_std: float | None = _metric("reward/std")
    reward_min: float | None = _metric("reward/min")
    reward_max: float | None = _metric("reward/max")
    advantage_mean: float | None = _metric("advantage/mean")
    advantage_std: float | None = _metric("advantage/std")
    advantage_abs_max: float | None = _metric("advantage/abs_max")
    staleness_mean: float | None = _metric("staleness/mean")
    lag_counts: dict[int, float] = field(default_factory=dict)
    """Groups per staleness ``k`` (versions behind), stored as ``staleness/lag_<k>``."""
    # the loss (trainer.loss.LossStats.summary): importance weights before truncation
    is_w_mean: float | None = _metric("is/w_mean", "is_weight_mean")
    is_w_min: float | None = _metric("is/w_min", "is_weight_min")
    is_w_max: float | None = _metric("is/w_max", "is_weight_max")
    is_ess: float | None = _metric("is/ess", "ess")
    clipped_frac: float | None = _metric("loss/clipped_frac", "clipped_frac")
    is_masked_frac: float | None = _metric("is/masked_frac", "masked_frac")
    kl_sampler_vs_learner: float | None = _metric("kl/sampler_vs_learner", "kl_sampler_learner")
    kl_ref: float | None = _metric("kl/ref")
    is_ess_applied: float | None = _metric("is/ess_applied")
    is_rejected_frac: float | None = _metric("is/rejected_frac")
    is_m2po_masked_frac: float | None = _metric("is/m2po_masked_frac")
    is_dropped_frac: float | None = _metric("is/dropped_frac")
    is_truncated_frac: float | None = _metric("is/truncated_frac")
    # the optimiser step
    grad_norm: float | None = _metric("loss/grad_norm")
    optimizer_steps: float | None = _metric("optimizer_steps")
    tokens: float | None = _metric("batch/tokens")
    loss_tokens: float | None = _metric("batch/loss_tokens")
    # SFT steps (trainer.sft)
    sft_episodes: float | None = _metric("sft/episodes")
    sft_nll: float | None = _metric("sft/nll")
    sft_loss_tokens: float | None = _metric("sft/loss_tokens")
    sft_reward_threshold: float | None = _metric("sft/reward_threshold")
    sft_mean_len: float | None = _metric("sft/mean_len")
    # timing (trainer.learner.Learner._commit)
    train_s: float | None = _metric("perf/train_s")
    step_s: float | None = _metric("perf/step_s")
    tokens_per_s: float | None = _metric("perf/tokens_per_s")
    torch_threads: float | None = _metric("perf/torch_threads")
    """Torch threads the step ran with (``learner.torch_threads = "auto"`` only)."""
    # the version's folder as written (trainer.learner.Learner._commit)
    checkpoint_bytes: float | None = _metric("checkpoint/bytes")
    """Every file of the version's folder: the weights, plus the training state when due."""
    train_state_bytes: float | None = _metric("checkpoint/train_state_bytes")
    """Its ``train_state/`` (None: published without one, ``learner.train_state_every``)."""

    @staticmethod
    def view_columns() -> dict[str, str]:
        """Column of the ``importance_weights`` view -> stored key, in field order."""
        return {
            f.metadata["column"]: f.metadata["key"]
            for f in fields(StepMetrics)
            if f.metadata.get("column")
        }

    def update(self, values: Mapping[str, float]) -> None:
        """Set metrics by their stored keys (``LossStats.summary()``); an undeclared key is
        an error (declare it above: the store and the views take it from here)."""
        for key, value in values.items():
            if key.startswith(_LAG_PREFIX):
                self.lag_counts[int(key.removeprefix(_LAG_PREFIX))] = float(value)
            elif key in _KEYS:
                setattr(self, _KEYS[key], float(value))
            else:
                raise KeyError(f"undeclared learner metric {key!r} (see store.step_metrics)")

    def to_json(self) -> dict[str, float]:
        """The ``learner_steps.metrics`` JSON (and MLflow's metrics): set metrics only."""
        out: dict[str, float] = {}
        for f in fields(self):
            if f.name == "lag_counts":
                out.update(
                    {f"{_LAG_PREFIX}{k}": float(n) for k, n in sorted(self.lag_counts.items())}
                )
            elif (value := getattr(self, f.name)) is not None:
                out[f.metadata["key"]] = float(value)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepMetrics:
        """Read stored metrics back; keys this release does not declare are ignored (a newer
        learner's, or a hand-written row's)."""
        metrics = cls()
        metrics.update({k: v for k, v in data.items() if k in _KEYS or k.startswith(_LAG_PREFIX)})
        return metrics


_KEYS = {f.metadata["key"]: f.name for f in fields(StepMetrics) if "key" in f.metadata}
