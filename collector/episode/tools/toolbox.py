"""The agent's tools bound to one episode's sandbox: ``execute_bash``, ``str_replace_editor``,
``submit``.

``Toolbox.call`` never raises for anything the agent did: unknown tools, arguments of the
wrong type and usage errors come back as a :class:`ToolResult` with ``error_kind`` set and a
message the agent can act on. Oversized arguments never reach it: the byte limit
(``SamplingLimits.max_argument_bytes``) is checked once, where a call is parsed
(:func:`sandpiper.collector.episode.parsers.check_call_size`; calls not parsed from text go through
:func:`~sandpiper.collector.episode.parsers.checked_call`). Only a sandbox that cannot be used any
more shows up as ``error_kind = sandbox_died`` (the agent broke it: graded) or
``sandbox_lost`` (its container is gone: an infra failure, see ``collector/episode/loop.py``).

``submit`` hands the grading to the sandbox (``Sandbox.grade``): the tests reach the sandbox
only then (so the agent cannot read them earlier), every process of the agent is killed, and
the task's test command runs as a uid the agent never has, with a clean environment, in a
workspace of plain files (see ``collector/sandbox/supervisor/grader.py``). The reward is read in the
task's declared result format from where only the tests write
(:mod:`sandpiper.collector.rewards.result_formats`). The test command is task configuration (trusted); the tests
folder and the answer reach it as ``$TESTS_DIR`` and ``$ANSWER_FILE`` — never interpolated
into a shell string.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

from sandpiper.collector.episode.parsers import argument_problem
from sandpiper.collector.episode.tools.base import ToolResult
from sandpiper.collector.episode.tools.editor import Editor, EditorError
from sandpiper.collector.episode.tools.schemas import TOOL_SCHEMAS
from sandpiper.collector.rewards.result_formats import (
    DEFAULT_RESULT_FORMAT,
    RESULT_FORMATS,
    reward_from_result,
)
from sandpiper.collector.sandbox.base import ExecOutcome, ExecResult, GradeRequest, ToolSandbox
from sandpiper.errors import SandboxError, SandboxLostError
from sandpiper.store.records import ToolErrorKind

MAX_TEST_OUTPUT_CHARS = 4000

_OUTCOME_KIND = {
    ExecOutcome.OK: ToolErrorKind.NONE,
    ExecOutcome.TIMED_OUT: ToolErrorKind.TIMED_OUT,
    ExecOutcome.OOM_KILLED: ToolErrorKind.OOM_KILLED,
    ExecOutcome.SANDBOX_DIED: ToolErrorKind.SANDBOX_DIED,
    ExecOutcome.SANDBOX_LOST: ToolErrorKind.SANDBOX_LOST,
}
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "array": (list,),
}  # fmt: skip
_ALSO_ACCEPTED: dict[tuple[str, str], tuple[type, ...]] = {
    ("execute_bash", "timeout"): (float,),  # a number of seconds; the schema says integer
    # numeric strings, as SWE-agent's command line accepts (the editor checks them)
    ("str_replace_editor", "insert_line"): (str,),
    ("str_replace_editor", "view_range"): (str,),
}


def _argument_specs() -> dict[str, dict[str, tuple[tuple[type, ...], bool]]]:
    """name -> {argument: (accepted types, required)}, from the tools' JSON schemas (the
    ones the model is shown) plus the few leniencies above."""
    specs: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {}
    for schema in TOOL_SCHEMAS:
        fn = schema["function"]
        params = fn["parameters"]
        required = set(params.get("required", ()))
        specs[fn["name"]] = {
            arg: (
                _JSON_TYPES[prop["type"]] + _ALSO_ACCEPTED.get((fn["name"], arg), ()),
                arg in required,
            )
            for arg, prop in params["properties"].items()
        }
    return specs


_ARGUMENTS = _argument_specs()


class Toolbox:
    """The tools of one episode. Create one per episode (the editor keeps undo history)."""

    def __init__(
        self,
        sandbox: ToolSandbox,
        *,
        tests_dir: Path | None,
        test_command: str | None,
        test_timeout_s: float,
        exec_timeout_s: float,
        max_exec_timeout_s: float | None = None,
        result_format: str = DEFAULT_RESULT_FORMAT,
        tests_see_agent_processes: bool = False,
        subject_command: str | None = None,
        tests_dest: str | None = None,
        reward_file: str | None = None,
        tests_import_workspace: bool = False,
    ) -> None:
        if result_format not in RESULT_FORMATS:
            raise ValueError(f"unknown result format {result_format!r}; one of {RESULT_FORMATS}")
        self.sandbox = sandbox
        self.tests_dir = tests_dir
        self.test_command = test_command
        self.test_timeout_s = test_timeout_s
        self.exec_timeout_s = exec_timeout_s
        self.max_exec_timeout_s = max_exec_timeout_s or 4 * exec_timeout_s
        self.result_format = result_format
        self.tests_see_agent_processes = tests_see_agent_processes
        self.subject_command = subject_command
        self.tests_dest = tests_dest
        """A task format's own tests path (open-instruct: ``/tests``); None = ``/grade/tests``."""
        self.reward_file = reward_file
        self.tests_import_workspace = tests_import_workspace
        """The tests import the agent's modules from the workspace (open-instruct): no
        ``PYTHONSAFEPATH`` for them (docs/security.md: such tasks trust code they import)."""
        """Where the tests write the reward (``result_format = "reward_file"``)."""
        if (result_format == "reward_file") != (reward_file is not None):
            raise ValueError("result_format 'reward_file' goes with a reward_file path")
        self.editor = Editor(sandbox)

    async def call(self, name: str, arguments: dict[str, Any] | str) -> ToolResult:
        """Run one tool call; every agent mistake is returned as data."""
        started = time.monotonic()
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                return ToolResult(
                    f"Error: arguments are not valid JSON: {e}", ToolErrorKind.BAD_JSON
                )
        problem = self._check_arguments(name, arguments)
        if problem is not None:
            return problem
        assert isinstance(arguments, dict)  # _check_arguments returned an error otherwise
        try:
            if name == "execute_bash":
                return await self._bash(arguments)
            if name == "str_replace_editor":
                return await self._edit(arguments, started)
            return await self._submit(arguments, started)
        except SandboxError as e:
            lost = isinstance(e, SandboxLostError)
            return ToolResult(
                f"Error: the sandbox failed: {e}",
                ToolErrorKind.SANDBOX_LOST if lost else ToolErrorKind.SANDBOX_DIED,
                duration_ms=_ms(started),
            )

    def _check_arguments(self, name: str, arguments: Any) -> ToolResult | None:
        spec = _ARGUMENTS.get(name)
        if spec is None:
            known = ", ".join(_ARGUMENTS)
            return ToolResult(
                f"Error: unknown tool {name!r}. Available tools: {known}.",
                ToolErrorKind.UNKNOWN_TOOL,
            )
        if not isinstance(arguments, dict):
            return ToolResult(
                f"Error: the arguments of {name} must be a JSON object.",
                ToolErrorKind.BAD_ARGUMENTS,
            )
        # The editor explains bad text itself (paths, file contents: see editor.py); other
        # tools' strings go to a shell or the store, which hold only valid UTF-8.
        problem = argument_problem(arguments) if name != "str_replace_editor" else None
        if problem is not None:
            return _bad(f"the arguments of {name} cannot be used: {problem}")
        try:
            json.dumps(arguments, ensure_ascii=False)
        except (ValueError, RecursionError) as e:  # only an editor call gets here unchecked
            return _bad(f"the arguments of {name} cannot be encoded: {str(e)[:200]}")
        for key, value in arguments.items():
            if key not in spec:
                return _bad(f"unknown parameter `{key}` for {name}; allowed: {', '.join(spec)}")
            types, _ = spec[key]
            if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
                wanted = " or ".join(_type_name(t) for t in types)
                got = _type_name(type(value))
                return _bad(f"parameter `{key}` of {name} must be {wanted}, got {got}")
        for key, (_, required) in spec.items():
            if required and arguments.get(key) is None:
                return _bad(f"missing required parameter `{key}` for {name}")
        return None

    async def _bash(self, arguments: dict[str, Any]) -> ToolResult:
        timeout_s = self._timeout(arguments.get("timeout"))
        result = await self.sandbox.exec(arguments["command"], timeout_s=timeout_s)
        return ToolResult(
            output=format_exec(result, timeout_s),
            error_kind=_OUTCOME_KIND[result.outcome],
            exit_code=result.exit_code,
            duration_ms=result.duration_ms,
            timed_out=result.outcome is ExecOutcome.TIMED_OUT,
            output_bytes_total=result.stdout_bytes_total + result.stderr_bytes_total,
        )

    def _timeout(self, value: float | None) -> float:
        """The asked timeout clamped to [1 s, ``max_exec_timeout_s``]."""
        if not value:
            return self.exec_timeout_s
        if isinstance(value, int):  # a 400-digit integer has no float (OverflowError)
            value = max(1, min(value, int(self.max_exec_timeout_s) + 1))
        return max(1.0, min(float(value), self.max_exec_timeout_s))

    async def _edit(self, arguments: dict[str, Any], started: float) -> ToolResult:
        try:
            output = await self.editor(**arguments)
        except EditorError as e:
            message = str(e)
            return ToolResult(
                message,
                ToolErrorKind.TOOL_ERROR,
                duration_ms=_ms(started),
                output_bytes_total=len(message.encode()),
            )
        except ValueError as e:  # e.g. a NUL byte in a path
            return _bad(str(e))
        return ToolResult(output, duration_ms=_ms(started), output_bytes_total=len(output.encode()))

    async def _submit(self, arguments: dict[str, Any], started: float) -> ToolResult:
        answer = arguments.get("answer")
        if self.test_command is None and self.tests_dir is None:
            return ToolResult("Submitted.", submitted=True, answer=answer, duration_ms=_ms(started))
        box = self.sandbox
        secret = secrets.token_hex(16)
        graded = await box.grade(
            GradeRequest(
                answer=(answer or "").encode("utf-8", "surrogatepass"),
                tests_dir=self.tests_dir,
                command=self.test_command or 'bash "$TESTS_DIR/run.sh"',
                timeout_s=self.test_timeout_s,
                secret=secret,
                keep_agent_processes=self.tests_see_agent_processes,
                subject_command=self.subject_command,
                tests_dest=self.tests_dest,
                result_path=self.reward_file,
                python_safe_path=not self.tests_import_workspace,
            )
        )
        result = graded.exec
        if result.outcome in (ExecOutcome.SANDBOX_DIED, ExecOutcome.SANDBOX_LOST):
            return ToolResult(
                f"Error: the sandbox died while running the tests: {result.stderr[-500:]}",
                _OUTCOME_KIND[result.outcome],
                submitted=True,
                answer=answer,
                duration_ms=_ms(started),
            )
        reward, details = reward_from_result(
            self.result_format,
            result_text=graded.result_text,
            stdout=result.stdout,
            exit_code=result.exit_code,
            secret=secret,
            result_error=graded.result_error,
        )
        if graded.error is not None:
            reward, details = 0.0, {"format": "grader", "error": graded.error}
        elif result.outcome is not ExecOutcome.OK:
            reward, details = 0.0, {"format": "outcome", "outcome": str(result.outcome)}
        if graded.refused:
            details["refused"] = list(graded.refused[:50])
        details["exit_code"] = result.exit_code
        details["output"] = _tail(result.stdout + result.stderr, MAX_TEST_OUTPUT_CHARS)
        return ToolResult(
            "Submitted.",
            submitted=True,
            answer=answer,
            exit_code=result.exit_code,
            duration_ms=_ms(started),
            timed_out=result.outcome is ExecOutcome.TIMED_OUT,
            test_reward=reward,
            test_details=details,
        )


