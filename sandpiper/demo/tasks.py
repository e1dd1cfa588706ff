"""The demo task suite: arithmetic on large numbers that exist only inside the sandbox.

Each task is a task folder (see :mod:`sandpiper.collector.tasks.loading`)::

    <id>/instruction.md     "Write the sum of the numbers in numbers.txt to answer.txt, then submit."
    <id>/files/numbers.txt  seven random 6-digit integers (never shown to the model)
    <id>/task.toml          reward = "exact", the answer, answer_file = "/workspace/answer.txt"
    <id>/solution/solve.sh  the reference solution (:data:`COMPUTE_COMMAND`; never copied into
                            the sandbox: docs/tasks.md, Reference solutions)

The model cannot know the answer without running code in the sandbox: it has to add the
numbers up with ``python3`` (:data:`COMPUTE_COMMAND`), write the result to ``answer.txt``
and submit. Reward is exact match of the answer file against the reference, so it rises
only when the agent really computes in the sandbox.

The warm start imitates a *weak* demonstrator (:func:`demonstration`): most of its episodes
guess a number (``echo 4182311 > answer.txt``), only ``compute_fraction`` of them compute.
Both are well-formed tool use, so after SFT the tiny model calls its tools correctly but
computes only now and then; GRPO must discover from the rewards that computing pays. (Why
not several operations, sum/max/median named in the instruction? The tiny model, trained
from scratch, does not learn to copy the operation's name from the instruction into its
command within the demo's minutes: measured at chance level after 400 SFT steps.)
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

ANSWER_FILE = "/workspace/answer.txt"

INSTRUCTION = "Write the sum of the numbers in numbers.txt to answer.txt, then submit."

COMPUTE_COMMAND = (
    "python3 -c 'import sys; print(sum(map(int, sys.stdin)))' < numbers.txt > answer.txt"
)
"""The shell command that solves every demo task (no double quotes: no JSON escapes)."""

SYSTEM_PROMPT = "Use the sandbox to compute, then submit the answer."
"""System prompt of the demo (the chat template adds the tool schemas after it)."""

COMPUTE_FRACTION = 0.3
"""Share of the weak teacher's demonstrations that compute (the rest guess)."""

DEMO_TOOLS = ("execute_bash", "submit")
"""Tools offered in the demo: a short tool list keeps the prompt short for the tiny model."""


def guess_command(rng: random.Random) -> str:
    """A guess of the weak demonstrator: a number of the right size, almost surely wrong."""
    return f"echo {rng.randint(1_000_000, 6_999_999)} > answer.txt"


@dataclass(frozen=True, slots=True)
class DemoTask:
    task_id: str
    numbers: tuple[int, ...]
    answer: str


def make_tasks(n_tasks: int, *, seed: int = 0) -> list[DemoTask]:
    """``n_tasks`` tasks with different numbers, deterministic for a seed."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n_tasks):
        numbers = tuple(rng.randint(100_000, 999_999) for _ in range(7))
        tasks.append(DemoTask(f"demo-{i:04d}", numbers, str(sum(numbers))))
    return tasks


def write_demo_tasks(out_dir: str | Path, n_tasks: int = 60, *, seed: int = 0) -> Path:
    """Write the task folders under ``out_dir`` (idempotent) and return ``out_dir``."""
    root = Path(out_dir)
    for task in make_tasks(n_tasks, seed=seed):
        folder = root / task.task_id
        (folder / "files").mkdir(parents=True, exist_ok=True)
        (folder / "instruction.md").write_text(INSTRUCTION + "\n")
        (folder / "files" / "numbers.txt").write_text("\n".join(map(str, task.numbers)) + "\n")
        (folder / "task.toml").write_text(
            f'reward = "exact"\nanswer = {json.dumps(task.answer)}\n'
            f'answer_file = "{ANSWER_FILE}"\nsplit = "train"\n'
        )
        (folder / "solution").mkdir(exist_ok=True)
        (folder / "solution" / "solve.sh").write_text(COMPUTE_COMMAND + "\n")
    return root


def demonstration(
    *, compute: bool, rng: random.Random, compute_command: str = COMPUTE_COMMAND
) -> list[tuple[str, dict[str, str]]]:
    """The tool calls of one demonstration, turn by turn: (tool name, arguments).

    ``compute`` runs ``compute_command`` (reward 1); otherwise the answer is a guess
    (reward 0 but for a one-in-millions hit)."""
    command = compute_command if compute else guess_command(rng)
    return [("execute_bash", {"command": command}), ("submit", {})]
