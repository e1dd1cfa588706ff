"""reasoning-gym items scored by their dataset's own ``score_answer`` (partial credit kept:
the float the library returns is the reward, untouched).

The item is made again here from the task's ``dataset``, ``config`` and ``index`` (the
library seeds item ``i`` with ``seed + i``), so the scorer sees the entry the library
generated, metadata and all, rather than a JSON copy of it. Datasets are built once per
(name, config) in the reward worker (:mod:`sandpiper.collector.rewards.worker`), which runs
every call under its deadline, memory limit and guard: several families' scorers evaluate
the answer as Python (countdown's ``sympy.parse_expr``, spiral_matrix's ``eval``), so the
answer is model-written code there (docs/security.md, "Scorers that evaluate the answer").
"""

from __future__ import annotations

import contextlib
import json
import math
from functools import lru_cache
from typing import Any

from sandpiper.collector.rewards import answer_gate
from sandpiper.collector.rewards.reference import ReasoningGymReference
from sandpiper.errors import TaskError


class ScorerError(TaskError):
    """The library's scorer failed or returned something that is not a finite score."""


@lru_cache(maxsize=64)
def _dataset(name: str, config_json: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(name, **json.loads(config_json))


def dataset(name: str, config: dict[str, Any]) -> Any:
    """The reasoning-gym dataset ``name`` built with ``config`` (cached)."""
    return _dataset(name, json.dumps(config, sort_keys=True))


def entry(ref: ReasoningGymReference) -> dict[str, Any]:
    """The item the task was made from, generated again."""
    return dataset(ref.dataset, ref.config)[ref.index]


_WARMED: set[tuple[str, str, int]] = set()


def warm(ref: ReasoningGymReference) -> None:
    """Build the item and score its own gold answer and an empty one, so the modules and
    data files the scorer loads lazily are loaded before it reads a model's answer (under
    the worker's guard, new imports and file opens are refused)."""
    key = (ref.dataset, json.dumps(ref.config, sort_keys=True), ref.index)
    if key in _WARMED:
        return
    ds = dataset(ref.dataset, ref.config)
    with contextlib.suppress(answer_gate.UnsafeFamily):  # reads the source; score refuses
        answer_gate.check_family(ref.dataset, type(ds))
    item = ds[ref.index]
    for text in (item.get("answer"), ""):
        with contextlib.suppress(Exception):  # the real call reports it
            ds.score_answer(text, item)
    _WARMED.add(key)


def score(ref: ReasoningGymReference, answer: str | None) -> float:
    """``score_answer(answer, entry)`` of the item's dataset; raises :class:`ScorerError`
    with the error's last line when the scorer raises or returns a non-finite value."""
    ds = dataset(ref.dataset, ref.config)
    try:
        answer_gate.check_family(ref.dataset, type(ds))
    except answer_gate.UnsafeFamily as e:
        raise ScorerError(str(e)) from None
    try:
        item = ds[ref.index]
        if not answer_gate.admitted(ref.dataset, answer, item):
            answer = None  # scored as no answer: the library's score for a wrong one
        value = ds.score_answer(answer, item)
    except Exception as e:
        lines = [line for line in str(e).splitlines() if line.strip()]
        raise ScorerError(f"reasoning-gym {ref.dataset} score_answer raised "
                          f"{type(e).__name__}: {lines[-1][:500] if lines else ''}") from None  # fmt: skip
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise ScorerError(f"reasoning-gym {ref.dataset} score_answer returned {value!r}") from None
    if not math.isfinite(reward):
        raise ScorerError(f"reasoning-gym {ref.dataset} score_answer returned {reward}")
    return reward
