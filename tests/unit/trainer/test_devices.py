"""``learner.device``: ``cuda`` refuses a host without a usable GPU and names what is missing;
``auto`` falls back to the CPU and says why; the backend and DeepSpeed accelerator follow."""

from __future__ import annotations

import os
import re

import pytest
import torch

from sandpiper.errors import SetupError
from sandpiper.trainer.devices import apply, choose_device


def _gpu_host(monkeypatch, *, built=True, available=True, count=1) -> None:
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize(
    ("host", "visible", "missing"),
    [
        (dict(built=False), None, "built without CUDA"),
        (dict(), "", "CUDA_VISIBLE_DEVICES is ''"),
        (dict(available=False), None, "no CUDA device is visible"),
        (dict(count=1), None, "LOCAL_RANK 1 but only 1 GPU"),
    ],
)
def test_cuda_refuses_naming_what_is_missing(monkeypatch, host, visible, missing):
    _gpu_host(monkeypatch, **host)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(SetupError, match=missing):
        choose_device("cuda", local_rank=1 if "LOCAL_RANK" in missing else 0)
    auto = choose_device("auto", local_rank=1 if "LOCAL_RANK" in missing else 0)
    assert (auto.kind, auto.backend) == ("cpu", "gloo") and missing in auto.reason


def test_auto_takes_a_visible_gpu_and_cpu_never_does(monkeypatch):
    _gpu_host(monkeypatch)
    gpu = choose_device("auto")
    assert (gpu.kind, gpu.backend, gpu.accelerator) == ("cuda", "nccl", "cuda")
    assert choose_device("cuda").kind == "cuda"
    assert choose_device("cpu").kind == "cpu"


def test_this_machine_cpu_torch(monkeypatch):
    """The CPU wheel of torch this project pins: ``cuda`` says so, ``auto`` is the CPU."""
    if torch.backends.cuda.is_built():
        pytest.skip("a CUDA build of torch")
    with pytest.raises(
        SetupError, match=re.escape(f"torch {torch.__version__} was built without CUDA")
    ):
        choose_device("cuda")
    assert choose_device("auto").kind == "cpu"


def test_apply_sets_the_accelerator_and_logs_once(monkeypatch, caplog):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    caplog.set_level("INFO", logger="sandpiper.learner")
    apply(choose_device("cpu"), announce=True)
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    text = caplog.text
    assert "DS_ACCELERATOR=cuda replaced by cpu" in text and "learner trains on cpu" in text
