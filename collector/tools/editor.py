"""``str_replace_editor``: view / create / str_replace / insert / undo_edit inside a sandbox.

Behaviour and messages follow the editor tool that SWE-agent (``tools/edit_anthropic``),
OpenHands and Anthropic's text-editor tool share. Deliberate differences, both for
byte-exactness:

- Files are never rewritten with tabs expanded (tabs are expanded only in what the agent is
  shown), and ``str_replace`` matches ``old_str`` against the file's exact text.
- Bytes that are not valid UTF-8 survive an edit unchanged (decoded with surrogateescape).

Every file operation goes through the sandbox's ``read_file`` / ``write_file`` / ``stat`` /
``list_tree`` (paths travel as data, never inside a shell string). The undo history is kept
per file for the life of the :class:`Editor` (one episode).
"""

from __future__ import annotations

import posixpath
from collections import defaultdict
from typing import Protocol

SNIPPET_LINES = 4
MAX_RESPONSE_CHARS = 16_000
TRUNCATED_MESSAGE = (
    "<response clipped><NOTE>To save on context only part of this file has been shown to you. "
    "You should retry this tool after you have searched inside the file with `grep -n` in order "
    "to find the line numbers of what you are looking for.</NOTE>"
)
COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")


class EditorFS(Protocol):
    """What the editor needs from a sandbox (``PodmanSandbox`` and the fake provide it)."""

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None: ...

    async def stat(self, path: str) -> tuple[bool, bool]: ...

    async def list_tree(self, path: str, depth: int = 2) -> list[str]: ...


class EditorError(Exception):
    """A usage error; its message is shown to the agent verbatim."""


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _printable(text: str) -> str:
    return _encode(text).decode("utf-8", "replace")


