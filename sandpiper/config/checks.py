"""What a run config refuses, and how a refusal reads.

Bounds of single fields sit on the fields of :mod:`sandpiper.config.sections` (``Field(gt=…, ge=…,
le=…)``); the rules here are the ones that need several fields (GRPO's group size, the clip
range of each objective, token budgets that nest, ports that fit). Every refusal becomes one
line naming where the value came from (the config file or the ``--part.field`` override),
the field, the value and what is allowed::

    configs/run.toml: learner.lr = -1: must be > 0
    override --collector.group_size: collector.group_size = 1: GRPO compares the samples ...

This module imports only pydantic and the standard library (``sandpiper --help`` imports it),
and not the sections (:mod:`sandpiper.config.sections`, which call it): the rules take
the sections as ``Any``.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from annotated_types import Ge, Gt, Le, Lt
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

REFUSED = "sandpiper_config"
"""Pydantic error type of a cross-field refusal (its context names the field)."""

MAX_UID = 2**32 - 2
"""Largest usable uid: ``uid_t`` is 32 bits and ``2**32 - 1`` means "no uid" (``-1``)."""

UID_RANGE = 65_536
"""Uids each container's ``--uidmap`` range spans (see ``SandboxConfig.uid_slots``)."""

STORE_SCHEMES = ("duckdb:///", "postgresql://", "postgresql+psycopg://")
"""What ``store.url`` may start with (the store's two backends)."""

_PASSWORD = re.compile(r"(?<=://)([^/:@]*):[^/@]*@")


def redact(url: str) -> str:
    """``url`` with its password (``user:secret@``) shown as ``***``: errors are printed and
    logged, a database password must not be."""
    return _PASSWORD.sub(r"\1:***@", url)


def refuse(field: str, value: Any, allowed: str) -> PydanticCustomError:
    """The error a model validator raises: ``field`` (relative to the section that checks
    it, or dotted from the top for a run-level rule) holds ``value``; ``allowed`` says
    what would be accepted and why."""
    return PydanticCustomError(
        REFUSED,
        "{field} = {value}: {allowed}",
        {"field": field, "value": value, "allowed": allowed},
    )


# ---- rules of one section -------------------------------------------------------------


def check_sandbox(s: Any) -> None:
    last_uid = s.uid_base + s.uid_slots * UID_RANGE - 1
    if last_uid > MAX_UID:
        raise refuse(
            "uid_slots", s.uid_slots,
            f"uid_base + uid_slots * {UID_RANGE} - 1 = {last_uid} passes the largest uid "
            f"{MAX_UID}: lower uid_slots or uid_base",
        )  # fmt: skip
    if s.workspace_size_mb + s.tmp_size_mb >= s.memory_mb:
        raise refuse(
            "memory_mb", s.memory_mb,
            f"must exceed workspace_size_mb + tmp_size_mb = {s.workspace_size_mb + s.tmp_size_mb}"
            " (tmpfs pages count against the container's memory: a full /workspace would "
            "otherwise OOM-kill the sandbox)",
        )  # fmt: skip


def check_inference(s: Any) -> None:
    last = s.base_port + s.num_servers - 1
    if not s.server_urls and last > 65_535:
        raise refuse(
            "base_port", s.base_port,
            f"servers listen on base_port .. base_port + num_servers - 1 = {last}, past port "
            "65535: lower base_port or num_servers",
        )  # fmt: skip
    for url in s.server_urls:
        if not url.startswith(("http://", "https://")):
            raise refuse("server_urls", url, "each must be an http:// or https:// base URL")
    if len(set(s.gpus)) != len(s.gpus) or any(g < 0 for g in s.gpus):
        raise refuse("gpus", s.gpus, "physical GPU ids: distinct, >= 0")
    if s.gpus and not s.server_urls and len(s.gpus) != s.num_servers * s.tensor_parallel_size:
        raise refuse(
            "gpus", s.gpus,
            f"num_servers * tensor_parallel_size = {s.num_servers * s.tensor_parallel_size} "
            "GPUs are needed (each server gets tensor_parallel_size of them, in order)",
        )  # fmt: skip
    if s.device == "cpu" and s.gpus:
        raise refuse("gpus", s.gpus, 'device = "cpu" takes no GPUs: empty it or set "cuda"')


