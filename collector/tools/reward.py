"""Parse the reward out of a task's test-script output.

Formats, in order of precedence (the first that applies wins):

1. **JSON line**: a stdout line that is a JSON object with a numeric ``"reward"``, e.g.
   ``{"reward": 0.75, "passed": 3, "total": 4}``. The last such line counts; the reward is
   used as given (other fields are kept in the details).
2. **pytest summary**: ``N passed`` with optional ``M failed`` / ``K error(s)`` on one line,
   e.g. ``=== 3 passed, 1 failed in 0.12s ===`` → 3 / (3 + 1 + 0).
3. **pass fraction**: ``N/M`` or ``N / M`` next to the word passed, e.g. ``passed 3/4`` or
   ``3 / 4 tests passed`` → 3 / 4 (M = 0 gives 0.0).
4. **exit status**: 0 → 1.0, anything else → 0.0.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_PYTEST_PASSED = re.compile(r"\b(\d+) passed\b")
_PYTEST_FAILED = re.compile(r"\b(\d+) failed\b")
_PYTEST_ERRORS = re.compile(r"\b(\d+) errors?\b")
_FRACTION = re.compile(
    r"passed\W{0,3}(\d+)\s*/\s*(\d+)|(\d+)\s*/\s*(\d+)\s+(?:tests?\s+)?passed", re.IGNORECASE
)


def parse_reward(stdout: str, exit_code: int | None) -> tuple[float, dict[str, Any]]:
    """(reward, details) of a test run; details say which format matched."""
    for line in reversed(stdout.splitlines()):
        parsed = _json_reward(line)
        if parsed is not None:
            return parsed
    for line in reversed(stdout.splitlines()):
        passed = _PYTEST_PASSED.search(line)
        failed = _PYTEST_FAILED.search(line)
        if passed or (failed and " in " in line):
            n_pass = int(passed.group(1)) if passed else 0
            n_fail = int(failed.group(1)) if failed else 0
            errors = _PYTEST_ERRORS.search(line)
            n_err = int(errors.group(1)) if errors else 0
            total = n_pass + n_fail + n_err
            reward = n_pass / total if total else 0.0
            return reward, {"format": "pytest", "passed": n_pass, "total": total}
    for line in reversed(stdout.splitlines()):
        match = _FRACTION.search(line)
        if match:
            groups = [g for g in match.groups() if g is not None]
            n_pass, total = int(groups[0]), int(groups[1])
            reward = min(n_pass / total, 1.0) if total else 0.0
            return reward, {"format": "fraction", "passed": n_pass, "total": total}
    reward = 1.0 if exit_code == 0 else 0.0
    return reward, {"format": "exit_status", "exit_code": exit_code}


def _json_reward(line: str) -> tuple[float, dict[str, Any]] | None:
    line = line.strip()
    if not (line.startswith("{") and line.endswith("}")):
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    reward = obj.get("reward") if isinstance(obj, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        return None
    if not math.isfinite(reward):
        return None
    details = {k: v for k, v in obj.items() if k != "reward"}
    return float(reward), {"format": "json", **details}
