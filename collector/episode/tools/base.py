"""The tool contract: what the agent loop gets back from running one tool call.

Tool implementations (``execute_bash``, ``str_replace_editor``, ``submit``) live in this
package and run inside a :class:`sandpiper.collector.sandbox.base.Sandbox`. Usage errors are data
(``error_kind``), returned to the agent as observations, never raised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sandpiper.store.records import ToolErrorKind


@dataclass(frozen=True, slots=True)
class ToolResult:
    output: str
    """What the agent is shown (capped head + tail, with an error message on errors)."""
    error_kind: ToolErrorKind = ToolErrorKind.NONE
    exit_code: int | None = None
    duration_ms: float = 0.0
    timed_out: bool = False
    output_bytes_total: int = 0
    submitted: bool = False
    """True for a ``submit`` call: the episode ends after it."""
    answer: str | None = None
    """The answer passed to ``submit`` (None when it took no answer)."""
    test_reward: float | None = None
    """Reward parsed from the task's test script at submit; None when the task has none."""
    test_details: dict[str, Any] = field(default_factory=dict)
    """Parsed test output (passed / total, JSON fields, exit status)."""