def check_placement(inf: Any, lrn: Any) -> None:
    """GPUs are not shared between vLLM and the learner, except one GPU both use (the
    one-GPU workstation), where vLLM must be told its share of the memory."""
    shared = sorted(set(inf.gpus) & set(lrn.gpus))
    if not shared:
        return
    if not (inf.gpus == lrn.gpus == shared and len(shared) == 1):
        raise refuse(
            "learner.gpus", lrn.gpus,
            f"overlaps inference.gpus = {inf.gpus} on {shared}: give each process its own "
            "GPUs (only one single GPU may be shared by both)",
        )  # fmt: skip
    if inf.gpu_memory_utilization is None or inf.gpu_memory_utilization > 0.8:
        raise refuse(
            "inference.gpu_memory_utilization", inf.gpu_memory_utilization,
            f"GPU {shared[0]} is shared with the learner: set a share <= 0.8 (0.3-0.6 leaves "
            "the learner its weights, optimiser state and activations)",
        )  # fmt: skip


def check_collector(c: Any) -> None:
    if c.max_tokens_per_turn > c.max_episode_tokens:
        raise refuse(
            "max_tokens_per_turn", c.max_tokens_per_turn,
            f"must be <= max_episode_tokens = {c.max_episode_tokens} (a turn samples within the "
            "episode's budget)",
        )  # fmt: skip
    if c.heartbeat_ttl_s <= c.heartbeat_s:
        raise refuse(
            "heartbeat_ttl_s", c.heartbeat_ttl_s,
            f"must be > heartbeat_s = {c.heartbeat_s} (else every collector is judged dead "
            "between two of its own heartbeats)",
        )  # fmt: skip


CLIP_RANGES = {
    "ppo": ("0 < eps_low <= 1 and eps_high > 0", True),
    "gspo": ("0 < eps_low <= 1 and eps_high > 0", True),
    "cispo": ("0 <= eps_low <= 1 and eps_high >= 0", False),
}
"""Per objective: the clip range it accepts, and whether that range must have width (PPO and
GSPO take ``min(r A, clip(r) A)``: with ``eps = 0`` the clipped branch is constant and a step
beyond the first moves nothing; CISPO's clip is a stop-gradient weight, ``eps_low = 1`` is
MiniMax-M1's "no lower bound" and 0 is plain REINFORCE with IS)."""


def check_learner(s: Any) -> None:
    allowed, needs_width = CLIP_RANGES[s.objective]
    if needs_width:
        for name in ("eps_low", "eps_high"):
            if getattr(s, name) <= 0:
                raise refuse(name, getattr(s, name), f"objective = {s.objective!r} needs {allowed}")
    if s.reject != "none" and s.reject_lo is None and s.reject_hi is None:
        raise refuse(
            "reject", s.reject,
            "rejection needs reject_lo or reject_hi (without a bound it rejects nothing)",
        )  # fmt: skip


# ---- rules across sections ------------------------------------------------------------


def check_run(r: Any) -> None:
    c, inf, lrn = r.collector, r.inference, r.learner
    if lrn.algo == "grpo" and c.group_size < 2:
        raise refuse(
            "collector.group_size", c.group_size,
            'learner.algo = "grpo" needs >= 2 (the advantage compares the samples of a group; '
            'one sample has nothing to compare with); use learner.algo = "sft" for one',
        )  # fmt: skip
    if c.max_episode_tokens > inf.max_model_len:
        raise refuse(
            "collector.max_episode_tokens", c.max_episode_tokens,
            f"must be <= inference.max_model_len = {inf.max_model_len} (sampled tokens sit in "
            "the server's context)",
        )  # fmt: skip
    if lrn.micro_batch_tokens < inf.max_model_len:
        raise refuse(
            "learner.micro_batch_tokens", lrn.micro_batch_tokens,
            f"must be >= inference.max_model_len = {inf.max_model_len} (a micro-batch holds "
            "at least one whole sequence; a longer one would be packed alone, past the bound)",
        )  # fmt: skip
    if lrn.algo == "grpo":
        check_scoring(c, inf)
    check_placement(inf, lrn)
    if len(set(lrn.gpus)) != len(lrn.gpus) or any(g < 0 for g in lrn.gpus):
        raise refuse("learner.gpus", lrn.gpus, "physical GPU ids: distinct, >= 0")
    ports = range(inf.base_port, inf.base_port + inf.num_servers)
    if not inf.server_urls and c.gateway_port in ports:
        raise refuse(
            "collector.gateway_port", c.gateway_port,
            f"is one of the inference servers' ports {ports.start}..{ports.stop - 1}: pick "
            "another, or 0 for any free port",
        )  # fmt: skip


