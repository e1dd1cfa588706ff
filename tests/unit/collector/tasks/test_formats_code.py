"""Code-task rows written exactly as each peer writes them, graded by the task's own harness
and compared with the peer's reward for the same completion: TRL + Daytona (the example's own
TASKS) and Aviato's TRL GRPO rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandpiper.collector.tasks.importer import import_tasks
from sandpiper.errors import TaskError

# ---- TRL + Daytona -------------------------------------------------------------------------

TRL_TASK = {
    "id": "sorting",
    "prompt": 'def sort_numbers(xs: list[int]) -> list[int]:\n    """Sort a list of integers."""\n',
    "func_name": "sort_numbers",
    "banned_patterns": ["sorted(", ".sort(", "heapq", "import ", "__import__"],
    "tests": ["[]", "[1, 3, 2]", "[random.randint(-1000, 1000) for _ in range(200)]"],
    "reference": "sorted",
}
INSERTION_SORT = """    out = []
    for x in xs:
        i = 0
        while i < len(out) and out[i] < x:
            i += 1
        out.insert(i, x)
    return out
"""


def _grade(folder: Path, solution: str, tmp_path: Path) -> dict:
    """Run the task's harness on ``solution`` as submit does (with a local solution path)."""
    spec_file = folder / "tests" / "task.json"
    spec = json.loads(spec_file.read_text())
    path = tmp_path / "solution.py"
    path.write_text(solution)
    spec_file.write_text(json.dumps({**spec, "solution": str(path)}))
    result = tmp_path / "result.json"
    result.unlink(missing_ok=True)
    subprocess.run(
        [sys.executable, str(folder / "tests" / "harness.py")], capture_output=True, text=True,
        env={**os.environ, "SANDPIPER_RESULT_FILE": str(result)},
    )  # fmt: skip
    return json.loads(result.read_text())


def test_trl_daytona_task_rewards_as_trl_does(tmp_path):
    src = tmp_path / "tasks.jsonl"
    src.write_text(json.dumps(TRL_TASK) + "\n")
    (task,) = import_tasks(src, tmp_path / "out")
    assert task.format == "trl_daytona" and task.reference["reward"] == "tests"
    assert "/workspace/solution.py" in task.instruction and TRL_TASK["prompt"] in task.instruction
    folder = tmp_path / "out" / "sorting"
    good = _grade(folder, TRL_TASK["prompt"] + INSERTION_SORT, tmp_path)
    assert good == {"reward": 1.0, "passed": 3, "total": 3}
    banned = _grade(folder, TRL_TASK["prompt"] + "    return SORTED(xs)\n", tmp_path)
    assert banned["reward"] == -1.0 and "banned" in banned["error"]  # literal, any case
    wrong = _grade(folder, TRL_TASK["prompt"] + "    return list(xs)\n", tmp_path)
    assert wrong["reward"] == pytest.approx(1 / 3)  # [] is already sorted
    broken = _grade(folder, TRL_TASK["prompt"] + "    return xs[\n", tmp_path)
    assert broken["reward"] == -1.0


PEER_TASKS = Path(__file__).parents[3] / "fixtures" / "trl_daytona_tasks.jsonl"
"""The example's own ``TASKS`` (daytona guides/python/reinforcement-learning/trl/train.py),
one entry per line, prompts verbatim."""
KADANE = """    best = cur = xs[0]
    for x in xs[1:]:
        cur = x if cur < 0 else cur + x
        best = best if best > cur else cur
    return best
"""
# (task, completion the model adds to the prompt, the peer's reward for it), the rewards
# computed by running the peer's harness and reward_func on the same completion
PEER_TRL_CASES = [
    ("sorting", INSERTION_SORT, 1.0),
    ("sorting", "    return sorted(xs)\n", -1.0),
    ("sorting", "    return list(xs)\n", 0.2),
    ("sorting", "    return xs[\n", -1.0),
    ("sorting", "    xs.Sort()\n    return xs\n", -1.0),  # banned in any case
    ("sorting", "    return xs[::-1]\n", 0.2),
    ("max_subarray", KADANE, 1.0),  # the reference is the harness's own _kadane
    ("max_subarray", "    return max(xs)\n", 3 / 7),
    ("max_subarray", "    return sum(xs)\n", 3 / 7),
    ("max_subarray", "    return helper(xs)\n", 0.0),  # fails inside each test: 0, not -1
    ("max_subarray", "    raise ValueError('no')\n", 0.0),
]


def test_the_peers_own_tasks_score_as_the_peer_scores_them(tmp_path):
    tasks = {t.task_id: t for t in import_tasks(PEER_TASKS, tmp_path / "out")}
    assert sorted(tasks) == ["max_subarray", "sorting"]
    rows = {
        json.loads(line)["name"]: json.loads(line) for line in PEER_TASKS.read_text().splitlines()
    }
    for name, completion, peer in PEER_TRL_CASES:
        got = _grade(tmp_path / "out" / name, rows[name]["prompt"] + completion, tmp_path)
        assert got["reward"] == pytest.approx(peer), (name, completion, got)


