"""The run config: the sections composed into :class:`RunConfig`, and each part's settings.

:class:`RunConfig` holds one section per part (:mod:`sandpiper.config.sections`) and checks
the rules across sections (:mod:`sandpiper.config.checks`); :meth:`RunConfig.for_collector`
and :meth:`RunConfig.for_learner` narrow it to what one process is given. Loading TOML files
and overrides is :mod:`sandpiper.config.loading`.

This module imports only pydantic and the standard library.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sandpiper.config import checks
from sandpiper.config.sampling import SamplingLimits
from sandpiper.config.sections import (
    MAX_SEED,
    RUN_NAME,
    CollectorConfig,
    InferenceConfig,
    LearnerConfig,
    SandboxConfig,
    StoreConfig,
    TrackingConfig,
    _Part,
)


class RunConfig(_Part):
    """Everything one run needs; each process reads only its own part(s)."""

    name: str = Field(default="local", pattern=f"^{RUN_NAME}$")
    """The run's id in the store and its folder under ``runs_dir`` (letters, digits, ``_``,
    ``.``, ``-``; at most 128)."""
    runs_dir: str = "runs"
    """Folder of the runs' folders (resolved configs, logs, policies)."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Seed of sampling, weight initialisation and data order."""
    store: StoreConfig = Field(default_factory=StoreConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    collector: CollectorConfig = Field(default_factory=CollectorConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        checks.check_run(self)
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name

    def for_collector(self) -> CollectorSettings:
        """The collector's part of this config (also what the gateway and evaluation take)."""
        return CollectorSettings(
            **self._run_fields(),
            sandbox=self.sandbox,
            inference=self.inference,
            collector=self.collector,
            model=self.learner.model,
            groups_per_step=self.learner.groups_per_step,
            max_lag=self.learner.max_lag,
        )

    def for_learner(self) -> LearnerSettings:
        """The learner's part of this config."""
        return LearnerSettings(
            **self._run_fields(),
            runs_dir=self.runs_dir,
            learner=self.learner,
            tracking=self.tracking,
            collector_heartbeat_ttl_s=self.collector.heartbeat_ttl_s,
            logprobs_mode=self.inference.logprobs_mode,
            max_model_len=self.inference.max_model_len,
        )

    def _run_fields(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "run_dir": self.run_dir,
            "seed": self.seed,
            "store": self.store,
            "resolved_json": json.dumps(self.model_dump(mode="json")),
        }


class _Settings(BaseModel):
    """What one part is given: the run's identity, the store, and its own sections.

    Built from a :class:`RunConfig` at the top (the CLI, the demo, tests) by
    :meth:`RunConfig.for_collector` / :meth:`RunConfig.for_learner`; a part never sees
    another part's section, only the few facts of it that it acts on, named here."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str
    run_dir: Path
    seed: int = Field(ge=0, le=MAX_SEED)
    store: StoreConfig
    resolved_json: str
    """The whole resolved config as JSON, recorded with the run (``runs.config_json``); a
    part stores it and never reads it back."""


class CollectorSettings(_Settings):
    """The collector's settings (the gateway and ``sandpiper eval`` take the same)."""

    sandbox: SandboxConfig
    inference: InferenceConfig
    collector: CollectorConfig
    model: str
    """The policy's initial weights and tokenizer (``learner.model``)."""
    groups_per_step: int = Field(ge=1)
    """``learner.groups_per_step``: with ``max_lag``, the backpressure window of
    ``groups_per_step × (max_lag + 1)`` unconsumed groups."""
    max_lag: int = Field(ge=0)
    """``learner.max_lag``, the one setting of both parts."""

    @property
    def sampling(self) -> SamplingLimits:
        """How this run's episodes are sampled and bounded. The collector, the gateway and
        evaluation each read it once where they start and hand that object down (computed
        from the sections, so it never disagrees with them)."""
        return SamplingLimits.from_config(self.collector, self.inference)


class LearnerSettings(_Settings):
    """The learner's settings."""

    runs_dir: str
    learner: LearnerConfig
    tracking: TrackingConfig
    collector_heartbeat_ttl_s: float = Field(gt=0)
    """``collector.heartbeat_ttl_s``: how long a silent collector still holds the checkpoints
    it may load (checkpoint retention)."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """``inference.logprobs_mode``: processed sampling logprobs are scored at each group's
    sampling temperature, raw ones at 1 (the config refuses raw ones at any other)."""
    max_model_len: int = Field(ge=16)
    """``inference.max_model_len``: the longest sequence, so the longest row unshared packing
    makes; rows of shared prefixes (``learner.share_prefix``) stay within it."""