def check_scoring(c: Any, inf: Any) -> None:
    """The learner's logprobs must be of the distribution the tokens were sampled from, as
    the stored sampling logprobs are: vLLM's raw logprobs are before temperature and top-p,
    so they describe it only at temperature 1 and top_p 1; processed ones are of ``logits /
    temperature``, which the learner reproduces (it does not reproduce top-p's nucleus)."""
    if c.top_p != 1.0:
        raise refuse(
            "collector.top_p", c.top_p,
            'with learner.algo = "grpo" must be 1: the learner does not score tokens under '
            "top-p's nucleus, so the importance weight would not describe the sampling "
            "distribution",
        )  # fmt: skip
    if inf.logprobs_mode == "raw_logprobs" and c.temperature != 1.0:
        raise refuse(
            "collector.temperature", c.temperature,
            'with inference.logprobs_mode = "raw_logprobs" must be 1 (raw logprobs are before '
            'temperature); use inference.logprobs_mode = "processed_logprobs", which the '
            "learner scores at each group's temperature",
        )  # fmt: skip
    if c.temperature == 0.0:
        raise refuse(
            "collector.temperature", c.temperature,
            'with learner.algo = "grpo" must be > 0 (greedy samples have no sampling '
            "distribution to correct for)",
        )  # fmt: skip


RULES = (
    'GRPO needs samples to compare: `learner.algo = "grpo"` needs `collector.group_size >= 2`.',
    "Each objective's clip range: `ppo` and `gspo` need `eps_low > 0` and `eps_high > 0` (a "
    "clip range of width 0 stops learning after the first step); `cispo` takes 0 (its clip is "
    "a stop-gradient weight; `eps_low = 1` means no lower bound).",
    "Token budgets nest: `collector.max_tokens_per_turn <= collector.max_episode_tokens <= "
    "inference.max_model_len`.",
    "A learner micro-batch holds a whole sequence: `learner.micro_batch_tokens >= "
    "inference.max_model_len`.",
    'GRPO scores tokens as they were sampled: `learner.algo = "grpo"` needs '
    "`collector.top_p = 1`, and `collector.temperature = 1` unless `inference.logprobs_mode = "
    '"processed_logprobs"` (then any temperature > 0: the learner divides its logits by the '
    "group's temperature).",
    "Placement: `inference.gpus` holds `num_servers * tensor_parallel_size` distinct GPU ids "
    '(none with `device = "cpu"`); `learner.gpus` and `inference.gpus` are disjoint, except '
    "one single GPU shared by both, which needs `inference.gpu_memory_utilization <= 0.8`.",
    "Ports fit: launched servers use `inference.base_port .. base_port + num_servers - 1 <= "
    "65535`, and `collector.gateway_port` is none of them.",
    "`collector.heartbeat_ttl_s > collector.heartbeat_s` (a collector is judged dead only after "
    "it missed a heartbeat).",
    "`learner.reject` other than `none` needs `reject_lo` or `reject_hi`; `reject_lo <= 0 <= "
    "reject_hi` (on-policy tokens, divergence 0, are kept).",
    "Sandbox: `workspace_size_mb + tmp_size_mb < memory_mb` (tmpfs pages count against the "
    "container's memory) and the uid ranges `uid_base + uid_slots * 65536 - 1` stay below "
    "`2**32 - 1`.",
    "`store.url` starts with `duckdb:///` or `postgresql://` / `postgresql+psycopg://`; each of "
    "`inference.server_urls` with `http://` or `https://`; `name` is one folder name.",
)
"""The rules of this module in words (docs/configuration.md lists them)."""


