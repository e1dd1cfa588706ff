"""reasoning-gym datasets by name: ``sandpiper tasks import reasoning-gym:NAME[,NAME…]``.

Each item becomes a prompt row whose reward is the dataset's own ``score_answer``
(:mod:`sandpiper.collector.rewards.reasoning_gym_scores`, kind ``reasoning_gym``): the row
keeps the dataset's name, the config it was built with (``seed`` and ``size`` included) and
the item's index, and the reward worker builds the item again to score it.

Splits. reasoning-gym seeds item ``i`` of a dataset built with ``seed`` with ``seed + i``, so
two datasets whose seeds are close share items. The training items are ``seed … seed+size-1``;
the held-out items (``validation_size``) start at ``seed + size``, a range that never meets
the training one; a held-out item whose question is also a training question (families
with few distinct items) is dropped and counted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sandpiper.errors import TaskError

PREFIX = "reasoning-gym:"
ANSWER_FILE = "/workspace/answer.txt"
INSTRUCTION = """{question}

When you are done, call `submit` with your final answer as `answer` (or write it to
{answer_file} and call `submit`). Only the answer itself is scored.
"""


@dataclass(frozen=True)
class ReasoningGymSpec:
    """What ``reasoning-gym:NAMES --size --seed --config --validation-size`` asks for."""

    names: tuple[str, ...]
    size: int = 100
    seed: int = 0
    validation_size: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    """``KEY`` for every dataset, ``NAME.KEY`` for one."""

    @classmethod
    def parse(
        cls, source: str, *, size: int, seed: int, validation_size: int = 0,
        config: list[str] | tuple[str, ...] = (),
    ) -> ReasoningGymSpec:  # fmt: skip
        names = tuple(n.strip() for n in source[len(PREFIX) :].split(",") if n.strip())
        if not names:
            raise TaskError(f"{source}: name at least one dataset (reasoning-gym:NAME[,NAME…])")
        if size < 1 or validation_size < 0 or seed < 0:
            raise TaskError("--size must be at least 1, --validation-size and --seed at least 0")
        parsed: dict[str, Any] = {}
        for item in config:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise TaskError(f"--config {item!r}: expected KEY=VALUE")
            try:
                parsed[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                parsed[key.strip()] = value  # plain text
        return cls(names, size, seed, validation_size, parsed)

    def config_of(self, name: str, *, seed: int, size: int) -> dict[str, Any]:
        own = {k: v for k, v in self.config.items() if "." not in k}
        own |= {k.split(".", 1)[1]: v for k, v in self.config.items() if k.startswith(name + ".")}
        return own | {"seed": seed, "size": size}


def is_source(source: object) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def rows(spec: ReasoningGymSpec) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, prompt row) of every training and held-out item; raises ``TaskError`` for a
    name the installed reasoning-gym does not register or a config it refuses."""
    for name in spec.names:
        config = spec.config_of(name, seed=spec.seed, size=spec.size)
        train = _dataset(name, config)
        questions = set()
        for i in range(spec.size):
            item = train[i]
            questions.add(item["question"])
            yield f"{PREFIX}{name}[{i}]", _row(name, config, i, item, "train")
        if spec.validation_size:
            held_out = spec.config_of(name, seed=spec.seed + spec.size, size=spec.validation_size)
            val = _dataset(name, held_out)
            for i in range(spec.validation_size):
                item = val[i]
                if item["question"] not in questions:
                    yield f"{PREFIX}{name}[validation {i}]", _row(name, held_out, i, item,
                                                                  "validation")  # fmt: skip


def _dataset(name: str, config: dict[str, Any]) -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise TaskError(
            "reasoning-gym is not installed: pip install 'sandpiper[families]'"
        ) from None
    if name not in reasoning_gym.factory.DATASETS:
        known = ", ".join(sorted(reasoning_gym.factory.DATASETS))
        raise TaskError(f"reasoning-gym has no dataset {name!r}; it registers: {known}")
    try:
        ds = reasoning_gym.create_dataset(name, **config)
    except Exception as e:
        raise TaskError(f"reasoning-gym {name} refused config {config}: {e}") from None
    from sandpiper.collector.rewards import answer_gate

    try:
        answer_gate.check_family(name, type(ds))
    except answer_gate.UnsafeFamily as e:
        raise TaskError(str(e)) from None
    return ds


def _row(
    name: str, config: dict[str, Any], index: int, item: dict[str, Any], split: str
) -> dict[str, Any]:
    seed, size = config["seed"], config["size"]
    return {
        "id": f"rg-{name.replace('_', '-')}-s{seed}-n{size}-{index}",
        "prompt": INSTRUCTION.format(question=item["question"], answer_file=ANSWER_FILE),
        "reward": "reasoning_gym",
        "dataset": name,
        "config": config,
        "index": index,
        "answer": None if item.get("answer") is None else str(item["answer"]),
        "answer_file": ANSWER_FILE,
        "split": split,
    }
