"""Aviato's TRL GRPO rows (``examples/rl_training/trl_grpo_integration.py``), as Aviato writes them.

A row is ``{"prompt": [system message, user message], "expected_output": "5"}``. The peer's
reward runs the code between the last ``<answer>`` and the following ``</answer>`` of the
completion with ``python -c`` in a fresh sandbox: **1.0 when it exits 0** within 10 s, else
0.0; no ``<answer>`` tag (or empty code) is 0.0. ``expected_output`` is not read by the
peer's reward, so it is not scored here either (it is kept in ``task.toml``).

Here the completion is the answer the agent passes to ``submit`` (the instruction says so);
at submit a harness in the task's ``tests/`` extracts the code from ``$ANSWER_FILE`` exactly
as the peer does and runs it with ``python3 -c`` in the sandbox. Known limit, as for the TRL
+ Daytona rows (docs/security.md): the code runs under the tests' uid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sandpiper.collector.tasks.model import ANSWER_KEYS, row_prompt
from sandpiper.errors import TaskError

TIMEOUT_S = 10
"""The peer's ``EXECUTION_TIMEOUT_SECONDS``."""

SUBMIT_NOTE = """

When you are done, call the `submit` tool with your final answer as `answer`, the code inside \
<answer> tags as instructed."""

_HARNESS = r'''"""Scores the submitted answer as Aviato's TRL example does (written by Sandpiper)."""
import json
import os
import subprocess
import tempfile

text = open(os.environ["ANSWER_FILE"], encoding="utf-8", errors="replace").read()
code = text.split("<answer>")[-1].split("</answer>")[0].strip() if "<answer>" in text else ""
if not code:
    result = {"reward": 0.0, "error": "no code inside <answer> tags"}
else:
    with tempfile.TemporaryDirectory() as work:
        try:
            run = subprocess.run(
                ["python3", "-c", code], capture_output=True, timeout=TIMEOUT_S,
                cwd=work, stdin=subprocess.DEVNULL,
            )
            result = {"reward": 1.0 if run.returncode == 0 else 0.0, "returncode": run.returncode}
        except subprocess.TimeoutExpired:
            result = {"reward": 0.0, "error": f"timed out after {TIMEOUT_S} s"}
with open(os.environ["SANDPIPER_RESULT_FILE"], "w") as f:
    json.dump(result, f)
'''


def is_row(row: dict[str, Any]) -> bool:
    """A chat-message prompt with ``expected_output`` and no answer field of its own."""
    return (
        isinstance(row.get("prompt"), list)
        and "expected_output" in row
        and not any(row.get(k) is not None for k in ANSWER_KEYS)
    )


def write_task(row: dict[str, Any], folder: Path, where: str) -> tuple[dict[str, Any], str | None]:
    """Write the task folder of one row; returns (``task.toml`` data, system prompt)."""
    instruction, system = row_prompt(row, where)
    expected = row["expected_output"]
    if expected is not None and not isinstance(expected, str | int | float):
        raise TaskError(f"{where}: field 'expected_output' must be text, got {expected!r}")
    (folder / "tests").mkdir(parents=True)
    harness = _HARNESS.replace("TIMEOUT_S", str(TIMEOUT_S))
    (folder / "tests" / "harness.py").write_text(harness)
    (folder / "tests" / "run.sh").write_text('exec python3 "$TESTS_DIR/harness.py"\n')
    (folder / "instruction.md").write_text(instruction + SUBMIT_NOTE)
    meta = {"reward": "tests", "format": "aviato", "result_format": "result_file"}
    if expected is not None:
        meta["expected_output"] = str(expected)
    return meta, system