# ---- how a refusal reads -----------------------------------------------------------------


def bounds_text(info: FieldInfo) -> str:
    """``"> 0"``, ``">= 1, <= 65535"`` or ``""``: the bounds declared on a field."""
    parts = []
    for meta in info.metadata:
        for cls, op, attr in ((Gt, ">", "gt"), (Ge, ">=", "ge"), (Lt, "<", "lt"), (Le, "<=", "le")):
            if isinstance(meta, cls):
                parts.append(f"{op} {getattr(meta, attr)}")
    return ", ".join(parts)


_ALLOWED = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "finite_number": "must be a finite number",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string (in quotes)",
    "list_type": "must be a list",
    "literal_error": "must be one of {expected}",
    "string_pattern_mismatch": "must match {pattern}",
    "missing": "is required",
    "value_error": "{error}",
    "model_type": "must be a [section] (a table)",
    "model_attributes_type": "must be a [section] (a table)",
    "dict_type": "must be a [section] (a table)",
}


def _show(value: Any) -> str:
    try:
        text = redact(json.dumps(value))
    except (TypeError, ValueError):
        text = redact(repr(value))
    return text if len(text) <= 80 else text[:77] + "..."


def _known_fields(model: type, loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section that ``loc`` (a field path) sits in."""
    fields = getattr(model, "model_fields", {})
    for part in loc[:-1]:
        info = fields.get(part)
        fields = getattr(getattr(info, "annotation", None), "model_fields", {})
    return list(fields)


def _source(loc: tuple[Any, ...], overrides: Mapping[str, Any], path: str | None) -> str:
    node: Any = overrides
    for part in loc:
        if not isinstance(node, Mapping) or part not in node:
            return path or "the defaults"
        node = node[part]
    return "override --" + ".".join(map(str, loc))


def explain(
    error: ValidationError,
    *,
    model: type,
    overrides: Mapping[str, Any],
    path: str | None,
) -> list[str]:
    """One line per refusal of ``error``: where, which field, which value, what is allowed."""
    lines = []
    for err in error.errors(include_url=False):
        loc = tuple(err["loc"])
        ctx = err.get("ctx") or {}
        if err["type"] == REFUSED:
            field_loc = loc + tuple(str(ctx["field"]).split("."))
            name = ".".join(map(str, field_loc))
            line = f"{name} = {_show(ctx['value'])}: {ctx['allowed']}"
        elif err["type"] == "extra_forbidden":
            field_loc = loc
            name = ".".join(map(str, loc))
            close = difflib.get_close_matches(str(loc[-1]), _known_fields(model, loc), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            line = f"{name}: no such field{hint}"
        else:
            field_loc = loc
            name = ".".join(map(str, loc)) or "the config"
            allowed = _ALLOWED.get(err["type"], err["msg"]).format(**_plain(ctx))
            line = f"{name} = {_show(err.get('input'))}: {allowed}"
        lines.append(f"{_source(field_loc, overrides, path)}: {line}")
    return lines


def _plain(ctx: Mapping[str, Any]) -> dict[str, Any]:
    """Bounds as written (``0`` rather than ``0.0`` for a float field's ``gt=0``)."""
    out = {}
    for key, value in ctx.items():
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        out[key] = value
    return out


def walk_numeric(model: type, prefix: str = "") -> Iterable[tuple[str, FieldInfo, type]]:
    """``(dotted name, field info, number type)`` of every int/float field of ``model`` and
    its sections (bools excluded): what must carry bounds."""
    import typing

    for name, info in model.model_fields.items():  # type: ignore[attr-defined]
        ann = info.annotation
        if hasattr(ann, "model_fields"):
            yield from walk_numeric(ann, f"{prefix}{name}.")
            continue
        for t in typing.get_args(ann) or (ann,):
            if t in (int, float):
                yield f"{prefix}{name}", info, t
                break
