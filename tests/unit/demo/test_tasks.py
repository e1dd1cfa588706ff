"""The demo task suite: solvable only by computing in the sandbox, loadable by the collector."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

from sandpiper.collector.rewards.compute import compute_reward
from sandpiper.collector.tasks.loading import load_tasks
from sandpiper.demo.tasks import (
    COMPUTE_COMMAND,
    INSTRUCTION,
    demonstration,
    make_tasks,
    write_demo_tasks,
)


def test_tasks_are_deterministic_and_differ_in_their_numbers() -> None:
    assert make_tasks(12, seed=3) == make_tasks(12, seed=3)
    assert make_tasks(12, seed=3) != make_tasks(12, seed=4)
    assert len({t.answer for t in make_tasks(12)}) == 12


def test_the_compute_command_writes_the_reference_answer(tmp_path: Path) -> None:
    write_demo_tasks(tmp_path, 3, seed=1)
    for task in make_tasks(3, seed=1):
        files = tmp_path / task.task_id / "files"
        shell = COMPUTE_COMMAND.replace("python3", sys.executable)
        subprocess.run(shell, shell=True, cwd=files, check=True)
        assert (files / "answer.txt").read_text().strip() == task.answer


def test_collector_loads_the_suite_with_exact_rewards(tmp_path: Path) -> None:
    write_demo_tasks(tmp_path, 12)
    tasks = load_tasks(tmp_path)
    assert len(tasks) == 12
    by_id = {t.task_id: t for t in make_tasks(12)}
    for task in tasks:
        assert task.instruction.strip() == INSTRUCTION
        answer = by_id[task.task_id].answer
        assert compute_reward(task.reference, answer=answer).reward == 1.0
        assert compute_reward(task.reference, answer=str(int(answer) + 1)).reward == 0.0


def test_demonstrations_compute_or_guess_then_submit() -> None:
    rng = random.Random(0)
    computed = demonstration(compute=True, rng=rng)
    guessed = demonstration(compute=False, rng=rng)
    assert (
        [name for name, _ in computed]
        == [name for name, _ in guessed]
        == ["execute_bash", "submit"]
    )
    assert computed[0][1]["command"] == COMPUTE_COMMAND
    assert guessed[0][1]["command"].startswith("echo ")
    assert guessed[0][1]["command"].endswith(" > answer.txt")
