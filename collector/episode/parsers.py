"""Action parsing of sampled assistant text: Hermes JSON, qwen3_coder XML and bash blocks.

Hermes (Qwen2.5, NousResearch)::

    <tool_call>
    {"name": "execute_bash", "arguments": {"command": "ls"}}
    </tool_call>

qwen3_coder::

    <tool_call>
    <function=execute_bash>
    <parameter=command>
    ls
    </parameter>
    </function>
    </tool_call>

bash_block (the mini-swe-agent protocol, for models not trained on tool-call markup): the
reply holds exactly one fenced block; it runs as ``execute_bash``::

    THOUGHT: the numbers are in numbers.txt, let me add them up.

    ```bash
    python3 -c 'import sys; print(sum(map(int, sys.stdin)))' < numbers.txt > answer.txt
    ```

The observation comes back as the next *user* turn (:func:`format_observation`). The agent
finishes with ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (:data:`SUBMIT_SENTINEL`):
a command whose output starts with that line submits, and the rest of its output is the
answer (:func:`submission_answer`). A reply with no block or with several is a
``format_error`` observation, as in mini-swe-agent, not the end of the episode.

Parsing never raises: a malformed call (bad JSON, missing name, arguments that are not an
object, arguments larger than the cap, an unclosed block, arguments nested deeper than
:data:`MAX_ARGUMENT_DEPTH`, numbers that are not finite (``NaN``, ``1e999``), integers too
long to convert, lone surrogates such as ``"\\ud800"`` that no UTF-8 file, shell or store
can hold) comes back as a
:class:`ParsedToolCall` with an ``error_kind`` and a message the agent is shown. Unknown
tool names and argument types are checked by the toolbox, which knows the schemas (in the
gateway, by :mod:`sandpiper.collector.episode.client_tools` against the client's declared tools); the
XML parser only uses the schemas to convert parameter strings to their declared JSON types.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sandpiper.config import SamplingLimits
from sandpiper.config import ToolFormat as ToolFormat  # the action formats are the config's
from sandpiper.store.records import ToolErrorKind

SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""bash_block: the first output line that ends the episode (mini-swe-agent's convention)."""

DEFAULT_MAX_ARGUMENT_BYTES: int = SamplingLimits().max_argument_bytes
"""Arguments larger than this (UTF-8 bytes of their JSON) are refused, not run: the
config's default (``collector.max_argument_bytes``). A run passes its own
``SamplingLimits.max_argument_bytes``; :func:`check_call_size` is the one check of it
(every parser's last step; the toolbox runs only calls that passed it)."""
MAX_ARGUMENT_DEPTH = 16
"""Arguments nested deeper than this (objects and arrays) are refused: no tool takes more
than 2 levels, and deep nesting costs recursion in every JSON encoder downstream."""

