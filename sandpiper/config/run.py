"""Run configuration: one pydantic model per part, composed into :class:`RunConfig`.

Configs are TOML files (``configs/*.toml``) with dotted command-line overrides::

    sandpiper learn --config configs/local.toml --learner.lr 1e-6 --collector.group_size=4

The sections (one per part) are in :mod:`sandpiper.config_parts` and importable from here.
Unknown fields are errors (``extra="forbid"``), so a typo never silently falls back to a
default. Every number has bounds on its field, and the rules that involve several fields are
in :mod:`sandpiper.config_checks`: a config that breaks one is refused with one line per
field, naming the file (or override), the field, the value and what is allowed.
docs/configuration.md lists every field with its bounds (``sandpiper config docs`` writes
it). The resolved config is written into the run directory (``config.resolved.toml``) so
that every run records exactly what it ran with.

This module imports only pydantic and the standard library: ``sandpiper --help`` and every
part may import it without paying for torch or vLLM.
"""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sandpiper import config_checks as checks
from sandpiper.config_parts import (
    MAX_SEED,
    RUN_NAME,
    CollectorConfig,
    InferenceConfig,
    LearnerConfig,
    SamplingLimits,
    SandboxConfig,
    StoreConfig,
    ToolFormat,
    ToolName,
    TrackingConfig,
    _Part,
)
from sandpiper.errors import ConfigError

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

log = logging.getLogger(__name__)


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


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``["--learner.lr", "1e-6", "--collector.group_size=4"]`` into a nested dict.

    Values are parsed as TOML literals (numbers, booleans, quoted strings, arrays); anything
    that is not a TOML literal is taken as a bare string (``--store.url duckdb:///x``).
    """
    nested: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"expected an override like --part.field VALUE, got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(
                    f"override --{key} has no value: write --part.field VALUE (`sandpiper config "
                    "show` lists the fields); the command's own options are in its --help"
                )
            value = args[i + 1]
            i += 1
        i += 1
        node = nested
        *parents, leaf = key.replace("-", "_").split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{key} conflicts with another override")
        node[leaf] = _parse_value(value)
    return nested


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a TOML config (or the defaults when ``path`` is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(
                f"config file not found: {path}; give the path of a run's TOML file (configs/ "
                "holds the shipped ones: local.toml, demo.toml, gpu-1xh200-qwen3-4b.toml, ...)"
            ) from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    given = parse_overrides(overrides or [])
    data = _merge(data, given)
    _upgrade_deprecated(data, where=str(path) if path else "the overrides")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        lines = checks.explain(
            e, model=RunConfig, overrides=given, path=str(path) if path else None
        )
        raise ConfigError("\n".join(lines)) from None


def _upgrade_deprecated(data: dict[str, Any], *, where: str) -> None:
    """Read settings of earlier releases that moved: ``collector.max_lag`` is now
    ``learner.max_lag`` (one setting for both parts; every shipped config set both). Equal
    or alone, it is taken with a warning; two different values are an error."""
    collector, learner = data.get("collector"), data.get("learner")
    if not isinstance(collector, dict) or "max_lag" not in collector:
        return
    old = collector.pop("max_lag")
    if not isinstance(learner, dict):
        learner = data["learner"] = {}
    if "max_lag" in learner and learner["max_lag"] != old:
        raise ConfigError(
            f"{where}: collector.max_lag = {old!r} and learner.max_lag = {learner['max_lag']!r}"
            " differ; max_lag is one setting now: keep learner.max_lag only"
        )
    learner.setdefault("max_lag", old)
    log.warning("%s: collector.max_lag is deprecated; set learner.max_lag (the one setting "
                "of both parts) and remove collector.max_lag", where)  # fmt: skip


def to_toml(config: RunConfig) -> str:
    """Render a config as TOML (None values are omitted, which TOML cannot express)."""
    lines: list[str] = []
    top = config.model_dump(mode="json", exclude_none=True)
    for key, value in top.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {json.dumps(value)}")
    for key, value in top.items():
        if isinstance(value, dict):
            lines.append(f"\n[{key}]")
            lines.extend(f"{k} = {json.dumps(v)}" for k, v in value.items())
    return "\n".join(lines) + "\n"


def write_resolved(config: RunConfig | _Settings, run_dir: str | Path | None = None) -> Path:
    """Write the resolved config into the run directory and return its path (a part's
    settings write the whole run's config they were built from)."""
    target = Path(run_dir) if run_dir is not None else config.run_dir
    target.mkdir(parents=True, exist_ok=True)
    out = target / "config.resolved.toml"
    tmp = out.with_suffix(".tmp")
    if isinstance(config, _Settings):
        config = RunConfig.model_validate_json(config.resolved_json)
    tmp.write_text(to_toml(config))
    tmp.replace(out)
    return out
