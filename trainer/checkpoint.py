"""Policy checkpoints: a folder of safetensors + config + tokenizer, written atomically.

The output layer is always saved **untied** from the input embeddings: vLLM's in-place
weight reload does not refresh a tied output layer (PLATFORM.md). A checkpoint is written to
a temporary sibling folder and renamed into place, so a reader (or a restarted learner) never
sees a half-written folder. Loadable by ``AutoModelForCausalLM.from_pretrained`` and vLLM.
"""

from __future__ import annotations

import os
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


def save_checkpoint(
    model: Any,
    out_dir: str | Path,
    *,
    tokenizer: Any | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` (or ``state_dict`` with ``model``'s config) atomically to ``out_dir``.

    An existing ``out_dir`` (left by a learner that crashed before registering it) is
    replaced: the version was never registered, so nobody can be using it.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    for leftover in out.parent.glob(f".{out.name}.*"):  # from a learner killed mid-write
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    # The live model was untied at load; under ZeRO-3 its parameters are empty shards, so
    # only the config is touched here (never the parameters).
    _mark_untied(model.config)
    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if out.exists():
        trash = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(trash)
        shutil.rmtree(trash)
    tmp.rename(out)
    return out
