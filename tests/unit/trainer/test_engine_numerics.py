"""The learner's numerics settings (trainer/engine.py): ``learner.precision`` becomes the
DeepSpeed config's ``bf16.enabled`` (fp32 exactly as before, a contradicting JSON refused),
bf16 stays close to fp32, and gradient checkpointing changes neither logprobs nor gradients
of packed sequences."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sandpiper.errors import ConfigError
from sandpiper.trainer.engine import CPU_AUTO_PRECISION, load_ds_config, resolve_precision
from sandpiper.trainer.packing import MicroBatch, TrainSequence, pack, packed_logprobs

REPO = Path(__file__).resolve().parents[3]
DS_CONFIGS = sorted((REPO / "configs").glob("deepspeed_zero*.json"))


def _before_precision(path: Path, world_size: int, max_grad_norm: float) -> dict:
    """``load_ds_config`` as it was before ``learner.precision`` (the JSONs said
    ``"bf16": {"enabled": false}``)."""
    config = json.loads(path.read_text())
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    config.update(
        train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
        train_batch_size=world_size, gradient_clipping=max_grad_norm,
        zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False,
    )  # fmt: skip
    config["bf16"] = {**config.get("bf16", {}), "enabled": False}
    config["fp16"] = {"enabled": False}
    return config


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_fp32_is_the_deepspeed_config_of_before(path: Path) -> None:
    got = load_ds_config(path, world_size=2, max_grad_norm=1.0, precision="fp32")
    assert got == _before_precision(path, 2, 1.0)
    bf16 = load_ds_config(path, world_size=2, max_grad_norm=1.0, precision="bf16")
    assert bf16["bf16"]["enabled"] is True and bf16 != got


def test_a_deepspeed_config_that_contradicts_the_precision_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}))
    with pytest.raises(ConfigError) as refused:
        load_ds_config(path, world_size=1, max_grad_norm=1.0, precision="fp32")
    message = str(refused.value)
    assert "\n" not in message and "bf16.enabled = true contradicts learner.precision" in message
    assert load_ds_config(path, world_size=1, max_grad_norm=1.0, precision="bf16")
    path.write_text(json.dumps({"fp16": {"enabled": True}}))
    with pytest.raises(ConfigError, match=r"fp16\.enabled"):
        load_ds_config(path, world_size=1, max_grad_norm=1.0, precision="bf16")


def test_auto_precision_is_bf16_on_cuda_and_the_measured_choice_on_cpu() -> None:
    assert resolve_precision("auto", torch.device("cuda", 0)) == "bf16"
    assert resolve_precision("auto", torch.device("cpu")) == CPU_AUTO_PRECISION
    assert resolve_precision("fp32", torch.device("cuda", 0)) == "fp32"


def _micro(vocab: int, lengths: tuple[int, ...] = (40, 17, 29, 11)) -> MicroBatch:
    rng = np.random.default_rng(0)
    seqs = []
    for n in lengths:
        mask = np.r_[np.zeros(n // 3, bool), np.ones(n - n // 3, bool)]
        ids = rng.integers(1, vocab, n).astype(np.int32)
        seqs.append(TrainSequence(f"e{n}", ids, mask, np.where(mask, -1.0, np.nan), 1.0))
    return pack(seqs, [1.0] * len(seqs))


def _loss_and_grads(model: torch.nn.Module, micro: MicroBatch) -> tuple:
    model.zero_grad(set_to_none=True)
    logp = packed_logprobs(model, micro, chunk_tokens=16)
    weights = torch.linspace(-1.0, 1.0, logp.numel()) * micro.loss_mask_T
    loss = (logp * weights).sum()
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    return logp.detach().float(), float(loss), grads


def test_bf16_loss_and_gradient_stay_close_to_fp32(learner_tiny_model: Path) -> None:
    """What DeepSpeed's bf16 mode computes: the module cast to bf16 (its master weights stay
    fp32 in the optimiser). Loss within 2 %, gradient direction within 1 % (cosine)."""
    from sandpiper.trainer.checkpoint import load_model

    fp32 = load_model(learner_tiny_model).train()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    micro = _micro(fp32.config.vocab_size)
    _, loss32, g32 = _loss_and_grads(fp32, micro)
    _, loss16, g16 = _loss_and_grads(bf16, micro)
    assert abs(loss16 - loss32) <= 0.02 * abs(loss32), (loss16, loss32)
    cosine = float(torch.nn.functional.cosine_similarity(g16, g32, dim=0))
    assert cosine >= 0.99, cosine
    assert abs(float(g16.norm() / g32.norm()) - 1) <= 0.05
    assert not torch.equal(g16, g32)  # it did run in bf16


def _checkpointing_matches(model: torch.nn.Module, micro: MicroBatch) -> None:
    model.train()
    ckpt = copy.deepcopy(model)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert ckpt.is_gradient_checkpointing
    calls = {"plain": 0, "ckpt": 0}
    # a pre-hook: the recompute stops early, before a forward hook would run
    for name, m in (("plain", model), ("ckpt", ckpt)):
        m.get_decoder().layers[0].register_forward_pre_hook(
            lambda *_, name=name: calls.__setitem__(name, calls[name] + 1)
        )
    logp, loss, grads = _loss_and_grads(model, micro)
    logp_c, loss_c, grads_c = _loss_and_grads(ckpt, micro)
    assert calls == {"plain": 1, "ckpt": 2}  # the checkpointed layer was recomputed
    assert (logp_c - logp).abs().max() <= 1e-6
    assert abs(loss_c - loss) <= 1e-6 * max(1.0, abs(loss))
    assert (grads_c - grads).abs().max() <= 1e-6 * max(1.0, float(grads.abs().max()))


def test_gradient_checkpointing_changes_nothing_on_packed_sequences(learner_tiny_model) -> None:
    from sandpiper.trainer.checkpoint import load_model

    model = load_model(learner_tiny_model)
    _checkpointing_matches(model, _micro(model.config.vocab_size))


@pytest.mark.slow
def test_gradient_checkpointing_changes_nothing_on_smollm2() -> None:
    from sandpiper.trainer.checkpoint import load_model

    folder = REPO / "runs" / "smollm2-135m"
    if not (folder / "config.json").is_file():
        pytest.skip("runs/smollm2-135m is made by `make setup`")
    model = load_model(folder)
    _checkpointing_matches(model, _micro(model.config.vocab_size, (48, 30, 18)))