def format_exec(result: ExecResult, timeout_s: float) -> str:
    """What the agent sees of a command: stdout, stderr, then a note on how it ended."""
    parts = [result.stdout]
    if result.stderr:
        parts.append(result.stderr)
    text = "\n".join(p.rstrip("\n") for p in parts if p)
    if result.outcome is ExecOutcome.TIMED_OUT:
        note = f"[The command timed out after {timeout_s:g} s and was killed.]"
    elif result.outcome is ExecOutcome.OOM_KILLED:
        note = "[The command was killed: out of memory.]"
    elif result.outcome in (ExecOutcome.SANDBOX_DIED, ExecOutcome.SANDBOX_LOST):
        note = "[The sandbox died.]"
    elif result.exit_code:
        note = f"[Exit code: {result.exit_code}]"
    else:
        note = ""
    return "\n".join(p for p in (text, note) if p)


def _bad(message: str) -> ToolResult:
    return ToolResult(f"Error: {message}.", ToolErrorKind.BAD_ARGUMENTS)


def _type_name(t: type) -> str:
    return {str: "a string", int: "an integer", float: "a number", list: "an array"}.get(
        t, t.__name__
    )


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "…" + text[-limit:]


def _ms(started: float) -> float:
    return (time.monotonic() - started) * 1000
