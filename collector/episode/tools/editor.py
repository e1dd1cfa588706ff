"""``str_replace_editor``: view / create / str_replace / insert / undo_edit inside a sandbox.

Behaviour and messages follow the references — SWE-agent's ``tools/edit_anthropic``,
Anthropic's text-editor tool and OpenHands' editor — where they agree, and SWE-agent's
wording where they differ (it is what agents are trained on):

- ``view`` shows ``cat -n`` with tabs expanded; ``str_replace`` first matches ``old_str``
  verbatim and, when that fails, against the tab-expanded text as the references do, so an
  ``old_str`` copied from ``view`` matches a tab-indented file.
- CRLF files are viewed and matched with ``\\n``; their line endings are kept on write.
- Integer parameters also come as numeric strings (``"3"``, ``["1", "5"]``, ``"[1, 5]"``),
  as SWE-agent's command line accepts them.
- Several matches list the distinct lines where they start; an empty ``old_str`` behaves as
  in SWE-agent (every line is a match); a relative path is resolved against the shell's
  current folder in the hint; binary files get OpenHands' message.

Deliberate differences, for byte-exactness: the references rewrite the whole file with tabs
expanded; here only the replaced text changes (when a match needed tab expansion, the new
text's leading spaces are turned back into the file's tabs), and bytes that are not valid
UTF-8 survive an edit unchanged (decoded with surrogateescape).

**The host is protected from the sandbox**: every read is bounded in the container before
anything is sent — a ``view`` reads at most what it can show (a ``view_range`` is streamed
in the container and only the selected lines cross), edits read files up to
``MAX_EDIT_BYTES``, folder listings are bounded, FIFOs and devices are refused without
blocking, and paths that are not valid UTF-8 are answered with an error. Paths travel as
data (never inside a shell string). The undo history lives for one :class:`Editor` (one
episode).
"""

from __future__ import annotations

import json
import posixpath
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Protocol

SNIPPET_LINES = 4
MAX_RESPONSE_CHARS = 16_000
TRUNCATED_MESSAGE = (
    "<response clipped><NOTE>To save on context only part of this file has been shown to you. "
    "You should retry this tool after you have searched inside the file with `grep -n` in order "
    "to find the line numbers of what you are looking for.</NOTE>"
)
COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")
VIEW_READ_BYTES = 4 * MAX_RESPONSE_CHARS + 4
"""A view reads at most this many bytes: everything it can show (4 UTF-8 bytes a char)."""
MAX_EDIT_BYTES = 4 * 1024 * 1024
"""Files larger than this are not edited here (an edit holds the whole file on the host)."""
BINARY_SNIFF_BYTES = 8192
TAB = 8


class EditorFS(Protocol):
    """What the editor needs from a sandbox (``PodmanSandbox`` and the fake provide it)."""

    async def exec(self, command: str, *, timeout_s: float | None = None) -> Any: ...

    async def probe(self, path: str) -> tuple[str, int]: ...

    async def read_file(self, path: str, *, limit: int | None = None) -> bytes: ...

    async def read_lines(
        self, path: str, first: int, last: int, *, limit: int
    ) -> tuple[bytes, int, bool]: ...

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None: ...

    async def list_tree(self, path: str, depth: int = 2) -> list[str]: ...


