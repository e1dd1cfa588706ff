"""str_replace_editor against the reference editors (SWE-agent's edit_anthropic, Anthropic's
text editor, OpenHands'), one test per behaviour, and the host-protection bounds: every read
is bounded in the sandbox before it reaches the host."""

from __future__ import annotations

import asyncio
import os

import pytest

from sandpiper.collector.episode.tools.editor import (
    MAX_EDIT_BYTES,
    TRUNCATED_MESSAGE,
    VIEW_READ_BYTES,
    Editor,
    EditorError,
)
from sandpiper.collector.sandbox.base import ExecOutcome, ExecResult
from sandpiper.collector.sandbox.supervisor import files as _supervisor_files


def run(coro):
    return asyncio.run(coro)


class Spy:
    """Wraps a sandbox and counts the file bytes that cross to the host."""

    def __init__(self, box) -> None:
        self.box, self.bytes_in = box, 0

    def __getattr__(self, name):
        return getattr(self.box, name)

    async def read_file(self, path, *, limit=None):
        data = await self.box.read_file(path, limit=limit)
        self.bytes_in += len(data)
        return data

    async def read_lines(self, path, first, last, *, limit):
        data, n, cut = await self.box.read_lines(path, first, last, limit=limit)
        self.bytes_in += len(data)
        return data, n, cut


@pytest.fixture
def editor(fake_sandbox):
    return Editor(fake_sandbox)


def test_tabs_view_and_match_alike_and_the_file_keeps_its_tabs(editor, fake_sandbox):
    path = "/workspace/m.py"
    fake_sandbox.host_path(path).write_bytes(b"def f():\n\tif x:\n\t\treturn 1\n\treturn 2\n")
    view = run(editor(command="view", path=path))
    assert "     3\t                return 1" in view  # tabs expanded in what is shown
    # old_str copied from the view (spaces) matches; the new line gets the file's tabs
    run(editor(command="str_replace", path=path, old_str="        if x:\n                return 1",
               new_str="        if y:\n                return 3"))  # fmt: skip
    assert fake_sandbox.host_path(path).read_bytes() == (
        b"def f():\n\tif y:\n\t\treturn 3\n\treturn 2\n"
    )
    # a verbatim old_str with tabs still matches as written
    run(editor(command="str_replace", path=path, old_str="\treturn 2", new_str="\treturn 4"))
    assert fake_sandbox.host_path(path).read_bytes().endswith(b"\treturn 4\n")


def test_crlf_is_viewed_and_matched_with_lf_and_kept_on_write(editor, fake_sandbox):
    path = "/workspace/w.txt"
    fake_sandbox.host_path(path).write_bytes(b"one\r\ntwo\r\nthree\r\n")
    view = run(editor(command="view", path=path))
    assert "\r" not in view and "     2\ttwo\n" in view
    assert "\r" not in run(editor(command="view", path=path, view_range=[1, 2]))
    run(editor(command="str_replace", path=path, old_str="one\ntwo", new_str="1\n2"))
    assert fake_sandbox.host_path(path).read_bytes() == b"1\r\n2\r\nthree\r\n"
    run(editor(command="insert", path=path, insert_line=1, new_str="a\nb"))
    assert fake_sandbox.host_path(path).read_bytes() == b"1\r\na\r\nb\r\n2\r\nthree\r\n"
    run(editor(command="undo_edit", path=path))
    assert fake_sandbox.host_path(path).read_bytes() == b"1\r\n2\r\nthree\r\n"


def test_numeric_strings_are_accepted_for_integer_parameters(editor, fake_sandbox):
    run(editor(command="create", path="/workspace/f", file_text="a\nb\nc"))
    expected = run(editor(command="view", path="/workspace/f", view_range=[2, 3]))
    for view_range in (["2", "3"], "[2, 3]", "2 3"):
        assert run(editor(command="view", path="/workspace/f", view_range=view_range)) == expected
    run(editor(command="insert", path="/workspace/f", insert_line="1", new_str="x"))
    assert fake_sandbox.host_path("/workspace/f").read_text() == "a\nx\nb\nc"
    with pytest.raises(EditorError, match=r"Invalid `view_range`\. It should be a list of two"):
        run(editor(command="view", path="/workspace/f", view_range=["a", "2"]))
    with pytest.raises(EditorError, match="Invalid `insert_line` parameter: 'one'"):
        run(editor(command="insert", path="/workspace/f", insert_line="one", new_str="x"))


def test_empty_old_str_as_swe_agent(editor, fake_sandbox):
    run(editor(command="create", path="/workspace/f", file_text="a\nb"))
    with pytest.raises(EditorError) as e:
        run(editor(command="str_replace", path="/workspace/f", old_str="", new_str="z"))
    assert str(e.value) == (
        "No replacement was performed. Multiple occurrences of old_str `` in lines [1, 2]. "
        "Please ensure it is unique"
    )
    fake_sandbox.host_path("/workspace/empty").write_bytes(b"")
    run(editor(command="str_replace", path="/workspace/empty", old_str="", new_str="hello"))
    assert fake_sandbox.host_path("/workspace/empty").read_text() == "hello"


