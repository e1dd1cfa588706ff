"""DeepSpeed engine: one code path for CPU (gloo) and GPU (NCCL), ZeRO 0-3 from a JSON file.

Launch with ``deepspeed --num_gpus N -m ...``, with ``torchrun``, or as plain ``python``: in
the last case :func:`init_distributed` fills in a single-process world (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which DeepSpeed otherwise looks up through mpi4py.
The optimiser is torch's AdamW, so nothing is JIT-compiled (DeepSpeed's fused/CPU Adam ops
take minutes to build on CPU).

The learner controls gradient accumulation itself (a variable number of packed micro-batches
per optimiser step): the JSON's batch-size fields are overwritten with a micro-batch of 1
and no accumulation, and the learner marks the accumulation boundary explicitly.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from sandpiper.errors import ConfigError
from sandpiper.trainer import devices, ranks
from sandpiper.trainer.devices import DeviceSetting, choose_device

log = logging.getLogger(__name__)

Precision = Literal["bf16", "fp32"]
"""A resolved ``learner.precision``."""


@dataclass(frozen=True, slots=True)
class World:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (a rendezvous port for a world)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SHM_COMM_OP = "deepspeed_shm_comm"


def disable_shm_comm_op() -> None:
    """Keep DeepSpeed (0.19.8) from JIT-building its shared-memory allreduce op on CPU.

    ``deepspeed.init_distributed`` builds that op on every CPU start and holds a file lock in
    ``~/.cache/torch_extensions`` while it compiles or checks it. A learner killed in that
    window (kill -9 during start-up) leaves the lock behind, and every later learner waits
    on it forever — seen in the resume test. The op only speeds up allreduce between CPU
    processes of one host; gloo does the same job here. This and :func:`destroy_engine` are
    where the learner touches DeepSpeed's internals (tests hold both to the pinned version).
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


_OWN_WORLD_ENV: dict[str, str | None] = {}
"""The variables :func:`init_distributed` set for a world of one, with what they held before:
:func:`shutdown_distributed` puts them back, so a child started afterwards (a test's next
learner, say) does not inherit a rendezvous port this process's store held (EADDRINUSE)."""


def init_distributed(
    device_setting: DeviceSetting = "auto", *, collective_timeout_s: float | None = None
) -> World:
    """Join (or create) the process group on ``device_setting`` (``learner.device``, see
    :mod:`.devices`); must run before DeepSpeed is imported elsewhere.

    ``collective_timeout_s`` (``learner.collective_timeout_s``; None = DeepSpeed's default)
    bounds each collective of the default group. It is set once the group is up: the
    rendezvous itself keeps DeepSpeed's default, so ranks that start a few seconds apart
    still meet. Rank 0's long waits never run into it (:mod:`.ranks`)."""
    choice = choose_device(device_setting, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    devices.apply(choice, announce=os.environ.get("RANK", "0") == "0")
    on_gpu = choice.kind == "cuda"
    own_world = "RANK" not in os.environ
    if own_world:  # plain `python`: a world of one
        world = dict(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())),
        )  # fmt: skip
        _OWN_WORLD_ENV.update({key: os.environ.get(key) for key in world})
        os.environ.update(world)
    import deepspeed

    # Imported before the default group exists: its functions take `group=group.WORLD` as a
    # default, bound at import, and DeepSpeed imports it lazily (sequence parallelism) once
    # the group is up. Imported later, they would hold the default group past
    # `shutdown_distributed`, and its gloo threads into the interpreter's teardown.
    from torch.distributed import nn as _  # noqa: F401

    if not on_gpu:
        disable_shm_comm_op()
    for attempt in range(5):
        try:
            deepspeed.init_distributed(dist_backend=choice.backend)
            break
        except torch.distributed.DistNetworkError:
            # the free port we picked was taken before the store bound it (another process
            # binding ephemeral ports meanwhile): a world of one just picks another
            if not own_world or attempt == 4:
                raise
            os.environ["MASTER_PORT"] = str(free_port())
    devices.check_accelerator(choice)
    if collective_timeout_s is not None:
        from datetime import timedelta

        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=collective_timeout_s))
    ranks.reset()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    return World(rank, int(os.environ["WORLD_SIZE"]), device)


