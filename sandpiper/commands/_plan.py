"""The memory plan of a run config, per GPU: ``sandpiper plan`` and the start-up refusal.

Reads the run's settings (placement, precision, ZeRO config, micro-batch, vLLM share) and
hands them to :mod:`sandpiper.trainer.memory_plan`, which does the arithmetic. GPUs play one of
three roles: a learner rank's, a vLLM server's, or both (one GPU shared, placement with
``inference.gpus`` overlapping ``learner.gpus``); GPUs of one role get one row.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandpiper.config import RunConfig
from sandpiper.errors import SetupError
from sandpiper.trainer import memory_plan as mp

VLLM_DEFAULT_UTILIZATION = 0.92
"""vLLM's own ``--gpu-memory-utilization`` default (PLATFORM.md)."""


@dataclass(frozen=True, slots=True)
class GpuPlan:
    """One role's GPUs and the plan of each of them."""

    role: str
    """``learner``, ``inference`` or ``learner+inference``."""
    gpu_ids: tuple[int, ...]
    plan: mp.MemoryPlan


def _model_config_path(cfg: RunConfig) -> Path:
    return Path(cfg.learner.model)


def learner_setup(cfg: RunConfig, *, world_size: int, device: str = "cuda") -> mp.LearnerSetup:
    """The planner's view of ``cfg.learner`` (fields another part may not have yet are read
    with their defaults)."""
    learner = cfg.learner
    ds = mp.ds_settings(learner.deepspeed_config)
    setting = getattr(learner, "precision", "auto")
    bf16 = setting == "bf16" or (setting == "auto" and device == "cuda") or ds["bf16"] is True
    precision: mp.Precision = "bf16" if bf16 else "fp32"
    micro = learner.micro_batch_tokens
    return mp.LearnerSetup(
        precision=precision,
        zero_stage=ds["zero_stage"],
        world_size=world_size,
        micro_batch_tokens=micro,
        row_tokens=min(cfg.inference.max_model_len, micro),
        gradient_checkpointing=bool(getattr(learner, "gradient_checkpointing", False)),
        logprob_chunk_tokens=int(getattr(learner, "logprob_chunk_tokens", 0) or 0),
        offload_optimizer=ds["offload_optimizer"],
        offload_param=ds["offload_param"],
        reduce_bucket_size=ds["reduce_bucket_size"],
        allgather_bucket_size=ds["allgather_bucket_size"],
        overlap_comm=ds["overlap_comm"],
        stage3_max_live_parameters=ds["stage3_max_live_parameters"],
        device="cuda" if device == "cuda" else "cpu",
    )


def vllm_share(cfg: RunConfig, servers_on_gpu: int = 1) -> mp.VllmShare:
    inf = cfg.inference
    dtype = (getattr(inf, "dtype", None) or "auto").lower()
    return mp.VllmShare(
        gpu_memory_utilization=getattr(inf, "gpu_memory_utilization", None)
        or VLLM_DEFAULT_UTILIZATION,
        dtype_bytes=4 if dtype in ("float32", "float") else 2,
        max_model_len=inf.max_model_len,
        servers=servers_on_gpu,
        tensor_parallel=max(1, int(getattr(inf, "tensor_parallel_size", 1) or 1)),
    )


def plan_run(
    cfg: RunConfig,
    *,
    gpu: str,
    gpu_bytes: int,
    nproc: int | None = None,
    shape: mp.ModelShape | None = None,
) -> list[GpuPlan]:
    """The plan of every GPU the run uses, grouped by role.

    Learner GPUs: ``learner.gpus`` when set, else ``nproc`` (``sandpiper learn --nproc``, 1 by
    default) GPUs numbered from 0. Inference GPUs: ``inference.gpus`` (vLLM servers elsewhere,
    ``inference.server_urls``, or on CPU take no GPU here)."""
    shape = shape or mp.model_shape(_model_config_path(cfg))
    learner_gpus = list(getattr(cfg.learner, "gpus", []) or [])
    if not learner_gpus:
        learner_gpus = list(range(nproc or 1))
    inference_gpus = [] if cfg.inference.server_urls else list(getattr(cfg.inference, "gpus", []))
    setup = learner_setup(cfg, world_size=len(learner_gpus))
    share = vllm_share(cfg)
    roles: dict[str, list[int]] = {}
    for g in sorted(set(learner_gpus) | set(inference_gpus)):
        role = "+".join(
            r for r, ids in (("learner", learner_gpus), ("inference", inference_gpus)) if g in ids
        )
        roles.setdefault(role, []).append(g)
    out = []
    for role, ids in roles.items():
        plan = mp.plan(
            shape, setup, gpu=gpu, gpu_bytes=gpu_bytes,
            vllm=share if "inference" in role else None,
            learner_ranks_on_gpu=1 if "learner" in role else 0,
        )  # fmt: skip
        out.append(GpuPlan(role, tuple(ids), plan))
    return out


def _gib(n: int) -> str:
    return f"{n / mp.GIB:8.2f}"


