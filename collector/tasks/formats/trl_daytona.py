"""TRL + Daytona code tasks (``trl`` example "RL rollouts on sandboxes", Daytona guide).

The peer's task is a dict: ``prompt`` (the function's signature and docstring, to be
completed), ``func_name``, ``banned_patterns`` (plain substrings, matched case-insensitively:
``p.lower() in text.lower()``), ``tests`` (Python expressions giving each test input) and
``reference`` (an expression naming the reference function, e.g. ``sorted``). Its reward:
**-1** for an error, a timeout or a banned pattern; otherwise the fraction of tests whose
output equals the reference's (0 when there are no tests). As in the peer's harness, the
tests and the reference are evaluated in the solution's module namespace beside ``json``,
``random`` (seeded with 0) and ``_kadane`` (the reference its ``max_subarray`` task names); a
call that raises fails that test only (0 for it, not -1); and the tests are one
parenthesised expression, so a single test is the list itself, not a one-test tuple.

Here the agent writes the prompt and the body it adds to ``/workspace/solution.py`` and
submits; at submit a harness (in the task's ``tests/``) keeps the body as the peer's
sanitiser does (the indented lines after the prompt), checks the banned substrings in it,
runs the tests against the reference exactly as the peer's harness does
(``random.seed(0)``, ``xs.copy()``), and writes the reward to ``$SANDPIPER_RESULT_FILE``
(``result_file`` format). Known limit (docs/security.md): the harness runs the solution in
its own process, as the peer does, so solution code can overwrite that file; a task that
must resist it runs the solution through ``subject_command`` instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sandpiper.collector.tasks.model import missing_field
from sandpiper.errors import TaskError

FIELDS = ("prompt", "func_name", "banned_patterns", "tests", "reference")
SOLUTION = "/workspace/solution.py"
TIMEOUT_S = 5
"""The harness's own limit on running the solution and its tests (the peer uses 1 s on
Daytona; a cold Python in a loaded container needs more): past it the reward is -1."""

INSTRUCTION = """Complete the Python function below. Write the code below to {solution} \
unchanged, followed by the function's body (indented four spaces), then call `submit`.

```python
{prompt}
```
"""

_HARNESS = r'''"""Grades /workspace/solution.py as the TRL + Daytona example does (written by Sandpiper)."""
import json
import os
import random
import signal

SPEC = json.load(open(os.path.join(os.path.dirname(__file__), "task.json")))


RESULT = os.environ.get("SANDPIPER_RESULT_FILE")


def emit(result):
    """The result goes where only the grader's uid writes (collector/rewards/result_formats.py)."""
    with open(RESULT, "w") as f:
        json.dump(result, f)


def fail(why):
    emit({"reward": -1.0, "error": why})
    os._exit(0)  # not SystemExit: the solution's code could catch that


try:
    source = open(SPEC["solution"]).read()
except OSError as e:
    fail(f"no solution: {e}")
prompt = SPEC["prompt"]
if source.startswith(prompt):
    # The peer's completion setting: the body follows the prompt; like its sanitiser, keep
    # the lines up to the first unindented one, and grade prompt + "\n" + body.
    kept = []
    for line in source[len(prompt):].splitlines():
        if line and not line.startswith("    "):
            break
        kept.append(line)
    added = "\n".join(kept).rstrip()
    source = prompt + "\n" + added
else:  # written its own way: banned patterns are looked for in the lines not in the prompt
    given = {line.strip() for line in prompt.splitlines()}
    added = "\n".join(line for line in source.splitlines() if line.strip() not in given)
if not added.strip():
    fail("empty solution")
lowered = added.lower()
hits = [p for p in SPEC["banned_patterns"] if p.lower() in lowered]
if hits:
    fail(f"banned patterns: {hits}")
# The peer gives the whole run a timeout and scores it -1.
signal.signal(signal.SIGALRM, lambda *_: fail(f"timed out after {SPEC['timeout_s']} s"))
signal.alarm(SPEC["timeout_s"])
# The peer runs prompt + completion + its harness as one __main__ module: the tests and the
# reference are evaluated in the solution's namespace, after the harness's own names
# (json, random seeded with 0, and the _kadane reference of its max_subarray task).
namespace = {"__name__": "__main__"}
try:
    exec(compile(source, SPEC["solution"], "exec"), namespace)
except BaseException as e:  # an error at module level: the peer's run reports an error
    fail(f"{type(e).__name__}: {e}")


def _kadane(xs):
    best = current = xs[0]
    for x in xs[1:]:
        current = max(x, current + x)
        best = max(best, current)
    return best


namespace.update(json=json, random=random, _kadane=_kadane)
random.seed(0)
try:  # the peer's tests are one parenthesised expression, so one test is not a tuple
    tests = eval("(" + ",\n".join(SPEC["tests"]) + ")", namespace)
    results = []
    for xs in tests:
        try:
            out = eval(SPEC["func_name"], namespace)(xs.copy())
            results.append(out == eval(SPEC["reference"], namespace)(xs.copy()))
        except Exception:
            results.append(False)
except BaseException as e:
    fail(f"{type(e).__name__}: {e}")
signal.alarm(0)
passed = sum(bool(r) for r in results)
emit({"reward": passed / len(results) if results else 0.0, "passed": passed, "total": len(results)})
'''


def is_row(row: dict[str, Any]) -> bool:
    return "func_name" in row and "tests" in row


def write_task(row: dict[str, Any], folder: Path, where: str) -> dict[str, Any]:
    """Write the task folder for one row; returns the ``task.toml`` data."""
    for name in FIELDS:
        if name not in row:
            raise TaskError(missing_field(where, f"field {name!r}", (name,), row))
    prompt, func_name = row["prompt"], row["func_name"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise TaskError(f"{where}: field 'prompt' must be the function's code to complete")
    if not isinstance(func_name, str) or not func_name.isidentifier():
        raise TaskError(f"{where}: field 'func_name' must be a Python identifier")
    banned = row["banned_patterns"] or []
    if not isinstance(banned, list) or not all(isinstance(p, str) for p in banned):
        raise TaskError(f"{where}: field 'banned_patterns' must be a list of strings")
    tests = row["tests"]
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise TaskError(f"{where}: field 'tests' must be a list of Python expressions")
    for i, test in enumerate(tests, 1):
        try:
            compile(test, f"test {i}", "eval")
        except SyntaxError as e:
            raise TaskError(f"{where}: test {i} is not a Python expression: {e.msg}") from None
    if not isinstance(row["reference"], str) or not row["reference"].strip():
        raise TaskError(f"{where}: field 'reference' must name the reference function")
    spec = {
        "prompt": prompt, "func_name": func_name, "banned_patterns": banned, "tests": tests,
        "reference": row["reference"], "solution": SOLUTION, "timeout_s": TIMEOUT_S,
    }  # fmt: skip
    (folder / "tests").mkdir(parents=True)
    (folder / "tests" / "task.json").write_text(json.dumps(spec, indent=1))
    (folder / "tests" / "harness.py").write_text(_HARNESS)
    (folder / "tests" / "run.sh").write_text('exec python3 "$TESTS_DIR/harness.py"\n')
    (folder / "instruction.md").write_text(INSTRUCTION.format(solution=SOLUTION, prompt=prompt))
    return {"reward": "tests", "format": "trl_daytona", "result_format": "result_file"}