def test_several_matches_list_distinct_lines(editor, fake_sandbox):
    run(editor(command="create", path="/workspace/f", file_text="x = x + 1\ny = 2\nx += x\n"))
    with pytest.raises(EditorError) as e:
        run(editor(command="str_replace", path="/workspace/f", old_str="x", new_str="z"))
    assert "Multiple occurrences of old_str `x` in lines [1, 3]. Please ensure" in str(e.value)


def test_relative_path_hint_uses_the_shells_current_folder(fake_sandbox):
    class InSrc:
        def __getattr__(self, name):
            return getattr(fake_sandbox, name)

        async def exec(self, command, **kwargs):
            assert command == "pwd"
            return ExecResult("/workspace/src\n", "", 0, ExecOutcome.OK, 0.1, 15, 0)

    with pytest.raises(EditorError) as e:
        run(Editor(InSrc())(command="view", path="pkg/a.py"))
    assert str(e.value) == (
        "The path pkg/a.py is not an absolute path, it should start with `/`. "
        "Maybe you meant /workspace/src/pkg/a.py?"
    )


def test_binary_files_get_openhands_message(editor, fake_sandbox):
    fake_sandbox.host_path("/workspace/blob").write_bytes(b"\x7fELF\x00\x01\x02\xff")
    for command, extra in (("view", {}), ("str_replace", {"old_str": "E", "new_str": "F"})):
        with pytest.raises(EditorError) as e:
            run(editor(command=command, path="/workspace/blob", **extra))
        assert str(e.value) == (
            "Invalid `path` parameter: /workspace/blob. File appears to be binary and this file "
            "type cannot be read or edited by this tool."
        )


def test_lone_surrogates_are_errors_not_exceptions(editor):
    with pytest.raises(EditorError, match="is not valid UTF-8"):
        run(editor(command="view", path="/workspace/\ud800"))
    with pytest.raises(EditorError, match="Parameter `file_text` is not valid text"):
        run(editor(command="create", path="/workspace/s", file_text="a\ud800"))


def test_fifos_and_devices_are_refused_without_blocking(editor, fake_sandbox):
    os.mkfifo(fake_sandbox.host_path("/workspace/pipe"))
    for command in ("view", "str_replace", "insert"):
        with pytest.raises(EditorError, match="is a fifo, not a regular file"):
            run(editor(command=command, path="/workspace/pipe", old_str="a", new_str="b",
                       insert_line=0))  # fmt: skip
    os.symlink("/dev/zero", fake_sandbox.host_path("/workspace/zero"))
    with pytest.raises(EditorError, match="is a character device"):
        run(editor(command="view", path="/workspace/zero"))
    with pytest.raises(OSError, match="not a regular file"):  # a race: swapped after probe
        run(fake_sandbox.read_file("/workspace/pipe", limit=10))


def test_views_read_only_what_they_show(fake_sandbox):
    spy = Spy(fake_sandbox)
    editor = Editor(spy)
    big = fake_sandbox.host_path("/workspace/big.log")
    with big.open("wb") as f:
        for i in range(300_000):  # ~6 MB
            f.write(f"line {i}\n".encode())
    out = run(editor(command="view", path="/workspace/big.log"))
    assert TRUNCATED_MESSAGE in out and spy.bytes_in <= VIEW_READ_BYTES
    spy.bytes_in = 0
    out = run(editor(command="view", path="/workspace/big.log", view_range=[299_999, -1]))
    assert out.endswith("299999\tline 299998\n300000\tline 299999\n300001\t\n")
    assert spy.bytes_in < 100  # only the selected lines crossed
    spy.bytes_in = 0
    with big.open("ab") as f:
        f.truncate(MAX_EDIT_BYTES + 1)
    with pytest.raises(EditorError, match="too large to edit"):
        run(editor(command="str_replace", path="/workspace/big.log", old_str="a", new_str="b"))
    assert spy.bytes_in == 0


def test_supervisor_listing_is_bounded_in_bytes(tmp_path):
    for i in range(1200):  # ~370 kB of names
        (tmp_path / (f"{i:04d}-" + "n" * 240)).mkdir()
    listing = _supervisor_files.list_tree({"path": str(tmp_path), "depth": 2})["paths"]
    assert 0 < sum(len(p) + 1 for p in listing) <= _supervisor_files.MAX_TREE_BYTES + 4096
    assert len(listing) < 1201


def test_a_lone_surrogate_through_the_toolbox_is_an_answer(fake_sandbox):
    from sandpiper.collector.episode.tools import Toolbox
    from sandpiper.store.records import ToolErrorKind

    toolbox = Toolbox(
        fake_sandbox, tests_dir=None, test_command=None, test_timeout_s=5, exec_timeout_s=5
    )
    result = run(toolbox.call("str_replace_editor", {"command": "view", "path": "/w/\ud800"}))
    assert result.error_kind is ToolErrorKind.TOOL_ERROR and "not valid UTF-8" in result.output
