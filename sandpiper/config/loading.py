"""Loading a run config: TOML files, dotted command-line overrides, the resolved config.

Configs are TOML files (``configs/*.toml``) with dotted command-line overrides::

    sandpiper learn --config configs/local.toml --learner.lr 1e-6 --collector.group_size=4

A config that breaks a bound or a rule (:mod:`sandpiper.config.checks`) is refused with one
line per field, naming the file (or override), the field, the value and what is allowed. The
resolved config is written into the run directory (``config.resolved.toml``) so that every
run records exactly what it ran with.

This module imports only pydantic and the standard library.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sandpiper.config import checks
from sandpiper.config.run import RunConfig, _Settings
from sandpiper.errors import ConfigError

log = logging.getLogger(__name__)


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
    # Each writer its own temporary name: a collector and learners starting together write
    # the same file, and a shared temporary name lets one's rename take the other's away.
    tmp = out.with_name(f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    if isinstance(config, _Settings):
        config = RunConfig.model_validate_json(config.resolved_json)
    try:
        tmp.write_text(to_toml(config))
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
