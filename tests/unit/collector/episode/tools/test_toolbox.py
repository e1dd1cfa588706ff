"""Toolbox.call: agent mistakes are data; submit copies the tests in only then."""

from __future__ import annotations

import asyncio
import inspect
import json

import pytest

from sandpiper.collector.episode.tools import TOOL_SCHEMAS, Toolbox, offered_schemas
from sandpiper.store.records import ToolErrorKind

TESTS_DIR = "/grade/tests"


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def tests_dir(tmp_path):
    d = tmp_path / "tests"
    d.mkdir()
    (d / "run.sh").write_text(
        'test "$(cat /dev/stdin 2>/dev/null; cat "$ANSWER_FILE")" = 42 '
        "&& r=1 || r=0; echo '{\"reward\": 1.0}'; "
        'echo "{\\"reward\\": $r}" > "$SANDPIPER_RESULT_FILE"\n'
    )
    (d / "it's $(x)\nodd.txt").write_text("hostile name")
    return d


def make(box, tests_dir=None, test_command=None, result_format="result_file"):
    return Toolbox(
        box, tests_dir=tests_dir, test_command=test_command, test_timeout_s=10,
        exec_timeout_s=5, result_format=result_format,
    )  # fmt: skip


def test_schemas_are_function_calling_json():
    names = [s["function"]["name"] for s in TOOL_SCHEMAS]
    assert names == ["execute_bash", "str_replace_editor", "submit"]
    for schema in TOOL_SCHEMAS:
        assert schema["type"] == "function"
        assert schema["function"]["parameters"]["type"] == "object"
        json.dumps(schema)


def test_offered_schemas_keep_order_and_brief_ones_only_the_essentials():
    full = offered_schemas(["submit", "execute_bash"])
    assert [s["function"]["name"] for s in full] == ["execute_bash", "submit"]
    assert full[0] == TOOL_SCHEMAS[0]
    brief = offered_schemas(["execute_bash", "submit"], "brief")
    bash = brief[0]["function"]
    assert bash["description"] == (
        "Run a bash command in the sandbox and return its output (stdout, then stderr)."
    )
    assert bash["parameters"]["properties"] == {"command": {"type": "string"}}
    assert bash["parameters"]["required"] == ["command"]
    assert brief[1]["function"]["parameters"]["properties"] == {}
    assert len(json.dumps(brief)) < len(json.dumps(full)) / 2
    assert TOOL_SCHEMAS[0]["function"]["parameters"]["properties"]["timeout"]  # not mutated


@pytest.mark.parametrize(
    ("name", "arguments", "kind", "fragment"),
    [
        ("rm_rf", {}, ToolErrorKind.UNKNOWN_TOOL, "unknown tool 'rm_rf'"),
        ("execute_bash", {}, ToolErrorKind.BAD_ARGUMENTS, "missing required parameter `command`"),
        ("execute_bash", {"command": ["ls"]}, ToolErrorKind.BAD_ARGUMENTS, "must be a string"),
        ("execute_bash", {"command": "ls", "x": 1}, ToolErrorKind.BAD_ARGUMENTS, "unknown param"),
        (
            "str_replace_editor",
            {"command": "insert", "path": "/w", "insert_line": 2.5},
            ToolErrorKind.BAD_ARGUMENTS,
            "`insert_line` of str_replace_editor must be an integer",
        ),
        (
            "str_replace_editor",
            {"command": "view", "path": "/w", "view_range": True},
            ToolErrorKind.BAD_ARGUMENTS,
            "must be an array",
        ),
        ("execute_bash", "{not json", ToolErrorKind.BAD_JSON, "not valid JSON"),
        ("execute_bash", "[1]", ToolErrorKind.BAD_ARGUMENTS, "must be a JSON object"),
    ],
)
def test_bad_calls_are_data(fake_sandbox, name, arguments, kind, fragment):
    result = run(make(fake_sandbox).call(name, arguments))
    assert result.error_kind is kind
    assert fragment in result.output
    assert fake_sandbox.commands == []


def test_editor_usage_error_is_tool_error(fake_sandbox):
    result = run(make(fake_sandbox).call("str_replace_editor", {"command": "view", "path": "x"}))
    assert result.error_kind is ToolErrorKind.TOOL_ERROR
    assert "not an absolute path" in result.output


def test_bash_output_and_exit_code(fake_sandbox):
    result = run(
        make(fake_sandbox).call("execute_bash", {"command": "echo out; echo err >&2; exit 3"})
    )
    assert result.error_kind is ToolErrorKind.NONE
    assert result.exit_code == 3
    assert result.output == "out\nerr\n[Exit code: 3]"
    assert result.output_bytes_total == 8


def test_submit_copies_tests_only_at_submit(fake_sandbox, tests_dir):
    toolbox = make(fake_sandbox, tests_dir=tests_dir)
    assert not fake_sandbox.host_path(TESTS_DIR).exists()
    result = run(toolbox.call("submit", {"answer": "42"}))
    assert result.submitted and result.answer == "42"
    assert result.test_reward == 1.0 and result.test_details["format"] == "result_file"
    assert fake_sandbox.killed == 1  # agent leftovers killed before the tests run
    copied = fake_sandbox.host_path(TESTS_DIR) / "it's $(x)\nodd.txt"
    assert copied.read_text() == "hostile name"
    wrong = run(make(fake_sandbox, tests_dir=tests_dir).call("submit", {"answer": "41"}))
    assert wrong.test_reward == 0.0  # the printed {"reward": 1.0} line never counts


def test_submit_without_tests_has_no_reward(fake_sandbox):
    result = run(make(fake_sandbox).call("submit", {}))
    assert result.submitted and result.test_reward is None and result.answer is None


def test_submit_exit_status_reward_only_when_declared(fake_sandbox):
    def submit(result_format):
        toolbox = make(fake_sandbox, test_command="test -f done", result_format=result_format)
        return run(toolbox.call("submit", {}))

    assert submit("exit_status").test_reward == 0.0
    fake_sandbox.host_path("/workspace/done").write_text("")
    assert submit("result_file").test_reward == 0.0  # exit 0 but no result file
    result = submit("exit_status")
    assert result.test_reward == 1.0 and result.test_details["format"] == "exit_status"


def test_argument_checks_come_from_the_schemas_and_the_byte_limit_from_one_place():
    """The schemas the model is shown declare every argument the toolbox accepts, and which
    are required. The byte limit is the run's ``SamplingLimits.max_argument_bytes``, checked
    where a call is parsed: the toolbox has no limit of its own to drift from it."""
    from sandpiper.collector.episode.parsers import DEFAULT_MAX_ARGUMENT_BYTES, checked_call
    from sandpiper.collector.episode.tools.toolbox import _ARGUMENTS
    from sandpiper.config import CollectorConfig, SamplingLimits

    for schema in TOOL_SCHEMAS:
        fn = schema["function"]
        spec = _ARGUMENTS[fn["name"]]
        assert list(spec) == list(fn["parameters"]["properties"])
        required = {arg for arg, (_, req) in spec.items() if req}
        assert required == set(fn["parameters"]["required"])
    limit = CollectorConfig().max_argument_bytes
    assert SamplingLimits().max_argument_bytes == DEFAULT_MAX_ARGUMENT_BYTES == limit
    assert "max_argument_bytes" not in inspect.signature(Toolbox).parameters
    big = checked_call("execute_bash", {"command": "x" * 300_000}, limit)
    assert big.error_kind is ToolErrorKind.ARGUMENTS_TOO_LARGE and str(limit) in big.error
    assert checked_call("execute_bash", {"command": "ls"}, limit).ok
