"""Training state saved with policy versions, so that a learner resumes exactly.

Every ``learner.train_state_every``-th version folder (and the last one of a clean stop)
holds ``train_state/``: DeepSpeed's own checkpoint of the engine (the
optimiser moments, sharded per rank under ZeRO 1-3, the LR scheduler if any, DeepSpeed's
step counters) written by every rank, plus one ``rng_rank<r>.pt`` per rank with the torch,
CUDA, numpy and Python RNG states. Batch assembly and packing are deterministic given the
claimed groups (no shuffling), so weights + optimiser + RNG are all a step depends on.

vLLM and ``from_pretrained`` read only the top-level files of the folder, so the sub-folder
costs them nothing, and a version without it is served all the same. A learner resumes from
the newest registered version that has it (:func:`newest_with_state`); with retention on,
that version and its state are always kept (``trainer/retention.py``). Every rank must see
the same folder (a shared filesystem across nodes).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_DIR = "train_state"
TAG = "state"


def capture_rng() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_train_state(engine: Any, folder: Path, *, rank: int, name: str = STATE_DIR) -> None:
    """Collective: every rank writes its shard of the engine state and its RNG state into
    ``folder/name`` (a temporary ``name`` when the folder is published already: rename it
    to :data:`STATE_DIR` once every rank is done)."""
    out = Path(folder) / name
    out.mkdir(parents=True, exist_ok=True)
    engine.save_checkpoint(str(out), tag=TAG, save_latest=False)
    torch.save(capture_rng(), out / f"rng_rank{rank}.pt")


def has_train_state(folder: str | Path) -> bool:
    return (Path(folder) / STATE_DIR / TAG).is_dir()


def newest_with_state(policies: Any) -> Any | None:
    """The newest of ``policies`` (``PolicyRecord``s) whose folder has a training state."""
    for p in sorted(policies, key=lambda p: p.version, reverse=True):
        if has_train_state(p.checkpoint_uri):
            return p
    return None


def load_train_state(engine: Any, folder: str | Path, *, rank: int) -> None:
    """Collective: restore weights, optimiser, scheduler and this rank's RNG from ``folder``."""
    src = Path(folder) / STATE_DIR
    path, _ = engine.load_checkpoint(
        str(src), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        from sandpiper.errors import LearnerError

        raise LearnerError(f"could not load the training state in {src}")
    rng = src / f"rng_rank{rank}.pt"
    if rng.exists():  # absent when the world size changed: this rank starts a fresh stream
        restore_rng(torch.load(rng, weights_only=False))
