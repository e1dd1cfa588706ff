"""Tool-call parsing: both formats, and malformed calls as data, never exceptions."""

from __future__ import annotations

import json

import pytest

from sandpiper.collector.episode.parsers import parse_tool_calls
from sandpiper.store.records import ToolErrorKind
from sandpiper.testing import FAKE_TOOL_SCHEMAS


def test_hermes_single_and_multiple_calls_keep_order_and_content():
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "execute_bash", "arguments": {"command": "ls -la"}}\n</tool_call>\n'
        '<tool_call>{"name": "submit", "arguments": {"answer": "42"}}</tool_call>'
    )
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.content == "Let me look."
    assert [c.name for c in parsed.tool_calls] == ["execute_bash", "submit"]
    assert parsed.tool_calls[0].arguments == {"command": "ls -la"}
    assert json.loads(parsed.tool_calls[1].arguments_json) == {"answer": "42"}
    assert all(c.ok for c in parsed.tool_calls)


def test_hermes_double_encoded_arguments_are_accepted():
    text = '<tool_call>{"name": "submit", "arguments": "{\\"answer\\": \\"x\\"}"}</tool_call>'
    (call,) = parse_tool_calls(text).tool_calls
    assert call.ok and call.arguments == {"answer": "x"}


def test_no_tool_call_gives_content_only():
    parsed = parse_tool_calls("The answer is 4.")
    assert parsed.tool_calls == () and parsed.content == "The answer is 4."


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ('{"name": "execute_bash", "arguments": {"command": "ls"', ToolErrorKind.BAD_JSON),
        ("not json at all", ToolErrorKind.BAD_JSON),
        ('["execute_bash"]', ToolErrorKind.BAD_JSON),
        ('{"arguments": {"command": "ls"}}', ToolErrorKind.BAD_JSON),
        ('{"name": "execute_bash", "arguments": [1, 2]}', ToolErrorKind.BAD_ARGUMENTS),
        ('{"name": "execute_bash", "arguments": "{oops"}', ToolErrorKind.BAD_JSON),
    ],
)
def test_hermes_malformed_calls_become_errors(body, kind):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>").tool_calls
    assert call.error_kind is kind
    assert call.arguments is None
    assert call.error and call.error.startswith("Error:")
    assert call.arguments_json == body.strip()


def test_unclosed_block_is_an_error_even_with_valid_json():
    text = '<tool_call>{"name": "submit", "arguments": {}}'
    (call,) = parse_tool_calls(text).tool_calls
    assert call.error_kind is ToolErrorKind.BAD_JSON and "unclosed" in (call.error or "")


def test_huge_arguments_are_refused_not_run():
    big = "x" * 5000
    text = f'<tool_call>{{"name": "execute_bash", "arguments": {{"command": "{big}"}}}}</tool_call>'
    (call,) = parse_tool_calls(text, max_argument_bytes=1000).tool_calls
    assert call.error_kind is ToolErrorKind.ARGUMENTS_TOO_LARGE
    assert call.arguments is None and len(call.arguments_json) <= 200
    (ok,) = parse_tool_calls(text, max_argument_bytes=10_000).tool_calls
    assert ok.ok


def test_qwen3_coder_xml_with_type_conversion_from_schemas():
    text = (
        "thinking\n<tool_call>\n<function=execute_bash>\n<parameter=command>\n"
        "cat a.py\n  echo hi\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    parsed = parse_tool_calls(text, "qwen3_coder", tool_schemas=FAKE_TOOL_SCHEMAS)
    (call,) = parsed.tool_calls
    assert parsed.content == "thinking"
    assert call.name == "execute_bash"
    assert call.arguments == {"command": "cat a.py\n  echo hi", "timeout": 30}


def test_qwen3_coder_keeps_unconvertible_values_as_strings():
    text = (
        "<tool_call><function=execute_bash><parameter=command>ls</parameter>"
        "<parameter=timeout>soon</parameter></function></tool_call>"
    )
    (call,) = parse_tool_calls(text, "qwen3_coder", tool_schemas=FAKE_TOOL_SCHEMAS).tool_calls
    assert call.arguments == {"command": "ls", "timeout": "soon"}


@pytest.mark.parametrize(
    "body",
    [
        "<parameter=command>ls</parameter>",
        "<function=>x</function>",
        "<function=execute_bash><parameter=command>ls</parameter>",
    ],
)
def test_qwen3_coder_malformed(body):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>", "qwen3_coder").tool_calls
    assert not call.ok and call.error_kind is ToolErrorKind.BAD_JSON
