"""Run configuration: one pydantic model per part, composed into :class:`RunConfig`.

Configs are TOML files (``configs/*.toml``) with dotted command-line overrides::

    sandpiper learn --config configs/local.toml --learner.lr 1e-6 --collector.group_size=4

Everything a caller needs is importable from here (``from sandpiper.config import
RunConfig``); the modules of this package, bottom up:

- :mod:`~sandpiper.config.checks`: the rules across fields, and how a refusal reads;
- :mod:`~sandpiper.config.sections`: the sections, one per part, with bounds on every number;
- :mod:`~sandpiper.config.sampling`: :class:`SamplingLimits`, the sampling limits every part
  shares;
- :mod:`~sandpiper.config.run`: :class:`RunConfig` and each part's settings;
- :mod:`~sandpiper.config.loading`: TOML files, overrides, the resolved config.

Unknown fields are errors (``extra="forbid"``), so a typo never silently falls back to a
default. Every number has bounds on its field, and a config that breaks a rule across fields
is refused with one line per field, naming the file (or override), the field, the value and
what is allowed. docs/configuration.md lists every field with its bounds (``sandpiper config
docs`` writes it). The resolved config is written into the run directory
(``config.resolved.toml``) so that every run records exactly what it ran with.

This package imports only pydantic and the standard library: ``sandpiper --help`` and every
part may import it without paying for torch or vLLM.
"""

from __future__ import annotations

from sandpiper.config.loading import load_config, parse_overrides, to_toml, write_resolved
from sandpiper.config.run import CollectorSettings, LearnerSettings, RunConfig
from sandpiper.config.sampling import SamplingLimits
from sandpiper.config.sections import (
    CollectorConfig,
    InferenceConfig,
    LearnerConfig,
    SandboxConfig,
    StoreConfig,
    ToolFormat,
    ToolName,
    TrackingConfig,
)

__all__ = [
    "CollectorConfig",
    "CollectorSettings",
    "InferenceConfig",
    "LearnerConfig",
    "LearnerSettings",
    "RunConfig",
    "SamplingLimits",
    "SandboxConfig",
    "StoreConfig",
    "ToolFormat",
    "ToolName",
    "TrackingConfig",
    "load_config",
    "parse_overrides",
    "to_toml",
    "write_resolved",
]
