"""The demo task suite: statistics over numbers that exist only inside the sandbox.

Each task is a task folder (see :mod:`collector.tasks`)::

    <id>/instruction.md     "Write the median of the numbers in numbers.txt to answer.txt, then submit."
    <id>/files/numbers.txt  seven random 6-digit integers (never shown to the model)
    <id>/files/calc.py      a small calculator: `python3 calc.py OP FILE`
    <id>/task.toml          reward = "exact", the answer, answer_file = "/workspace/answer.txt"

The model cannot know the answer without running code in the sandbox: it has to run the
calculator with the operation the instruction names, redirect the result into
``answer.txt`` and submit. That is short enough for a ~1.4 M-parameter model to learn on
CPU in minutes: choosing the operation from the instruction is the skill GRPO improves after
a brief SFT warm start on :func:`demonstration` episodes. Reward is exact match of the
answer file against the reference, so the reward rises only when the agent really computes
the right statistic in the sandbox.
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

OPERATIONS = ("sum", "product", "max", "min", "mean", "median")
"""Operations the instructions name; each is one argument of calc.py."""

CALC_PY = '''\
"""Usage: python3 calc.py OP FILE  (OP: sum, product, max, min, mean, median)."""
import math
import statistics
import sys

OPS = {
    "sum": sum,
    "product": math.prod,
    "max": max,
    "min": min,
    "mean": lambda xs: round(statistics.mean(xs), 2),
    "median": statistics.median,
}
op, path = sys.argv[1], sys.argv[2]
numbers = [int(x) for x in open(path).read().split()]
print(OPS[op](numbers))
'''

ANSWER_FILE = "/workspace/answer.txt"

SYSTEM_PROMPT = "Use the sandbox to compute, then submit the answer."
"""System prompt of the demo (the chat template adds the tool schemas after it)."""

DEMO_TOOLS = ("execute_bash", "submit")
"""Tools offered in the demo: a short tool list keeps the prompt short for the tiny model."""


def _answer(op: str, numbers: list[int]) -> str:
    if op == "mean":
        return str(round(statistics.mean(numbers), 2))
    if op == "product":
        value = 1
        for x in numbers:
            value *= x
        return str(value)
    if op == "median":
        return str(statistics.median(numbers))
    if op == "sum":
        return str(sum(numbers))
    return str(max(numbers) if op == "max" else min(numbers))


def instruction(op: str) -> str:
    return f"Write the {op} of the numbers in numbers.txt to answer.txt, then submit."


def command(op: str) -> str:
    """The shell command that solves a task asking for ``op``."""
    return f"python3 calc.py {op} numbers.txt > answer.txt"


@dataclass(frozen=True, slots=True)
class DemoTask:
    task_id: str
    op: str
    numbers: tuple[int, ...]
    answer: str


def make_tasks(n_tasks: int, *, seed: int = 0) -> list[DemoTask]:
    """``n_tasks`` tasks cycling through the operations, deterministic for a seed."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n_tasks):
        op = OPERATIONS[i % len(OPERATIONS)]
        numbers = [rng.randint(100_000, 999_999) for _ in range(7)]
        tasks.append(DemoTask(f"demo-{i:04d}-{op}", op, tuple(numbers), _answer(op, numbers)))
    return tasks


def write_demo_tasks(out_dir: str | Path, n_tasks: int = 60, *, seed: int = 0) -> Path:
    """Write the task folders under ``out_dir`` (idempotent) and return ``out_dir``."""
    root = Path(out_dir)
    for task in make_tasks(n_tasks, seed=seed):
        folder = root / task.task_id
        (folder / "files").mkdir(parents=True, exist_ok=True)
        (folder / "instruction.md").write_text(instruction(task.op) + "\n")
        (folder / "files" / "numbers.txt").write_text("\n".join(map(str, task.numbers)) + "\n")
        (folder / "files" / "calc.py").write_text(CALC_PY)
        (folder / "task.toml").write_text(
            f'reward = "exact"\nanswer = {json.dumps(task.answer)}\n'
            f'answer_file = "{ANSWER_FILE}"\nsplit = "train"\n'
        )
    return root


def demonstration(op: str) -> list[tuple[str, dict[str, str]]]:
    """The tool calls of a correct episode, turn by turn: (tool name, arguments)."""
    return [("execute_bash", {"command": command(op)}), ("submit", {})]
