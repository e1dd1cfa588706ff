"""Which device the learner trains on (``learner.device``), and what goes with that choice.

- ``cuda`` refuses to start without a usable GPU, naming what is missing: a torch built
  without CUDA, ``CUDA_VISIBLE_DEVICES`` set to nothing, no device visible (no GPU, or no
  driver), or fewer visible GPUs than this rank's ``LOCAL_RANK`` needs.
- ``auto`` takes the GPU when torch can use one and the CPU otherwise, and says once (rank 0)
  which it took and why: a GPU run that silently trains on the CPU is what this prevents.
- ``cpu`` never touches CUDA, even on a GPU host.

The choice fixes the rest: DeepSpeed's accelerator (``DS_ACCELERATOR``, which DeepSpeed reads
once, when it first picks an accelerator; :func:`apply` sets it before and checks after) and
the process-group backend, NCCL on GPU and gloo on CPU.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Literal

from sandpiper.errors import SetupError

log = logging.getLogger("sandpiper.learner")

DeviceSetting = Literal["auto", "cuda", "cpu"]


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    kind: Literal["cuda", "cpu"]
    reason: str
    """Why this kind (for the one log line of ``auto``)."""

    @property
    def backend(self) -> Literal["nccl", "gloo"]:
        """The torch.distributed backend for this device."""
        return "nccl" if self.kind == "cuda" else "gloo"

    @property
    def accelerator(self) -> str:
        """``DS_ACCELERATOR`` for this device."""
        return self.kind


def cuda_missing(*, local_rank: int = 0) -> str | None:
    """Why this process cannot train on a GPU, or None when it can."""
    import torch

    if not torch.backends.cuda.is_built():
        return f"torch {torch.__version__} was built without CUDA (a CPU-only wheel)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES is {visible!r}: it hides every GPU from this process"
    if not torch.cuda.is_available():
        return (
            "no CUDA device is visible (torch.cuda.is_available() is False: no GPU on this "
            "host, or its driver is missing or does not match; see nvidia-smi)"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        return f"this rank has LOCAL_RANK {local_rank} but only {count} GPU(s) are visible"
    return None


def choose_device(setting: DeviceSetting, *, local_rank: int = 0) -> DeviceChoice:
    """Resolve ``learner.device``; raises :class:`SetupError` for ``cuda`` without a GPU."""
    if setting == "cpu":
        return DeviceChoice("cpu", "learner.device = cpu")
    missing = cuda_missing(local_rank=local_rank)
    if setting == "cuda":
        if missing is not None:
            raise SetupError(f"learner.device = cuda, but {missing}; set learner.device = cpu "
                             "(or auto) to train on the CPU")  # fmt: skip
        return DeviceChoice("cuda", "learner.device = cuda")
    if missing is None:
        return DeviceChoice("cuda", "learner.device = auto and a GPU is visible")
    return DeviceChoice("cpu", f"learner.device = auto and {missing}")


def apply(choice: DeviceChoice, *, announce: bool) -> None:
    """Point DeepSpeed at ``choice`` (before it is imported) and log ``auto``'s pick once."""
    previous = os.environ.get("DS_ACCELERATOR")
    if previous is not None and previous != choice.accelerator:
        log.warning(
            "DS_ACCELERATOR=%s replaced by %s (%s)", previous, choice.accelerator, choice.reason
        )
    os.environ["DS_ACCELERATOR"] = choice.accelerator
    if announce:
        log.info("learner trains on %s: %s", choice.kind, choice.reason)


def check_accelerator(choice: DeviceChoice) -> None:
    """After deepspeed's import: refuse a DeepSpeed that picked another accelerator (it was
    imported and asked for one before :func:`apply` ran)."""
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != choice.accelerator:
        from sandpiper.errors import LearnerError

        raise LearnerError(
            f"DeepSpeed chose the {name} accelerator before the learner chose {choice.kind} "
            f"({choice.reason}): something imported deepspeed first; set "
            f"DS_ACCELERATOR={choice.accelerator}"
        )
