"""MLflow tracking for the learner: params once per run, metrics every step.

The default tracking store is a local SQLite file (``<runs_dir>/mlflow.db``), which needs no
server. ``TrackingConfig.tracking_uri`` points elsewhere (``http://mlflow:5000``). A
restarted learner continues the same MLflow run (found by its ``sandpiper.run`` tag), so one
experiment run has one metric history across crashes. Only rank 0 tracks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sandpiper.config import TrackingConfig

RUN_TAG = "sandpiper.run"


def default_uri(runs_dir: str | Path) -> str:
    path = Path(runs_dir).resolve() / "mlflow.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"learner": {"lr": 1e-5}}`` -> ``{"learner.lr": "1e-05"}`` (MLflow params are flat)."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:6000]
    return flat


class Tracker:
    """Logs to MLflow, or does nothing when disabled (or on ranks other than 0)."""

    def __init__(
        self,
        cfg: TrackingConfig,
        *,
        runs_dir: str | Path,
        run_name: str,
        params: Mapping[str, Any],
        active: bool = True,
    ) -> None:
        self.client: Any = None
        self.run_id: str | None = None
        if not (cfg.enabled and active):
            return
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=cfg.tracking_uri or default_uri(runs_dir))
        experiment = self.client.get_experiment_by_name(cfg.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(cfg.experiment)
        )
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_name}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            return
        run = self.client.create_run(experiment_id, run_name=run_name, tags={RUN_TAG: run_name})
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):  # MLflow caps params per batch at 100
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        items = [Metric(k, float(v), now_ms, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def close(self, status: str = "FINISHED") -> None:
        if self.client is not None:
            self.client.set_terminated(self.run_id, status=status)
            self.client = None
