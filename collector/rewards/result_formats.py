"""The reward of a test run, read in the format the task declares (never sniffed).

A task's tests report their result in one declared format (``result_format`` in
``task.toml``; the default is ``result_file``):

- ``result_file``: the tests write one JSON object to ``$SANDPIPER_RESULT_FILE``, a file in a
  folder of the grader's uid that no agent process can reach: ``{"reward": 0.75}`` or
  ``{"passed": 3, "total": 4}`` (other fields are kept in the details). No file, a link, a
  non-object or a non-finite number → reward 0.
- ``tagged_line``: the tests print ``SANDPIPER_RESULT <tag> {json}`` where ``<tag>`` is
  ``$SANDPIPER_RESULT_TAG``, a secret drawn per episode; the last line with the right tag
  counts. Anything the code under test prints without the tag is ignored.
- ``reward_file``: the tests write a number to a path the task format names (open-instruct:
  ``/logs/verifier/reward.txt``); the grader empties that folder before the tests run and
  only the tests' uid can write it. The whole file must be one number (``"1\\n"``, ``" 0.5 "``;
  ``"1 passed"`` is not), clamped to [0, 1] as open-instruct does; anything else → 0.
- ``exit_status``: 0 → 1.0, anything else → 0.0. Only for tasks that declare it: any code
  that can end the test process early (``os._exit(0)`` at import) can forge it.

What the tests print otherwise (``99 passed``, a ``{"reward": 1}`` line) never counts.
"""

from __future__ import annotations

import json
import math
from typing import Any

RESULT_FORMATS = ("result_file", "tagged_line", "reward_file", "exit_status")
DEFAULT_RESULT_FORMAT = "result_file"
TAG_PREFIX = "SANDPIPER_RESULT"


def reward_from_result(
    result_format: str,
    *,
    result_text: str | None,
    stdout: str,
    exit_code: int | None,
    secret: str,
    result_error: str | None = None,
) -> tuple[float, dict[str, Any]]:
    """(reward, details) of a test run in the task's declared ``result_format``."""
    if result_format == "result_file":
        if result_text is None:
            return 0.0, {"format": result_format, "error": result_error or "no result file"}
        return _from_json(result_text, result_format)
    if result_format == "tagged_line":
        prefix = f"{TAG_PREFIX} {secret} "
        lines = [line for line in stdout.splitlines() if secret and line.startswith(prefix)]
        if not lines:
            return 0.0, {"format": result_format, "error": "no tagged result line"}
        return _from_json(lines[-1][len(prefix) :], result_format)
    if result_format == "reward_file":
        if result_text is None:
            return 0.0, {"format": result_format, "error": result_error or "no reward file"}
        try:  # the whole file is one number, as open-instruct's float(text.strip()) reads it
            value = float(result_text.strip())
        except ValueError:
            return 0.0, {"format": result_format, "error": "the reward file is not one number"}
        if not math.isfinite(value):
            return 0.0, {"format": result_format, "error": "the reward is not finite"}
        return max(0.0, min(1.0, value)), {"format": result_format, "raw": result_text[:64]}
    if result_format == "exit_status":
        return (1.0 if exit_code == 0 else 0.0), {"format": result_format}
    raise ValueError(f"unknown result format {result_format!r}; expected one of {RESULT_FORMATS}")


def _from_json(text: str, result_format: str) -> tuple[float, dict[str, Any]]:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's stack
        return 0.0, {"format": result_format, "error": "the result is not JSON"}
    if not isinstance(obj, dict):
        return 0.0, {"format": result_format, "error": "the result is not a JSON object"}
    details = {"format": result_format, **{k: v for k, v in obj.items() if k != "reward"}}
    reward = obj.get("reward")
    if reward is None and _count(obj.get("passed")) and _count(obj.get("total")):
        total = obj["total"]
        reward = min(obj["passed"] / total, 1.0) if total else 0.0
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        return 0.0, {**details, "error": "no finite reward (or passed/total) in the result"}
    return float(reward), details


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
