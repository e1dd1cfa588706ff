"""The demo task suite: solvable only by computing in the sandbox, loadable by the collector."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from collector.demo_tasks import (
    OPERATIONS,
    command,
    demonstration,
    make_tasks,
    write_demo_tasks,
)
from collector.rewards import compute_reward
from collector.tasks import load_tasks


def test_tasks_are_deterministic_and_cover_every_operation() -> None:
    assert make_tasks(12, seed=3) == make_tasks(12, seed=3)
    assert make_tasks(12, seed=3) != make_tasks(12, seed=4)
    assert {t.op for t in make_tasks(12)} == set(OPERATIONS)


@pytest.mark.parametrize("task", make_tasks(len(OPERATIONS), seed=1), ids=lambda t: t.op)
def test_the_calculator_in_the_task_folder_computes_the_reference(task, tmp_path: Path) -> None:
    write_demo_tasks(tmp_path, len(OPERATIONS), seed=1)
    files = tmp_path / task.task_id / "files"
    shell = command(task.op).replace("python3", sys.executable)
    subprocess.run(shell, shell=True, cwd=files, check=True)
    assert (files / "answer.txt").read_text().strip() == task.answer


def test_collector_loads_the_suite_with_exact_rewards(tmp_path: Path) -> None:
    write_demo_tasks(tmp_path, 12)
    tasks = load_tasks(tmp_path)
    assert len(tasks) == 12
    by_id = {t.task_id: t for t in make_tasks(12)}
    for task in tasks:
        demo = by_id[task.task_id]
        assert demo.op in task.instruction
        assert compute_reward(task.reference, answer=demo.answer).reward == 1.0
        assert compute_reward(task.reference, answer="0").reward == 0.0


def test_demonstration_runs_the_named_operation_then_submits() -> None:
    calls = demonstration("median")
    assert [name for name, _ in calls] == ["execute_bash", "submit"]
    assert "median" in calls[0][1]["command"]
