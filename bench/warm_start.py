"""The scripted teacher's warm start, shared by bench/learns_bench.py and bench/race_bench.py.

A model that makes no tool calls of its own (SmolLM2-135M) earns no reward, so neither GRPO
nor TRL has a signal to follow. Both benches start it the way the demo starts the tiny
model: the demo's weak teacher (:class:`sandpiper.demo.run.Demonstrator`) plays one episode
per training task through the real collector (sandboxes, tools, the task's reward),
computing in ``COMPUTE_FRACTION`` of them and guessing in the rest, then ``sandpiper learn
--algo sft`` imitates all of them. The prompts it stores are the ones the run's config
renders (its tools, tool format, system prompt and the model folder's chat template), so the
model learns the very prompt it later trains on.

:data:`TEACHERS` holds the task families the teacher knows besides the demo's own sum.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from race_suites import PEER_COMPUTE_COMMAND, PEER_PROBLEM, task_ids

from sandpiper.errors import SandpiperError


@dataclass(frozen=True, slots=True)
class Teacher:
    """A task family and how the scripted teacher solves its items."""

    name: str
    description: str
    instruction: str
    """Text every prompt of the family holds: the teacher refuses any other prompt."""
    compute_command: str | Callable[[str], str]
    """The shell command that solves an item (or builds it from the prompt's text)."""
    shared_field: str
    """What train and held-out tasks must not share: ``answer`` or ``prompt``."""


PRODUCTS_QUESTION = re.compile(r"Solve the following multiplication: ([0-9][0-9 *]*)\. Give")
"""reasoning-gym ``products`` (0.1.25): "Solve the following multiplication: 1663 * 5242.
Give only the result as your final answer." (no negation in its default config)."""


def products_command(prompt: str) -> str:
    """The teacher's computation for a ``products`` item: the question's product in python."""
    match = PRODUCTS_QUESTION.search(prompt)
    if match is None:
        raise SandpiperError("no reasoning-gym products question in the prompt")
    return f"python3 -c 'print({match.group(1)})' > answer.txt"


TEACHERS = {
    "peer": Teacher("peer", "peer (LLM-in-Sandbox-RL rows, sum of numbers.txt)", PEER_PROBLEM,
                    PEER_COMPUTE_COMMAND, "answer"),
    "reasoning-gym:products": Teacher(
        "reasoning-gym:products",
        "reasoning-gym products 0.1.25 (default config: two factors of 1-5 digits), "
        "scored by its own score_answer",
        "Solve the following multiplication:", products_command, "prompt"),
}  # fmt: skip


def sft_warm_start(
    cfg: Any,
    *,
    sft_learner: dict[str, Any],
    log_path: Path,
    instruction: str | None = None,
    compute_command: str | Callable[[str], str] | None = None,
) -> str:
    """The teacher's episodes on ``cfg.collector.tasks`` (one each, into ``cfg``'s store),
    then ``sandpiper learn --algo sft`` with ``sft_learner`` (the demo model's SFT settings);
    returns the SFT checkpoint. ``cfg`` is the run's own config with ``learner.model`` the
    model to warm-start: its renderer writes the prompts the SFT learns. ``instruction`` /
    ``compute_command``: the family (default: the demo's sum). ``cfg``'s run folder is
    emptied first (a half-made warm start is made again, not added to)."""
    from sandpiper.demo import run as demo
    from sandpiper.demo.tasks import COMPUTE_FRACTION

    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    n = len(task_ids(Path(cfg.collector.tasks)))
    cfg.collector.group_size, cfg.collector.max_groups = 1, n
    cfg.collector.max_unconsumed_groups = n
    cfg.learner.algo, cfg.learner.checkpoint_retention = "sft", True
    for key, value in sft_learner.items():
        setattr(cfg.learner, key, value)
    family: dict[str, Any] = {}
    if instruction is not None:
        family["instruction"] = instruction
    if compute_command is not None:
        family["compute_command"] = compute_command
    demo.collect_demonstrations(cfg, compute_fraction=COMPUTE_FRACTION, **family)
    return demo.run_sft(cfg, log_path)


def teacher_record(store_url: str, run_id: str) -> dict[str, Any]:
    """What the teacher did in the warm start's run: episodes and how many earned 1."""
    from sandpiper.analysis import api
    from sandpiper.demo.tasks import COMPUTE_FRACTION

    demos = api.episodes(store_url, run_id=run_id)
    rewards = demos["reward"].to_list()
    return {
        "teacher_episodes": demos.height,
        "teacher_passes": sum(r is not None and r >= 1.0 for r in rewards),
        "teacher_compute_fraction": COMPUTE_FRACTION,
    }