def broadcast_from_main(obj: Any, world: World) -> Any:
    """Rank 0's ``obj`` on every rank (only rank 0 talks to the store; the others learn what
    it found through this). A world of one returns ``obj`` as is."""
    if world.world_size == 1:
        return obj
    import torch.distributed as dist

    ranks.arrive_together(world.world_size, rank=world.rank)  # rank 0 may come much later
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


COMM_THREAD_PREFIXES = ("pt_gloo", "gloo_", "pt_tcpstore")
"""Names (``/proc/self/task/*/comm``) of the native threads of gloo and the c10d store."""


def shutdown_distributed(*, clean: bool = True) -> int:
    """Leave the process group before the interpreter starts finalizing: every rank first
    waits for the others (``clean``), then the groups are destroyed and every reference to
    them dropped, so their native threads are joined now. Returns how many of those threads
    are still alive (0 unless something outside DeepSpeed still holds a group).

    Why: a process that exits with a gloo group alive aborts at random (SIGABRT,
    "terminate called without an active exception"): gloo's C++ worker threads still hold
    work whose tensors reference Python objects, and the interpreter is already torn down
    when their destructors run (pytorch/pytorch#190489). Measured on this machine with a
    minimal 2-rank torchrun script (20 all-reduces and one object broadcast): 8 of 40 runs
    aborted without destroying the group, 0 of 40 with it. Destroying it is not enough in
    a learner, though: ``torch.distributed.destroy_process_group`` only unregisters the
    groups, and DeepSpeed keeps its own references (``deepspeed.utils.groups``, and the
    engine's ``data_parallel_group``), so gloo's threads (4 ``pt_gloo_runloop``, 2
    ``gloo_tcp_loop``) lived on into finalization, and a 2-rank test still aborted in CI.
    DeepSpeed's ``destroy_process_group`` drops the module's references; the engine's go
    when the engine does (the caller must not hold one) and ``gc.collect`` frees the
    reference cycles it sits in.

    Without the barrier a fast rank would tear down its end while rank 0 still registers
    the last version. ``clean=False`` (the run failed on this rank) skips the barrier,
    which a rank that stopped early would never reach, and only destroys.
    """
    import gc

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0
    if clean and dist.get_world_size() > 1:
        ranks.arrive_together(dist.get_world_size(), rank=dist.get_rank())
    import deepspeed.comm as ds_comm

    if ds_comm.is_initialized():
        ds_comm.destroy_process_group()  # also drops deepspeed.utils.groups' references
    else:
        dist.destroy_process_group()
    gc.collect()
    for key, value in _OWN_WORLD_ENV.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _OWN_WORLD_ENV.clear()
    left = comm_threads()
    if left:
        log.warning(
            "%d gloo/store threads outlive the process group (something still holds it): "
            "this process may abort at exit", left,
        )  # fmt: skip
    return left