LEARNER_ROWS = (
    ("weights", "weights (training dtype)"),
    ("master_fp32", "fp32 master copy"),
    ("gradients", "gradients"),
    ("optimizer_adam", "Adam moments (fp32)"),
    ("activations", "activations (micro-batch)"),
    ("recompute_layer", "  checkpoint recompute"),
    ("logprob_step", "logprob step"),
    ("grad_buckets", "DeepSpeed grad buckets"),
    ("optimizer_step_tmp", "optimizer step temporaries"),
)


def render(plans: list[GpuPlan], *, model: str, shape: mp.ModelShape) -> str:
    """The plans as a readable table (GiB), one block per role."""
    lines = [
        f"model {model}: {shape.architecture}, {shape.params_published:,} parameters published"
        f", {shape.params_trained:,} trained (output layer untied)"
    ]
    for gp in plans:
        p, s = gp.plan, gp.plan.setup
        ids = ",".join(map(str, gp.gpu_ids))
        lines.append("")
        lines.append(f"GPU {ids} ({gp.role}) on {p.gpu}: {_gib(p.gpu_bytes).strip()} GiB")
        if p.learner:
            lines.append(
                f"  learner rank: {s['precision']}, ZeRO-{s['zero_stage']}, world size "
                f"{s['world_size']}, micro-batch {s['micro_batch_tokens']:,} tokens (rows of "
                f"{s['row_tokens']:,}), checkpointing {'on' if s['gradient_checkpointing'] else 'off'}"
                f", logprob chunk {s['logprob_chunk_tokens'] or 'none (full logits)'}"
                + (", optimizer offloaded" if s["offload_optimizer"] else "")
            )
            for key, label in LEARNER_ROWS:
                if key in p.learner:
                    lines.append(f"    {label:<30}{_gib(p.learner[key])} GiB")
                if key == "recompute_layer" and p.checkpointing:
                    other = "off" if s["gradient_checkpointing"] else "on"
                    alt = p.checkpointing[other]
                    lines.append(
                        f"      with checkpointing {other}: activations "
                        f"{_gib(alt['activations']).strip()} GiB, rank peak "
                        f"{_gib(alt['peak']).strip()} GiB"
                    )
            for key, value in p.host.items():
                lines.append(f"    {key + ' (host memory)':<30}{_gib(value)} GiB")
            lines.append(f"    {'peak (with context, margin)':<30}{_gib(p.learner_peak)} GiB")
        if p.vllm:
            v = p.vllm
            lines.append(
                f"  vLLM share: {_gib(v['budget']).strip()} GiB ({v['servers']} server(s)): "
                f"weights {_gib(v['weights']).strip()} GiB, KV cache "
                f"{_gib(v['kv_cache']).strip()} GiB = {v['kv_tokens']:,} tokens "
                f"({v['kv_bytes_per_token']:,} B each) = {v['concurrent_sequences']:,} "
                f"sequences of {v['max_model_len']:,}"
            )
        lines.append(
            f"  total {_gib(p.total).strip()} of {_gib(p.gpu_bytes).strip()} GiB: "
            + ("fits" if p.fits else "DOES NOT FIT: " + "; ".join(p.reasons))
        )
    return "\n".join(lines)


def to_json(plans: list[GpuPlan], *, model: str, shape: mp.ModelShape) -> dict[str, Any]:
    return {
        "fits": all(gp.plan.fits for gp in plans),
        "model": model,
        "shape": {k: getattr(shape, k) for k in shape.__slots__},
        "gpus": [
            {"role": gp.role, "gpu_ids": list(gp.gpu_ids), **gp.plan.to_json()} for gp in plans
        ],
    }


def cuda_device_bytes() -> tuple[str, int] | None:
    """(name, total bytes) of CUDA device 0, or None without one. torch is imported only
    when the host looks like it has an NVIDIA GPU."""
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, int(props.total_memory)


def check_fits(
    cfg: RunConfig,
    *,
    role: str,
    nproc: int | None = None,
    device: Callable[[], tuple[str, int] | None] | None = None,
) -> None:
    """Refuse (:class:`SetupError` with the table) a config whose ``role`` GPUs (``learner``
    or ``inference``) cannot hold what the planner adds up, on the CUDA device this host has.
    Without a CUDA device nothing is checked (the CPU paths are sized by the OS)."""
    found = (device or cuda_device_bytes)()
    if found is None:
        return
    if role == "inference" and (cfg.inference.server_urls or not cfg.inference.gpus):
        return
    name, size = found
    shape = mp.model_shape(_model_config_path(cfg))
    plans = plan_run(cfg, gpu=name, gpu_bytes=size, nproc=nproc, shape=shape)
    bad = [gp for gp in plans if role in gp.role and not gp.plan.fits]
    if bad:
        table = render(plans, model=cfg.learner.model, shape=shape)
        raise SetupError(
            f"this config does not fit on {name} ({size / mp.GIB:.1f} GiB): "
            + "; ".join(bad[0].plan.reasons)
            + "\n"
            + table
            + "\nlower learner.micro_batch_tokens or inference.gpu_memory_utilization, turn on "
            "learner.gradient_checkpointing, or use a higher ZeRO stage / more GPUs "
            "(`sandpiper plan -c CONFIG` prints this table)"
        )