_BLOCK_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
_FUNCTION_RE = re.compile(r"<function=([^>\n]*)>(.*?)(</function>|\Z)", re.DOTALL)
_BASH_RE = re.compile(r"```(?:bash|sh)[ \t]*\n(.*?)\n?```", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>\n]*)>(.*?)(</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One tool call as the model wrote it, parsed or not."""

    name: str
    """Tool name as written ("" when none could be read)."""
    arguments: dict[str, Any] | None
    """Parsed arguments; None when the call is malformed (see ``error_kind``)."""
    arguments_json: str
    """Arguments as JSON text, or the raw text when they did not parse."""
    error_kind: ToolErrorKind = ToolErrorKind.NONE
    error: str | None = None
    """Message shown to the agent instead of running the call; None when well-formed."""

    @property
    def ok(self) -> bool:
        return self.error_kind is ToolErrorKind.NONE


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    content: str
    """The assistant text outside tool-call blocks (stripped)."""
    tool_calls: tuple[ParsedToolCall, ...]


def parse_tool_calls(
    text: str,
    fmt: ToolFormat = "hermes",
    *,
    tool_schemas: Sequence[Mapping[str, Any]] = (),
    max_argument_bytes: int = DEFAULT_MAX_ARGUMENT_BYTES,
) -> ParsedMessage:
    """Split ``text`` into free content and the tool calls it contains (in order)."""
    if fmt == "bash_block":
        return _check_bash_size(parse_bash_block(text), max_argument_bytes)
    calls: list[ParsedToolCall] = []
    for match in _BLOCK_RE.finditer(text):
        body, closing = match.group(1), match.group(2)
        if fmt == "qwen3_coder":
            call = _parse_xml(body, _param_types(tool_schemas))
        else:
            call = _parse_hermes(body)
        if not closing and call.ok:
            call = _malformed(call.name, body, ToolErrorKind.BAD_JSON, "unclosed <tool_call> block")
        calls.append(_check_size(call, max_argument_bytes))
    content = _BLOCK_RE.sub("", text).strip()
    return ParsedMessage(content=content, tool_calls=tuple(calls))


def parse_bash_block(text: str) -> ParsedMessage:
    """The one fenced bash block of ``text`` as an ``execute_bash`` call, or a format error
    (none or several blocks) that the agent is shown."""
    blocks = _BASH_RE.findall(text)
    content = _BASH_RE.sub("", text).strip()
    if len(blocks) == 1:
        command = blocks[0]
        call = ParsedToolCall("execute_bash", {"command": command}, _dumps({"command": command}))
        return ParsedMessage(content=content, tool_calls=(call,))
    error = ParsedToolCall(
        name="",
        arguments=None,
        arguments_json=text.strip()[:200],
        error_kind=ToolErrorKind.FORMAT_ERROR,
        error=format_error_message(len(blocks)),
    )
    return ParsedMessage(content=content, tool_calls=(error,))


BASH_BLOCK_PROTOCOL = f"""Answer with a short THOUGHT, then exactly ONE bash code block with ONE command (or commands joined with && or ||):

```bash
your_command_here
```

The command runs in /workspace; its output comes back in the next message. When you are done, run `echo {SUBMIT_SENTINEL}` on its own."""
"""How a bash_block agent is told the protocol (appended to the system prompt)."""


def system_prompt_for(fmt: ToolFormat, system_prompt: str) -> str:
    """The system prompt of an episode: with tool-call formats the chat template adds the
    tool schemas; with ``bash_block`` the protocol is appended here."""
    if fmt != "bash_block":
        return system_prompt
    return f"{system_prompt}\n\n{BASH_BLOCK_PROTOCOL}"


def format_error_message(n_blocks: int) -> str:
    """What a bash_block agent is told when its reply has no block or several."""
    return (
        f"Please always provide EXACTLY ONE action in a ```bash block, found {n_blocks}.\n"
        f"To finish, run `echo {SUBMIT_SENTINEL}` on its own."
    )


def format_observation(output: str, exit_code: int | None) -> str:
    """bash_block: the user turn that carries a command's result back to the agent."""
    code = "" if exit_code is None else f"<returncode>{exit_code}</returncode>\n"
    return f"{code}<output>\n{output}\n</output>"


def submission_answer(output: str) -> str | None:
    """The answer submitted by a command whose first output line is the sentinel (the rest
    of its output, stripped); None when the output does not start with it."""
    first, _, rest = output.lstrip().partition("\n")
    if first.strip() != SUBMIT_SENTINEL:
        return None
    return rest.strip()


def _check_bash_size(parsed: ParsedMessage, max_bytes: int) -> ParsedMessage:
    calls = tuple(c if not c.ok else _check_size(c, max_bytes) for c in parsed.tool_calls)
    return ParsedMessage(content=parsed.content, tool_calls=calls)


def _malformed(name: str, raw: str, kind: ToolErrorKind, why: str) -> ParsedToolCall:
    return ParsedToolCall(
        name=name,
        arguments=None,
        arguments_json=raw.strip(),
        error_kind=kind,
        error=f"Error: malformed tool call: {why}.",
    )


def _parse_hermes(body: str) -> ParsedToolCall:
    try:
        data = _loads(body)
    except json.JSONDecodeError as e:
        return _malformed("", body, ToolErrorKind.BAD_JSON, f"invalid JSON ({e.msg})")
    except (ValueError, RecursionError) as e:  # NaN, a 5000-digit integer, [[[[...]]]]
        return _malformed("", body, ToolErrorKind.BAD_JSON, f"invalid JSON ({_why(e)})")
    if not isinstance(data, dict):
        return _malformed("", body, ToolErrorKind.BAD_JSON, "expected a JSON object")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return _malformed("", body, ToolErrorKind.BAD_JSON, 'missing "name"')
    if not _is_text(name):
        return _malformed("", body, ToolErrorKind.BAD_JSON, '"name" is not valid Unicode')
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        # Some models double-encode the arguments as a JSON string.
        try:
            arguments = _loads(arguments)
        except (ValueError, RecursionError):
            return _malformed(name, body, ToolErrorKind.BAD_JSON, "arguments are not JSON")
    if not isinstance(arguments, dict):
        return _malformed(name, body, ToolErrorKind.BAD_ARGUMENTS, "arguments must be an object")
    return _parsed(name, arguments, body)


def _parse_xml(body: str, types: Mapping[str, Mapping[str, str]]) -> ParsedToolCall:
    function = _FUNCTION_RE.search(body)
    if function is None:
        return _malformed("", body, ToolErrorKind.BAD_JSON, "expected <function=NAME>")
    name = function.group(1).strip()
    if not name:
        return _malformed("", body, ToolErrorKind.BAD_JSON, "empty function name")
    if not function.group(3):
        return _malformed(name, body, ToolErrorKind.BAD_JSON, "unclosed <function> block")
    param_types = types.get(name, {})
    arguments: dict[str, Any] = {}
    for param in _PARAM_RE.finditer(function.group(2)):
        key = param.group(1).strip()
        arguments[key] = _convert(_strip_one_newline(param.group(2)), param_types.get(key))
    return _parsed(name, arguments, body)


def _parsed(name: str, arguments: dict[str, Any], body: str) -> ParsedToolCall:
    """A well-formed call, or a ``bad_arguments`` one when its values cannot be run or
    stored (checked before anything encodes them)."""
    problem = argument_problem(arguments)
    if problem is not None:
        return _malformed(name, body, ToolErrorKind.BAD_ARGUMENTS, problem)
    return ParsedToolCall(name=name, arguments=arguments, arguments_json=_dumps(arguments))


def _strip_one_newline(value: str) -> str:
    # The format puts the value on its own lines; only that framing newline is removed so
    # that file contents keep their own leading/trailing whitespace.
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _convert(value: str, json_type: str | None) -> Any:
    """Convert an XML parameter string to its schema type; keep the string when it fails."""
    if json_type in (None, "string"):
        return value
    try:
        converted = _loads(value)
    except (ValueError, RecursionError):
        if json_type == "boolean" and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return value  # the toolbox reports the type error to the agent
    return converted


def _param_types(schemas: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """``{tool: {param: json_type}}`` from OpenAI-style function schemas."""
    types: dict[str, dict[str, str]] = {}
    for schema in schemas:
        function = schema.get("function", schema)
        props = function.get("parameters", {}).get("properties", {})
        types[function.get("name", "")] = {
            k: v.get("type", "string") for k, v in props.items() if isinstance(v, Mapping)
        }
    return types


def argument_problem(arguments: Any) -> str | None:
    """Why ``arguments`` cannot be run or stored (None when they can): nested deeper than
    :data:`MAX_ARGUMENT_DEPTH`, a number that is not finite, or text that is not valid
    Unicode (a lone surrogate). Iterative, so no nesting can exhaust the recursion limit."""
    stack: list[tuple[Any, int]] = [(arguments, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return "a string holds a lone surrogate (not valid Unicode)"
        elif isinstance(value, float):
            if not math.isfinite(value):
                return f"the number {value} is not finite"
        elif isinstance(value, dict | list):
            if depth >= MAX_ARGUMENT_DEPTH:
                return f"the arguments are nested deeper than {MAX_ARGUMENT_DEPTH} levels"
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str) and not _is_text(key):
                    return "a key holds a lone surrogate (not valid Unicode)"
                stack.append((item, depth + 1))
    return None


def safe_text(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX`` escapes (storable as UTF-8)."""
    return text if _is_text(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _loads(text: str) -> Any:
    """``json.loads`` without ``NaN`` / ``Infinity`` (not JSON; they would be stored)."""
    return json.loads(text, parse_constant=_reject_constant)


def _why(e: BaseException) -> str:
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return str(e)[:200]


def check_call_size(call: ParsedToolCall, max_bytes: int) -> ParsedToolCall:
    """``call``, or a malformed one when its arguments cannot be run or stored: larger than
    ``max_bytes`` of JSON, nested too deep, not finite, not valid Unicode (every parser's
    last check)."""
    return _check_size(call, max_bytes)


def checked_call(name: str, arguments: dict[str, Any], max_bytes: int) -> ParsedToolCall:
    """A call given as a name and arguments rather than written in text (an external agent's
    command through the gateway, a trainer's tool call), checked as a parsed call is: the
    toolbox runs only calls that passed :func:`check_call_size`."""
    return _check_size(_parsed(name, arguments, ""), max_bytes)


def _check_size(call: ParsedToolCall, max_bytes: int) -> ParsedToolCall:
    if not call.ok:  # the raw text is stored: keep it storable
        name, raw = safe_text(call.name), safe_text(call.arguments_json)
        return dataclasses.replace(call, name=name, arguments_json=raw)
    problem = argument_problem(call.name) or argument_problem(call.arguments)
    if problem is not None:  # bash_block and XML text reach here unchecked
        raw = safe_text(call.arguments_json)
        return _malformed(safe_text(call.name), raw, ToolErrorKind.BAD_ARGUMENTS, problem)
    size = len(call.arguments_json.encode())
    if size <= max_bytes:
        return call
    head = call.arguments_json[:200]
    return ParsedToolCall(
        name=call.name,
        arguments=None,
        arguments_json=head,
        error_kind=ToolErrorKind.ARGUMENTS_TOO_LARGE,
        error=f"Error: tool call arguments are {size} bytes; the limit is {max_bytes}.",
    )


def _dumps(arguments: Mapping[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)