def comm_threads() -> int:
    """How many native gloo / c10d-store threads this process has (Linux; 0 elsewhere)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    n = 0
    for task in tasks:
        try:
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        n += name.startswith(COMM_THREAD_PREFIXES)
    return n


def destroy_engine(engine: Any) -> None:
    """Take a finished engine's hooks off its model and drop DeepSpeed's module-level
    references to it, so the engine, its model and its process groups can be freed.

    ``DeepSpeedEngine.destroy`` removes the hooks. ZeRO-3 (DeepSpeed 0.19.8) keeps two more
    references that nothing releases: the model stays on
    ``parameter_offload.FWD_MODULE_STACK``, and the parameter coordinator stays a key of
    the ``functools.lru_cache`` on its ``__params_to_release`` method. Either kept the engine
    alive, and with it a gloo group whose threads then ran into the interpreter's teardown
    (see :func:`shutdown_distributed`). ``tests/integration/trainer/test_learner_deepspeed.py``
    checks that no gloo thread is left after a 2-rank learner with ZeRO 0 and 3, so a
    DeepSpeed upgrade that adds such a reference fails there, not at random at exit."""
    engine.destroy()
    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack[:] = [m for m in stack if m is not engine.module]
    coordinator = partitioned_param_coordinator.PartitionedParameterCoordinator
    method = getattr(coordinator, "_PartitionedParameterCoordinator__params_to_release", None)
    for cell in getattr(method, "__closure__", None) or ():  # under DeepSpeed's nvtx wrapper
        cached = cell.cell_contents
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


CPU_AUTO_PRECISION: Precision = "fp32"
"""What ``learner.precision = "auto"`` means on a CPU. Measured on this project's CPU (x86-64
with ``avx512_bf16``, no AMX; ``bench/learner_precision.py``): see docs/learner.md."""


def resolve_precision(setting: str, device: torch.device) -> Precision:
    """``learner.precision`` on ``device``: bf16 on CUDA and fp32 on CPU for ``auto``."""
    if setting == "auto":
        return "bf16" if device.type == "cuda" else CPU_AUTO_PRECISION
    if setting not in ("bf16", "fp32"):
        raise ConfigError(f"learner.precision = {setting!r}: use auto, bf16 or fp32")
    return "bf16" if setting == "bf16" else "fp32"


def load_ds_config(
    path: str | Path, *, world_size: int, max_grad_norm: float, precision: Precision = "fp32"
) -> dict[str, Any]:
    """Read a DeepSpeed JSON and pin the fields the learner owns (``precision`` included:
    the JSON's ``bf16.enabled`` may be absent, ``"auto"`` or agree, never contradict it)."""
    config = json.loads(Path(path).read_text())
    config.pop("optimizer", None)  # the learner passes torch AdamW
    config.pop("scheduler", None)
    config.update(
        train_micro_batch_size_per_gpu=1,
        gradient_accumulation_steps=1,
        train_batch_size=world_size,
        gradient_clipping=max_grad_norm,
        zero_allow_untested_optimizer=True,
        zero_force_ds_cpu_optimizer=False,
    )
    config["bf16"] = {**config.get("bf16", {}), "enabled": _bf16_enabled(config, path, precision)}
    return config


def _bf16_enabled(config: dict[str, Any], path: str | Path, precision: Precision) -> bool:
    want = precision == "bf16"
    fp16 = config.get("fp16", {}).get("enabled", False)
    if fp16 not in (False, "auto"):
        raise ConfigError(
            f"{path}: fp16.enabled = {fp16!r}: the learner trains in bf16 or fp32 "
            "(learner.precision); set it false"
        )
    given = config.get("bf16", {}).get("enabled", "auto")
    if given != "auto" and given is not want:
        raise ConfigError(
            f"{path}: bf16.enabled = {json.dumps(given)} contradicts learner.precision "
            f'(here {precision}): set it "auto" (the learner decides) or change the precision'
        )
    return want


def build_engine(
    model: torch.nn.Module,
    *,
    ds_config_path: str | Path,
    world: World,
    lr: float,
    weight_decay: float,
    max_grad_norm: float,
    precision: str = "fp32",
    gradient_checkpointing: bool = False,
) -> Any:
    """Wrap ``model`` in a DeepSpeed engine with torch AdamW.

    ``precision`` (``learner.precision``, resolved for ``world.device``): ``bf16`` is
    DeepSpeed's bf16 mode: the module is cast to bf16 (forward, activations, gradients) and
    the optimiser steps fp32 master weights. ``gradient_checkpointing``: transformers'
    non-reentrant activation checkpointing of every decoder layer (correct with packed
    position ids: the recompute sees the same ``position_ids``, and no attention mask).
    """
    import deepspeed

    config = load_ds_config(
        ds_config_path, world_size=world.world_size, max_grad_norm=max_grad_norm,
        precision=resolve_precision(precision, world.device),
    )  # fmt: skip
    if gradient_checkpointing:
        enable: Any = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise ConfigError(
                f"learner.gradient_checkpointing: {type(model).__name__} is not a transformers "
                "model (it has no gradient_checkpointing_enable)"
            )
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(world.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine
