"""OpenAI function-calling JSON schemas of the three agent tools (rendered by the chat template).

The ``str_replace_editor`` description and parameters follow the editor tool shared by
SWE-agent, OpenHands and Anthropic's text-editor tool, so models trained on it feel at home.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

EXECUTE_BASH: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "execute_bash",
        "description": (
            "Run a bash command in the sandbox and return its output (stdout, then stderr).\n"
            "* The working directory and exported environment variables persist between "
            "calls; shell functions and aliases do not.\n"
            "* Long outputs are cut in the middle: redirect to a file and use grep/head/tail.\n"
            "* Commands that run longer than the timeout are killed. Start long-running "
            "processes in the background with their output redirected: `cmd > log 2>&1 &`.\n"
            "* There is no network access and no interactive input (stdin is empty)."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The bash command to run."},
                "timeout": {
                    "type": "integer",
                    "description": "Optional timeout in seconds (capped by the sandbox).",
                },
            },
            "required": ["command"],
        },
    },
}

STR_REPLACE_EDITOR: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "str_replace_editor",
        "description": (
            "Custom editing tool for viewing, creating and editing files\n"
            "* State is persistent across command calls and discussions with the user\n"
            "* If `path` is a file, `view` displays the result of applying `cat -n`. If `path` "
            "is a directory, `view` lists non-hidden files and directories up to 2 levels deep\n"
            "* The `create` command cannot be used if the specified `path` already exists as a "
            "file\n"
            "* If a `command` generates a long output, it will be truncated and marked with "
            "`<response clipped>`\n"
            "* The `undo_edit` command will revert the last edit made to the file at `path`\n\n"
            "Notes for using the `str_replace` command:\n"
            "* The `old_str` parameter should match EXACTLY one or more consecutive lines from "
            "the original file. Be mindful of whitespaces!\n"
            "* If the `old_str` parameter is not unique in the file, the replacement will not be "
            "performed. Make sure to include enough context in `old_str` to make it unique\n"
            "* The `new_str` parameter should contain the edited lines that should replace the "
            "`old_str`"
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {
                    "type": "string",
                    "enum": ["view", "create", "str_replace", "insert", "undo_edit"],
                    "description": "The commands to run. Allowed options are: `view`, `create`, "
                    "`str_replace`, `insert`, `undo_edit`.",
                },
                "path": {
                    "type": "string",
                    "description": "Absolute path to file or directory, e.g. `/workspace/file.py`"
                    " or `/workspace`.",
                },
                "file_text": {
                    "type": "string",
                    "description": "Required parameter of `create` command, with the content of "
                    "the file to be created.",
                },
                "old_str": {
                    "type": "string",
                    "description": "Required parameter of `str_replace` command containing the "
                    "string in `path` to replace.",
                },
                "new_str": {
                    "type": "string",
                    "description": "Optional parameter of `str_replace` command containing the new "
                    "string (if not given, no string will be added). Required parameter of "
                    "`insert` command containing the string to insert.",
                },
                "insert_line": {
                    "type": "integer",
                    "description": "Required parameter of `insert` command. The `new_str` will be "
                    "inserted AFTER the line `insert_line` of `path`.",
                },
                "view_range": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "description": "Optional parameter of `view` command when `path` points to a "
                    "file. If none is given, the full file is shown. If provided, the file will be "
                    "shown in the indicated line number range, e.g. [11, 12] will show lines 11 "
                    "and 12. Indexing at 1 to start. Setting `[start_line, -1]` shows all lines "
                    "from `start_line` to the end of the file.",
                },
            },
            "required": ["command", "path"],
        },
    },
}

SUBMIT: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "submit",
        "description": (
            "Finish the task. The task's tests run on the sandbox as it is now; the episode "
            "ends after this call. Pass the final answer if the task asks for one."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "answer": {"type": "string", "description": "The final answer, if any."},
            },
            "required": [],
        },
    },
}

TOOL_SCHEMAS: list[dict[str, Any]] = [EXECUTE_BASH, STR_REPLACE_EDITOR, SUBMIT]
"""What the chat template renders as the available tools."""


def offered_schemas(names: Sequence[str], descriptions: str = "full") -> list[dict[str, Any]]:
    """The schemas of the tools ``names`` (in ``TOOL_SCHEMAS`` order), as the prompt shows them.

    ``descriptions="brief"`` (``collector.tool_descriptions``) keeps each tool's first
    sentence and only its required parameters, without their descriptions: about 300 prompt
    tokens fewer for the demo tools, which a tiny model with a short context (and a CPU
    prefill) feels. Calls are parsed and run the same way."""
    offered = [copy.deepcopy(t) for t in TOOL_SCHEMAS if t["function"]["name"] in names]
    if descriptions == "brief":
        for schema in offered:
            function = schema["function"]
            first_line = function["description"].split("\n")[0]
            function["description"] = first_line.split(". ")[0].rstrip(".") + "."
            parameters = function["parameters"]
            required = parameters.get("required", [])
            parameters["properties"] = {
                name: {k: v for k, v in prop.items() if k != "description"}
                for name, prop in parameters["properties"].items()
                if name in required
            }
    return offered