def test_the_body_is_kept_as_the_peers_sanitiser_keeps_it(tmp_path):
    """After the prompt, only the indented lines up to the first unindented one are the
    completion (a self-check the agent appends is cut, as the peer cuts it); a file written
    its own way is checked for banned patterns outside the prompt's own lines only."""
    rows = {json.loads(line)["name"]: json.loads(line) for line in PEER_TASKS.read_text().splitlines()}  # fmt: skip
    import_tasks(PEER_TASKS, tmp_path / "out")
    folder, prompt = tmp_path / "out" / "sorting", rows["sorting"]["prompt"]
    appended = prompt + INSERTION_SORT + "\nprint(sort_numbers([2, 1]) == sorted([2, 1]))\n"
    assert _grade(folder, appended, tmp_path)["reward"] == 1.0
    comments, signature = prompt.split("def ", 1)
    own_way = comments.replace("Python.", "Python!") + "def " + signature + INSERTION_SORT
    assert "sorted(" in own_way and not own_way.startswith(prompt)
    assert _grade(folder, own_way, tmp_path)["reward"] == 1.0
    cheat = "def sort_numbers(xs):\n    return sorted(xs)\n"
    assert _grade(folder, cheat, tmp_path)["reward"] == -1.0


def test_one_test_is_not_a_tuple_in_the_peers_harness(tmp_path):
    """The peer writes its tests into ``(t1, t2, ...)``: a single test is the list itself,
    so the loop runs over its numbers and every call fails (the peer's reward: 0)."""
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({**TRL_TASK, "tests": ["[3, 1, 2]"]}) + "\n")
    import_tasks(src, tmp_path / "out")
    got = _grade(tmp_path / "out" / "sorting", TRL_TASK["prompt"] + INSERTION_SORT, tmp_path)
    assert got == {"reward": 0.0, "passed": 0, "total": 3}


def test_trl_row_with_a_bad_test_expression_is_refused(tmp_path):
    src = tmp_path / "tasks.jsonl"
    src.write_text(json.dumps({**TRL_TASK, "tests": ["[1, 2"]}) + "\n")
    with pytest.raises(TaskError, match=r"tasks.jsonl:1: test 1 is not a Python expression"):
        import_tasks(src, tmp_path / "out")


# ---- Aviato's TRL GRPO rows -----------------------------------------------------------------

AVIATO_SYSTEM = """You solve coding problems by writing Python code.
Put your code inside <answer> tags like this: <answer>print("hello")</answer>
Only include the code, no explanations."""


def aviato_row(user: str, expected: str) -> dict:
    """A row of create_toy_dataset() in Aviato's trl_grpo_integration.py."""
    return {
        "prompt": [{"role": "system", "content": AVIATO_SYSTEM}, {"role": "user", "content": user}],
        "expected_output": expected,
    }


# (the submitted completion, the peer's reward: its code in <answer> tags exits 0 → 1.0)
AVIATO_CASES = [
    ("<answer>print(2 + 3)</answer>", 1.0),
    ("Sure!\n<answer>\nprint(2 + 3)\n</answer>\nDone.", 1.0),
    ("<answer>print('six')</answer>", 1.0),  # expected_output is not scored by the peer
    ("<answer>x</answer> then <answer>print(5)</answer>", 1.0),  # the last tag counts
    ("<answer>print(5)", 1.0),  # no closing tag: the rest of the text
    ("print(5)", 0.0),  # no tag
    ("<answer>  </answer>", 0.0),
    ("<answer>raise SystemExit(3)</answer>", 0.0),
    ("<answer>print(</answer>", 0.0),
]


def test_aviato_rows_score_as_the_peer_scores_them(tmp_path):
    src = tmp_path / "aviato.jsonl"
    src.write_text(
        json.dumps(aviato_row("Write code that adds 2 and 3, then prints the result.", "5"))
        + "\n"
        + json.dumps(aviato_row("Write code that prints 'Hello, World!'.", "Hello, World!"))
        + "\n"
    )
    adds, _ = import_tasks(src, tmp_path / "out")
    assert adds.format == "aviato" and adds.system_prompt == AVIATO_SYSTEM
    assert adds.instruction.startswith("Write code that adds 2 and 3, then prints the result.")
    assert "`submit`" in adds.instruction and adds.reference["reward"] == "tests"
    harness = adds.data_dir / "tests" / "harness.py"
    for completion, peer in AVIATO_CASES:
        answer, result = tmp_path / "answer", tmp_path / "result.json"
        answer.write_text(completion)
        result.unlink(missing_ok=True)
        subprocess.run(
            [sys.executable, str(harness)], capture_output=True, check=True,
            env={**os.environ, "ANSWER_FILE": str(answer), "SANDPIPER_RESULT_FILE": str(result)},
        )  # fmt: skip
        assert json.loads(result.read_text())["reward"] == peer, completion


def test_trl_row_missing_a_field_names_the_nearest_one(tmp_path):
    src = tmp_path / "tasks.jsonl"
    row = {k: v for k, v in TRL_TASK.items() if k != "banned_patterns"}
    src.write_text(json.dumps({**row, "banned_pattern": ["sorted("]}) + "\n")
    with pytest.raises(
        TaskError,
        match=r"tasks.jsonl:1: no field 'banned_patterns' .*'banned_pattern': did you mean",
    ):
        import_tasks(src, tmp_path / "out", fmt="trl_daytona")
    assert not (tmp_path / "out").exists()
