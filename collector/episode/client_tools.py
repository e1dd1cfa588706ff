"""A gateway client's own tools, in every action format: described, parsed back, checked.

A client of the gateway (an Agents SDK app, a script using ``tools=``) declares its tools in
each request. With a tool-call markup format (``hermes``, ``qwen3_coder``) the chat template
renders their schemas and the markup names them. A plain-text format (``bash_block``, for
models not trained on tool-call markup) has no markup, so the tools are described in the
system message (:func:`tools_prompt`) and a call is a fenced block whose info string is the
tool's name and whose body is its arguments as a JSON object::

    ```get_weather
    {"city": "Paris"}
    ```

A tool whose only parameter is a string takes the block's text itself (a shell tool's
command, as the ``bash_block`` protocol writes it). A reply without a block is an answer.

Whatever the format, a call the client cannot run is the model's error, recorded as such,
never returned as a call (:func:`client_calls`): a tool the client did not declare
(``unknown_tool``: an Agents SDK client raises on it), arguments that do not parse, and,
with ``parallel_tool_calls=false``, every call after the first (``format_error``).

:func:`plain_history` is the inverse for a from-scratch render (a restart, the
re-tokenization check): the assistant's calls back into blocks and the tool results into
the observation turns a ``bash_block`` delta appends.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from sandpiper.collector.episode.parsers import (
    DEFAULT_MAX_ARGUMENT_BYTES,
    ParsedMessage,
    ParsedToolCall,
    ToolFormat,
    check_call_size,
    format_observation,
    parse_tool_calls,
)
from sandpiper.store.records import ToolErrorKind

PLAIN_TEXT_FORMATS: frozenset[str] = frozenset({"bash_block"})
"""Action formats without tool-call markup: client tools are described and parsed here."""

_CALL_RE = re.compile(r"```([A-Za-z0-9_.:\-]+)[ \t]*\n(.*?)\n?```", re.DOTALL)

_PROTOCOL = """You can call the tools below. To call one, write a fenced code block whose info string is the tool's name and whose body is its arguments as one JSON object, for example:

```{example}
{{"{param}": "..."}}
```

A tool whose only parameter is a string takes the text itself. The result comes back in the next message. To answer without a tool, write no code block.

Tools:
{tools}"""


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The names of OpenAI-style function tools (``{"type": "function", "function": ...}``)."""
    return [str(_function(t).get("name", "")) for t in tools]


def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """How a plain-text format tells the model about the client's tools and how to call them."""
    lines = []
    for t in tools:
        f = _function(t)
        params = json.dumps(f.get("parameters") or {}, ensure_ascii=False, sort_keys=True)
        description = " ".join(str(f.get("description") or "").split())
        lines.append(f"- {f.get('name')}: {description} Parameters (JSON schema): {params}")
    first = _function(tools[0])
    props = list((first.get("parameters") or {}).get("properties") or {})
    return _PROTOCOL.format(
        example=first.get("name"), param=props[0] if props else "argument", tools="\n".join(lines)
    )


def plain_history(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Template messages of a gateway conversation in a plain-text format: the tools
    described in the (first) system message, calls written as blocks, tool results as
    observation user turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "tool":
            observation = format_observation(_text(m), None)
            if out and out[-1].get("_observations"):
                out[-1]["content"] += "\n" + observation
            else:
                out.append({"role": "user", "content": observation, "_observations": True})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = [_block(c) for c in m["tool_calls"]]
            content = "\n\n".join(p for p in (_text(m).strip(), *blocks) if p)
            out.append({"role": "assistant", "content": content})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_observations", None)
    if tools:
        described = tools_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{_text(out[0])}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def parse_plain_calls(text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedMessage:
    """The fenced-block calls of ``text`` (none: an answer), arguments parsed per tool."""
    by_name = {str(_function(t).get("name")): _function(t) for t in tools}
    calls = []
    for name, body in _CALL_RE.findall(text):
        calls.append(_plain_call(name, body, by_name.get(name)))
    content = _CALL_RE.sub("", text).strip() if calls else text.strip()
    return ParsedMessage(content=content, tool_calls=tuple(calls))


def client_calls(
    text: str,
    fmt: ToolFormat,
    tools: Sequence[Mapping[str, Any]],
    *,
    parallel: bool = True,
    max_argument_bytes: int = DEFAULT_MAX_ARGUMENT_BYTES,
) -> ParsedMessage:
    """The calls of a reply to a client that declared ``tools``: parsed in the run's format,
    every call to an undeclared tool an ``unknown_tool`` error, and with ``parallel`` False
    every call after the first well-formed one a ``format_error``."""
    if fmt in PLAIN_TEXT_FORMATS:
        parsed = parse_plain_calls(text, tools)
        calls = [check_call_size(c, max_argument_bytes) for c in parsed.tool_calls]
    else:
        parsed = parse_tool_calls(
            text, fmt, tool_schemas=tools, max_argument_bytes=max_argument_bytes
        )
        calls = list(parsed.tool_calls)
    declared = set(tool_names(tools))
    checked: list[ParsedToolCall] = []
    kept = 0
    for call in calls:
        if call.ok and call.name not in declared:
            call = _error(call, ToolErrorKind.UNKNOWN_TOOL,
                          f"Error: unknown tool {call.name!r}; the tools are: "
                          f"{', '.join(sorted(declared))}.")  # fmt: skip
        elif call.ok and not parallel and kept:
            call = _error(call, ToolErrorKind.FORMAT_ERROR,
                          "Error: one tool call per reply (parallel_tool_calls is false).")  # fmt: skip
        kept += call.ok
        checked.append(call)
    return ParsedMessage(content=parsed.content, tool_calls=tuple(checked))


def _plain_call(name: str, body: str, function: Mapping[str, Any] | None) -> ParsedToolCall:
    if function is None:  # not a declared tool: :func:`client_calls` says so, whatever the body
        return ParsedToolCall(name, {}, body)
    try:
        arguments = json.loads(body) if body.strip() else {}
    except (ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        only = _only_string_parameter(function)
        if only is None:
            why = "the block's body must be the arguments as one JSON object"
            return ParsedToolCall(name, None, body, ToolErrorKind.BAD_JSON,
                                  f"Error: malformed tool call: {why}.")  # fmt: skip
        arguments = {only: body}
    return ParsedToolCall(name, arguments, json.dumps(arguments, ensure_ascii=False))


def _only_string_parameter(function: Mapping[str, Any] | None) -> str | None:
    props = ((function or {}).get("parameters") or {}).get("properties") or {}
    if len(props) != 1:
        return None
    ((key, schema),) = props.items()
    is_string = isinstance(schema, Mapping) and schema.get("type", "string") == "string"
    return str(key) if is_string else None


def _error(call: ParsedToolCall, kind: ToolErrorKind, message: str) -> ParsedToolCall:
    return dataclasses.replace(call, arguments=None, error_kind=kind, error=message)


def _block(call: Mapping[str, Any]) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return f"```{function.get('name')}\n{arguments}\n```"


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function", tool)
    return function if isinstance(function, Mapping) else {}


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""
