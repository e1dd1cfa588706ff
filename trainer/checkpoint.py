"""Policy checkpoints: a folder of safetensors + config + tokenizer, written atomically.

A version's folder is ``v<version>-t<term>`` under the checkpoint dir (the term of the
learner that wrote it, see docs/scaleout.md); ``trainer/resume.py`` adds the training state.

The output layer is always saved **untied** from the input embeddings: vLLM's in-place
weight reload does not refresh a tied output layer (PLATFORM.md). A checkpoint is written to
a temporary sibling folder and renamed into place, so a reader (or a restarted learner) never
sees a half-written folder. Loadable by ``AutoModelForCausalLM.from_pretrained`` and vLLM.

The weights are written in the dtype the learner's forward pass computes with
(:func:`publish_dtype`: bf16 under DeepSpeed's bf16 mode, float32 otherwise), so the sampler
scores tokens with the very weights the learner does, at half the bytes of float32. Under
ZeRO-3 they are gathered one submodule at a time and kept on rank 0 only
(:func:`gather_state_dict`): no rank ever holds the whole model beyond its shard, except
rank 0's CPU copy that is written.
"""

from __future__ import annotations

import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch


def untie_output_layer(model: Any) -> None:
    """Give the output layer its own copy of the embedding matrix (before training starts)."""
    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out is not None and out.weight is emb.weight:
        out.weight = torch.nn.Parameter(emb.weight.detach().clone())
    _mark_untied(model.config)


def _mark_untied(config: Any) -> None:
    config.tie_word_embeddings = False
    text_config = config.get_text_config()
    if text_config is not config:
        text_config.tie_word_embeddings = False


def load_model(path: str | Path) -> Any:
    """Load a policy in float32 for training, with an untied output layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    untie_output_layer(model)
    return model


def load_tokenizer(path: str | Path) -> Any | None:
    """The tokenizer saved next to the model, or None when the folder has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        return None


def policy_folder_name(version: int, term: int) -> str:
    """``v000007-t0002``: the term makes two learners' folders for one version distinct."""
    return f"v{version:06d}-t{term:04d}"


FOLDER_RE = re.compile(r"^\.?v(?P<version>\d{6})-t(?P<term>\d{4,})(?:\.tmp-[0-9a-f]+)?$")
"""Policy folders (``v…-t…``) and their temporary folders (``.v…-t….tmp-<random>``)."""


def temp_folder(out: str | Path) -> Path:
    """A fresh temporary sibling of ``out`` (unique: never shared with another learner)."""
    out = Path(out)
    return out.with_name(f".{out.name}.tmp-{secrets.token_hex(4)}")


def publish_dtype(engine: Any) -> torch.dtype:
    """The dtype of the published weights: that of the engine's module parameters, which
    the learner's forward pass uses (bf16 under DeepSpeed's bf16 mode, fp16 under fp16,
    float32 otherwise: the CPU path, exactly as before). The fp32 master copy, which only
    the optimiser reads, travels with the training state (``trainer/resume.py``)."""
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


def _host_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A CPU copy of ``t``, floating-point tensors in ``dtype`` (integer buffers as they are)."""
    return t.detach().to("cpu", dtype=dtype if t.is_floating_point() else t.dtype, copy=True)


def gather_state_dict(
    engine: Any, *, dtype: torch.dtype, rank: int
) -> dict[str, torch.Tensor] | None:
    """The full ``state_dict`` of ``engine.module`` in ``dtype`` on rank 0's CPU; None on the
    other ranks. Collective under ZeRO-3 (every rank must call it); local otherwise.

    ZeRO 0-2 keep the whole module on every rank: rank 0 copies it, the others do nothing.
    ZeRO-3 shards every parameter: each submodule's own parameters are gathered in turn
    (``GatheredParameters``, all ranks) and released at once, rank 0 copying them to its
    CPU. A rank other than 0 therefore never holds more than its shard plus one
    submodule's parameters (the largest is the embedding), where gathering the whole
    model at once put every parameter on every rank for the length of the save."""
    module = engine.module
    if engine.zero_optimization_stage() != 3:
        if rank != 0:
            return None
        return {k: _host_copy(v, dtype) for k, v in module.state_dict().items()}
    import deepspeed

    state: dict[str, torch.Tensor] | None = {} if rank == 0 else None
    # the keys state_dict() gives: own parameters, then persistent buffers, per submodule
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        params = {n: p for n, p in sub._parameters.items() if p is not None}
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
            if state is not None:
                for name, p in params.items():
                    state[dot + name] = _host_copy(p, dtype)
        if state is not None:
            for name, b in sub._buffers.items():
                if b is not None and name not in sub._non_persistent_buffers_set:
                    state[dot + name] = _host_copy(b, dtype)
    return state


def folder_bytes(folder: str | Path) -> int:
    """Bytes of the files under ``folder`` (every level)."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def space_shortfall(folder: Path, need_bytes: float, *, what: str) -> str | None:
    """Why ``need_bytes`` will not fit on ``folder``'s filesystem (with 5 % to spare), or
    None. A full disk otherwise ends a checkpoint write half-way with a serialiser's error
    (``unexpected pos ...``) that names neither the disk nor the fix."""
    free = shutil.disk_usage(folder).free
    if free >= need_bytes * 1.05:
        return None
    return (
        f"not enough disk space for {what} in {folder}: it needs about "
        f"{need_bytes / 1e9:.2f} GB (the last one wrote that), {free / 1e9:.2f} GB are free. "
        "Free space there, keep fewer versions (learner.checkpoint_retention = true, "
        "learner.checkpoint_keep_last), or save the training state less often "
        "(learner.train_state_every) or not at all (learner.save_train_state = false)"
    )


def write_weights(
    model: Any,
    folder: Path,
    *,
    tokenizer: Any | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write ``model`` (or ``state_dict`` with ``model``'s config) into ``folder``."""
    # The live model was untied at load; under ZeRO-3 its parameters are empty shards, so
    # only the config is touched here (never the parameters).
    _mark_untied(model.config)
    model.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def commit_folder(tmp: Path, out: Path) -> Path:
    """Rename the finished ``tmp`` to ``out``; never replaces an existing folder."""
    try:
        if out.exists():
            raise FileExistsError(out)
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        from sandpiper.errors import LearnerError

        raise LearnerError(
            f"checkpoint folder {out} exists already (another learner wrote it); not replacing it"
        ) from e
    return out


def save_checkpoint(
    model: Any,
    out_dir: str | Path,
    *,
    tokenizer: Any | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` to a unique temporary folder, then rename it to ``out_dir``.

    Readers never see a half-written folder, and an existing ``out_dir`` is never replaced
    (folder names carry the learner's term, so two learners never share one).
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_folder(out)
    write_weights(model, tmp, tokenizer=tokenizer, state_dict=state_dict)
    return commit_folder(tmp, out)