def clip(text: str, limit: int = MAX_RESPONSE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + TRUNCATED_MESSAGE


def cat_n(content: str, descriptor: str, init_line: int = 1) -> str:
    """The ``cat -n`` rendering the agent sees (clipped, tabs expanded)."""
    content = _printable(clip(content)).expandtabs()
    numbered = "\n".join(f"{i + init_line:6}\t{line}" for i, line in enumerate(content.split("\n")))
    return f"Here's the result of running `cat -n` on {descriptor}:\n{numbered}\n"


class Editor:
    """One episode's editor: holds the per-file undo history."""

    def __init__(self, fs: EditorFS, *, cwd: str = "/workspace") -> None:
        self.fs = fs
        self.cwd = cwd
        self.history: dict[str, list[bytes]] = defaultdict(list)

    async def __call__(
        self,
        *,
        command: str,
        path: str,
        file_text: str | None = None,
        view_range: list[int] | None = None,
        old_str: str | None = None,
        new_str: str | None = None,
        insert_line: int | None = None,
    ) -> str:
        """Run one command; raise :class:`EditorError` with the agent-facing message."""
        if command not in COMMANDS:
            allowed = ", ".join(f'"{c}"' for c in COMMANDS)
            raise EditorError(
                f"Unrecognized command {command}. The allowed commands for the "
                f"str_replace_editor tool are: {allowed}"
            )
        is_dir = await self._validate_path(command, path)
        if command == "view":
            return await self._view(path, is_dir, view_range)
        if command == "create":
            if file_text is None:
                raise EditorError("Parameter `file_text` is required for command: create")
            return await self._create(path, file_text)
        if command == "str_replace":
            if old_str is None:
                raise EditorError("Parameter `old_str` is required for command: str_replace")
            return await self._str_replace(path, old_str, new_str or "")
        if command == "insert":
            if insert_line is None:
                raise EditorError("Parameter `insert_line` is required for command: insert")
            if new_str is None:
                raise EditorError("Parameter `new_str` is required for command: insert")
            return await self._insert(path, insert_line, new_str)
        return await self._undo(path)

    async def _validate_path(self, command: str, path: str) -> bool:
        if not path.startswith("/"):
            suggested = posixpath.join(self.cwd, path)
            raise EditorError(
                f"The path {path} is not an absolute path, it should start with `/`. "
                f"Maybe you meant {suggested}?"
            )
        exists, is_dir = await self.fs.stat(path)
        if not exists and command != "create":
            raise EditorError(f"The path {path} does not exist. Please provide a valid path.")
        if exists and command == "create":
            raise EditorError(
                f"File already exists at: {path}. Cannot overwrite files using command `create`."
            )
        if is_dir and command != "view":
            raise EditorError(
                f"The path {path} is a directory and only the `view` command can be used on "
                "directories"
            )
        return is_dir

    async def _read(self, path: str) -> str:
        try:
            return _decode(await self.fs.read_file(path))
        except OSError as e:
            raise EditorError(f"Ran into {e} while trying to read {path}") from e

    async def _write(self, path: str, text: str) -> None:
        try:
            await self.fs.write_file(path, _encode(text))
        except OSError as e:
            raise EditorError(f"Ran into {e} while trying to write to {path}") from e

    async def _view(self, path: str, is_dir: bool, view_range: list[int] | None) -> str:
        if is_dir:
            if view_range:
                raise EditorError(
                    "The `view_range` parameter is not allowed when `path` points to a directory."
                )
            listing = "\n".join(await self.fs.list_tree(path, 2))
            return (
                f"Here's the files and directories up to 2 levels deep in {path}, excluding "
                f"hidden items:\n{_printable(clip(listing))}\n"
            )
        content = await self._read(path)
        if not view_range:
            return cat_n(content, path)
        if len(view_range) != 2 or not all(type(i) is int for i in view_range):
            raise EditorError("Invalid `view_range`. It should be a list of two integers.")
        lines = content.split("\n")
        n_lines = len(lines)
        first, last = view_range
        if first < 1 or first > n_lines:
            raise EditorError(
                f"Invalid `view_range`: {view_range}. Its first element `{first}` should be "
                f"within the range of lines of the file: {[1, n_lines]}"
            )
        if last > n_lines:
            raise EditorError(
                f"Invalid `view_range`: {view_range}. Its second element `{last}` should be "
                f"smaller than the number of lines in the file: `{n_lines}`"
            )
        if last != -1 and last < first:
            raise EditorError(
                f"Invalid `view_range`: {view_range}. Its second element `{last}` should be "
                f"larger or equal than its first `{first}`"
            )
        last = n_lines if last == -1 else last
        return cat_n("\n".join(lines[first - 1 : last]), path, init_line=first)

    async def _create(self, path: str, file_text: str) -> str:
        parent = posixpath.dirname(path)
        exists, is_dir = await self.fs.stat(parent)
        if not (exists and is_dir):
            raise EditorError(
                f"The parent directory {parent} does not exist. Please create it first."
            )
        await self._write(path, file_text)
        self.history[path].append(_encode(file_text))
        return f"File created successfully at: {path}"

    async def _str_replace(self, path: str, old_str: str, new_str: str) -> str:
        content = await self._read(path)
        count = content.count(old_str) if old_str else 0
        if count == 0:
            raise EditorError(
                f"No replacement was performed, old_str `{old_str}` did not appear verbatim in "
                f"{path}."
            )
        if count > 1:
            lines = _occurrence_lines(content, old_str)
            raise EditorError(
                f"No replacement was performed. Multiple occurrences of old_str `{old_str}` in "
                f"lines {lines}. Please ensure it is unique"
            )
        if new_str == old_str:
            raise EditorError(
                f"No replacement was performed, old_str `{old_str}` is the same as new_str "
                f"`{new_str}`."
            )
        new_content = content.replace(old_str, new_str)
        await self._write(path, new_content)
        self.history[path].append(_encode(content))
        line = content.split(old_str)[0].count("\n")
        start = max(1, line - SNIPPET_LINES)
        end = min(line + SNIPPET_LINES + new_str.count("\n"), len(new_content.splitlines()))
        snippet = "\n".join(new_content.split("\n")[start - 1 : end])
        return (
            f"The file {path} has been edited. "
            + cat_n(snippet, f"a snippet of {path}", start)
            + "Review the changes and make sure they are as expected. Edit the file again if "
            "necessary."
        )

    async def _insert(self, path: str, insert_line: int, new_str: str) -> str:
        content = await self._read(path)
        lines = content.split("\n")
        n_lines = len(lines)
        if insert_line < 0 or insert_line > n_lines:
            raise EditorError(
                f"Invalid `insert_line` parameter: {insert_line}. It should be within the range "
                f"of lines of the file: {[0, n_lines]}"
            )
        new_lines = new_str.split("\n")
        await self._write(path, "\n".join(lines[:insert_line] + new_lines + lines[insert_line:]))
        self.history[path].append(_encode(content))
        snippet = "\n".join(
            lines[max(0, insert_line - SNIPPET_LINES) : insert_line]
            + new_lines
            + lines[insert_line : insert_line + SNIPPET_LINES]
        )
        return (
            f"The file {path} has been edited. "
            + cat_n(
                snippet, "a snippet of the edited file", max(1, insert_line - SNIPPET_LINES + 1)
            )
            + "Review the changes and make sure they are as expected (correct indentation, no "
            "duplicate lines, etc). Edit the file again if necessary."
        )

    async def _undo(self, path: str) -> str:
        if not self.history.get(path):
            raise EditorError(f"No edit history found for {path}.")
        old = self.history[path].pop()
        try:
            await self.fs.write_file(path, old)
        except OSError as e:
            raise EditorError(f"Ran into {e} while trying to write to {path}") from e
        return f"Last edit to {path} undone successfully. {cat_n(_decode(old), path)}"


def _occurrence_lines(content: str, needle: str) -> list[int]:
    """1-based line numbers where each occurrence of ``needle`` starts."""
    lines, start = [], content.find(needle)
    while start != -1:
        lines.append(content.count("\n", 0, start) + 1)
        start = content.find(needle, start + 1)
    return lines
