"""Tool-call parsing of sampled assistant text: Hermes JSON and qwen3_coder XML formats.

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

Parsing never raises: a malformed call (bad JSON, missing name, arguments that are not an
object, arguments larger than the cap, an unclosed block) comes back as a
:class:`ParsedToolCall` with an ``error_kind`` and a message the agent is shown. Unknown
tool names and argument types are checked by the toolbox, which knows the schemas; the XML
parser only uses the schemas to convert parameter strings to their declared JSON types.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from store.records import ToolErrorKind

ToolFormat = Literal["hermes", "qwen3_coder"]

DEFAULT_MAX_ARGUMENT_BYTES = 65_536
"""Arguments larger than this (UTF-8 bytes of their JSON) are refused, not run."""

_BLOCK_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
_FUNCTION_RE = re.compile(r"<function=([^>\n]*)>(.*?)(</function>|\Z)", re.DOTALL)
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
        data = json.loads(body)
    except json.JSONDecodeError as e:
        return _malformed("", body, ToolErrorKind.BAD_JSON, f"invalid JSON ({e.msg})")
    if not isinstance(data, dict):
        return _malformed("", body, ToolErrorKind.BAD_JSON, "expected a JSON object")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return _malformed("", body, ToolErrorKind.BAD_JSON, 'missing "name"')
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        # Some models double-encode the arguments as a JSON string.
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return _malformed(name, body, ToolErrorKind.BAD_JSON, "arguments are not JSON")
    if not isinstance(arguments, dict):
        return _malformed(name, body, ToolErrorKind.BAD_ARGUMENTS, "arguments must be an object")
    return ParsedToolCall(name=name, arguments=arguments, arguments_json=_dumps(arguments))


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
        converted = json.loads(value)
    except json.JSONDecodeError:
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


def _check_size(call: ParsedToolCall, max_bytes: int) -> ParsedToolCall:
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