class EditorError(Exception):
    """A usage error; its message is shown to the agent verbatim."""


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _printable(text: str) -> str:
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def clip(text: str, limit: int = MAX_RESPONSE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + TRUNCATED_MESSAGE


def cat_n(content: str, descriptor: str, init_line: int = 1, *, cut: bool = False) -> str:
    """The ``cat -n`` rendering the agent sees (clipped, tabs expanded). ``cut``: the text is
    a prefix of a longer file (the clip note is added whatever its length)."""
    content = content[:MAX_RESPONSE_CHARS] + TRUNCATED_MESSAGE if cut else clip(content)
    content = _printable(content).expandtabs(TAB)
    numbered = "\n".join(f"{i + init_line:6}\t{line}" for i, line in enumerate(content.split("\n")))
    return f"Here's the result of running `cat -n` on {descriptor}:\n{numbered}\n"


@dataclass(frozen=True, slots=True)
class _Doc:
    """A file as the editor edits it: text with ``\\n`` line ends, and how to write it back."""

    raw: bytes
    text: str
    crlf: bool

    def encode(self, text: str) -> bytes:
        return _encode(text.replace("\n", "\r\n") if self.crlf else text)


def _doc(raw: bytes) -> _Doc:
    text = _decode(raw)
    crlf = "\r\n" in text and text.count("\r\n") == text.count("\n")
    return _Doc(raw, text.replace("\r\n", "\n") if crlf else text, crlf)


class Editor:
    """One episode's editor: holds the per-file undo history."""

    def __init__(self, fs: EditorFS, *, cwd: str = "/workspace") -> None:
        self.fs = fs
        self.cwd = cwd
        """Fallback for the relative-path hint when the shell's folder cannot be read."""
        self.history: dict[str, list[bytes]] = defaultdict(list)

    async def __call__(
        self,
        *,
        command: str,
        path: str,
        file_text: str | None = None,
        view_range: Any = None,
        old_str: str | None = None,
        new_str: str | None = None,
        insert_line: Any = None,
    ) -> str:
        """Run one command; raise :class:`EditorError` with the agent-facing message."""
        if command not in COMMANDS:
            allowed = ", ".join(f'"{c}"' for c in COMMANDS)
            raise EditorError(
                f"Unrecognized command {command}. The allowed commands for the "
                f"str_replace_editor tool are: {allowed}"
            )
        _check_path_text(path)
        for name, value in (("file_text", file_text), ("old_str", old_str), ("new_str", new_str)):
            _check_text(name, value)
        kind, size = await self._validate_path(command, path)
        if command == "view":
            return await self._view(path, kind, size, view_range)
        if command == "create":
            if file_text is None:
                raise EditorError("Parameter `file_text` is required for command: create")
            return await self._create(path, file_text)
        if command == "str_replace":
            if old_str is None:
                raise EditorError("Parameter `old_str` is required for command: str_replace")
            return await self._str_replace(path, size, old_str, new_str or "")
        if command == "insert":
            if insert_line is None:
                raise EditorError("Parameter `insert_line` is required for command: insert")
            if new_str is None:
                raise EditorError("Parameter `new_str` is required for command: insert")
            return await self._insert(path, size, _as_int(insert_line), new_str)
        return await self._undo(path)

    async def _validate_path(self, command: str, path: str) -> tuple[str, int]:
        if not path.startswith("/"):
            suggested = posixpath.join(await self._shell_cwd(), path)
            raise EditorError(
                f"The path {path} is not an absolute path, it should start with `/`. "
                f"Maybe you meant {suggested}?"
            )
        kind, size = await self.fs.probe(path)
        if kind == "missing" and command != "create":
            raise EditorError(f"The path {path} does not exist. Please provide a valid path.")
        if kind != "missing" and command == "create":
            raise EditorError(
                f"File already exists at: {path}. Cannot overwrite files using command `create`."
            )
        if kind == "dir" and command != "view":
            raise EditorError(
                f"The path {path} is a directory and only the `view` command can be used on "
                "directories"
            )
        if kind not in ("missing", "file", "dir"):
            raise EditorError(
                f"The path {path} is a {kind}, not a regular file: only regular files and "
                "directories can be viewed or edited with this tool."
            )
        return kind, size

    async def _shell_cwd(self) -> str:
        """The current folder of the agent's shell (where a relative path would resolve)."""
        result = await self.fs.exec("pwd", timeout_s=5)
        cwd = (getattr(result, "stdout", "") or "").strip()
        ok = getattr(result, "exit_code", 1) == 0
        return cwd if ok and cwd.startswith("/") and "\n" not in cwd else self.cwd

    async def _read(self, path: str, limit: int) -> bytes:
        try:
            return await self.fs.read_file(path, limit=limit)
        except OSError as e:
            raise EditorError(f"Ran into {e} while trying to read {path}") from e

    async def _load(self, path: str, size: int) -> _Doc:
        """The whole file for an edit (bounded by ``MAX_EDIT_BYTES``)."""
        if size > MAX_EDIT_BYTES:
            raise _too_large(path, size)
        raw = await self._read(path, MAX_EDIT_BYTES + 1)
        if len(raw) > MAX_EDIT_BYTES:
            raise _too_large(path, len(raw))
        _refuse_binary(path, raw)
        return _doc(raw)

    async def _write(self, path: str, data: bytes) -> None:
        try:
            await self.fs.write_file(path, data)
        except OSError as e:
            raise EditorError(f"Ran into {e} while trying to write to {path}") from e

    # ---- view ---------------------------------------------------------------------------

    async def _view(self, path: str, kind: str, size: int, view_range: Any) -> str:
        if kind == "dir":
            if view_range:
                raise EditorError(
                    "The `view_range` parameter is not allowed when `path` points to a directory."
                )
            listing = "\n".join(await self.fs.list_tree(path, 2))
            return (
                f"Here's the files and directories up to 2 levels deep in {path}, excluding "
                f"hidden items:\n{_printable(clip(listing))}\n"
            )
        if not view_range:
            raw = await self._read(path, VIEW_READ_BYTES)
            _refuse_binary(path, raw)
            return cat_n(_doc(raw).text, path, cut=size > len(raw))
        first, last = _as_range(view_range)
        try:
            raw, n_lines, cut = await self.fs.read_lines(path, first, last, limit=VIEW_READ_BYTES)
        except OSError as e:
            raise EditorError(f"Ran into {e} while trying to read {path}") from e
        _check_range([first, last], n_lines)
        _refuse_binary(path, raw)
        stop = n_lines if last == -1 else last
        if stop < n_lines and raw.endswith(b"\n") and not cut:
            crlf = raw.endswith(b"\r\n") and raw.count(b"\r\n") == raw.count(b"\n")
            raw = raw[:-2] if crlf else raw[:-1]
        return cat_n(_decode(raw).replace("\r\n", "\n"), path, init_line=first, cut=cut)

    # ---- edits --------------------------------------------------------------------------

    async def _create(self, path: str, file_text: str) -> str:
        parent = posixpath.dirname(path)
        kind, _ = await self.fs.probe(parent)
        if kind != "dir":
            raise EditorError(
                f"The parent directory {parent} does not exist. Please create it first."
            )
        await self._write(path, _encode(file_text))
        self.history[path].append(_encode(file_text))
        return f"File created successfully at: {path}"

    async def _str_replace(self, path: str, size: int, old_str: str, new_str: str) -> str:
        doc = await self._load(path, size)
        content = doc.text
        old, new = _lf(old_str), _lf(new_str)
        found = _find(content, old)
        if found is None:
            raise EditorError(
                f"No replacement was performed, old_str `{old_str}` did not appear verbatim in "
                f"{path}."
            )
        if found.count > 1:
            raise EditorError(
                f"No replacement was performed. Multiple occurrences of old_str `{old_str}` in "
                f"lines {found.lines}. Please ensure it is unique"
            )
        if new == old:
            raise EditorError(
                f"No replacement was performed, old_str `{old_str}` is the same as new_str "
                f"`{new_str}`."
            )
        if found.expanded:
            new = _retab(new, content)
        new_content = content[: found.start] + new + content[found.end :]
        await self._write(path, doc.encode(new_content))
        self.history[path].append(doc.raw)
        line = content[: found.start].count("\n")
        start = max(1, line - SNIPPET_LINES)
        end = min(line + SNIPPET_LINES + new.count("\n"), len(new_content.splitlines()))
        snippet = "\n".join(new_content.split("\n")[start - 1 : end])
        return (
            f"The file {path} has been edited. "
            + cat_n(snippet, f"a snippet of {path}", start)
            + "Review the changes and make sure they are as expected. Edit the file again if "
            "necessary."
        )

    async def _insert(self, path: str, size: int, insert_line: int, new_str: str) -> str:
        doc = await self._load(path, size)
        lines = doc.text.split("\n")
        n_lines = len(lines)
        if insert_line < 0 or insert_line > n_lines:
            raise EditorError(
                f"Invalid `insert_line` parameter: {insert_line}. It should be within the range "
                f"of lines of the file: {[0, n_lines]}"
            )
        new_lines = _lf(new_str).split("\n")
        updated = "\n".join(lines[:insert_line] + new_lines + lines[insert_line:])
        await self._write(path, doc.encode(updated))
        self.history[path].append(doc.raw)
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
        await self._write(path, old)
        return f"Last edit to {path} undone successfully. {cat_n(_doc(old).text, path)}"


# ---- matching -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Match:
    start: int
    end: int
    """Span of the (single) occurrence in the file's text."""
    count: int
    lines: list[int]
    """Distinct 1-based lines where occurrences start."""
    expanded: bool
    """True when it matched only once tabs were expanded (as the references match)."""


def _find(content: str, old: str) -> _Match | None:
    count = content.count(old)
    if count:
        return _match(content, old, count, expanded=False)
    expanded, old_x = content.expandtabs(TAB), old.expandtabs(TAB)
    if old_x == old and expanded == content:
        return None
    count = expanded.count(old_x)
    if not count:
        return None
    match = _match(expanded, old_x, count, expanded=True)
    if count > 1:
        return match
    start = _raw_offset(content, expanded, match.start)
    end = _raw_offset(content, expanded, match.end)
    if start is None or end is None:
        return None  # the match cuts a tab in two: not a match of the file's text
    return _Match(start, end, 1, match.lines, True)


def _match(text: str, needle: str, count: int, *, expanded: bool) -> _Match:
    start = text.find(needle)
    if not needle:  # SWE-agent: an empty old_str occurs on every line
        return _Match(0, 0, count, list(range(1, text.count("\n") + 2)), expanded)
    lines = sorted({text.count("\n", 0, i) + 1 for i in _occurrences(text, needle)})
    return _Match(start, start + len(needle), count, lines, expanded)


def _occurrences(text: str, needle: str) -> list[int]:
    found, at = [], text.find(needle)
    while at != -1:
        found.append(at)
        at = text.find(needle, at + 1)
    return found


def _raw_offset(raw: str, expanded: str, offset: int) -> int | None:
    """The offset in ``raw`` of ``offset`` in ``raw.expandtabs()`` (None inside a tab)."""
    line_start_x = expanded.rfind("\n", 0, offset) + 1
    line_no = expanded.count("\n", 0, line_start_x)
    raw_line_start = 0
    for _ in range(line_no):
        raw_line_start = raw.index("\n", raw_line_start) + 1
    column, target = 0, offset - line_start_x
    i = raw_line_start
    while column < target:
        ch = raw[i]
        column = (column // TAB + 1) * TAB if ch == "\t" else column + 1
        i += 1
    return i if column == target else None


def _retab(new: str, content: str) -> str:
    """Leading spaces of ``new`` as the file's tabs (the agent copied them from ``view``)."""
    if not re.search(r"^\t", content, re.MULTILINE):
        return new
    out = []
    for line in new.split("\n"):
        spaces = len(line) - len(line.lstrip(" "))
        out.append("\t" * (spaces // TAB) + " " * (spaces % TAB) + line[spaces:])
    return "\n".join(out)


def _lf(text: str) -> str:
    return text.replace("\r\n", "\n")


# ---- parameters ------------------------------------------------------------------------------


def _as_int(value: Any) -> int:
    """An integer parameter; numeric strings are accepted (as SWE-agent's CLI does)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise EditorError(f"Invalid `insert_line` parameter: {value!r}. It should be an integer.")


def _as_range(value: Any) -> tuple[int, int]:
    bad = EditorError("Invalid `view_range`. It should be a list of two integers.")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = [v for v in re.split(r"[\s,]+", value.strip("[]() ")) if v]
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise bad
    numbers = []
    for item in value:
        if isinstance(item, int) and not isinstance(item, bool):
            numbers.append(item)
        elif isinstance(item, str) and re.fullmatch(r"\s*[+-]?\d+\s*", item):
            numbers.append(int(item))
        else:
            raise bad
    return numbers[0], numbers[1]


def _check_range(view_range: list[int], n_lines: int) -> None:
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


def _check_path_text(path: str) -> None:
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EditorError(
            f"The path {path!r} is not valid UTF-8 (a lone surrogate at position {e.start}). "
            "Please provide a valid path."
        ) from None
    if "\0" in path:
        raise EditorError(f"The path {path!r} contains a NUL byte. Please provide a valid path.")


def _check_text(name: str, value: str | None) -> None:
    if value is None:
        return
    try:
        _encode(value)
    except UnicodeEncodeError as e:
        raise EditorError(
            f"Parameter `{name}` is not valid text: a lone surrogate at position {e.start}."
        ) from None


def _refuse_binary(path: str, data: bytes) -> None:
    if b"\0" in data[:BINARY_SNIFF_BYTES]:
        raise EditorError(
            f"Invalid `path` parameter: {path}. File appears to be binary and this file type "
            "cannot be read or edited by this tool."
        )


def _too_large(path: str, size: int) -> EditorError:
    return EditorError(
        f"The file {path} is too large to edit with this tool ({size} bytes; the limit is "
        f"{MAX_EDIT_BYTES} bytes). Use `execute_bash` (e.g. `sed -i`) to change it."
    )
