"""str_replace_editor semantics and messages (on the fake sandbox), byte-exact writes."""

from __future__ import annotations

import asyncio

import pytest

from sandpiper.collector.episode.tools.editor import TRUNCATED_MESSAGE, Editor, EditorError


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def editor(fake_sandbox):
    return Editor(fake_sandbox)


def test_create_view_and_refuse_overwrite(editor, fake_sandbox):
    out = run(editor(command="create", path="/workspace/a.py", file_text="a\nb\n"))
    assert out == "File created successfully at: /workspace/a.py"
    assert fake_sandbox.host_path("/workspace/a.py").read_bytes() == b"a\nb\n"
    view = run(editor(command="view", path="/workspace/a.py"))
    assert view == (
        "Here's the result of running `cat -n` on /workspace/a.py:\n"
        "     1\ta\n     2\tb\n     3\t\n"
    )
    with pytest.raises(EditorError, match=r"^File already exists at: /workspace/a.py\. Cannot"):
        run(editor(command="create", path="/workspace/a.py", file_text="x"))


def test_relative_path_and_missing_path(editor):
    with pytest.raises(EditorError) as e:
        run(editor(command="view", path="a.py"))
    assert str(e.value) == (
        "The path a.py is not an absolute path, it should start with `/`. "
        "Maybe you meant /workspace/a.py?"
    )
    with pytest.raises(EditorError, match="The path /workspace/nope does not exist"):
        run(editor(command="view", path="/workspace/nope"))
    with pytest.raises(EditorError, match="The parent directory /workspace/d does not exist"):
        run(editor(command="create", path="/workspace/d/x", file_text=""))


def test_str_replace_none_multiple_and_unique(editor, fake_sandbox):
    run(editor(command="create", path="/workspace/f", file_text="x = 1\ny = 2\nz = 3\nx = 1\n"))
    with pytest.raises(EditorError) as e:
        run(editor(command="str_replace", path="/workspace/f", old_str="q", new_str="r"))
    assert str(e.value) == (
        "No replacement was performed, old_str `q` did not appear verbatim in /workspace/f."
    )
    with pytest.raises(EditorError) as e:
        run(editor(command="str_replace", path="/workspace/f", old_str="x = 1", new_str="w"))
    assert str(e.value) == (
        "No replacement was performed. Multiple occurrences of old_str `x = 1` in lines [1, 4]. "
        "Please ensure it is unique"
    )
    out = run(editor(command="str_replace", path="/workspace/f", old_str="y = 2", new_str="y = 9"))
    assert out.startswith(
        "The file /workspace/f has been edited. Here's the result of running `cat -n` on a "
        "snippet of /workspace/f:\n"
    )
    assert "     2\ty = 9\n" in out
    assert out.endswith("Edit the file again if necessary.")
    assert fake_sandbox.host_path("/workspace/f").read_text() == "x = 1\ny = 9\nz = 3\nx = 1\n"


def test_insert_bounds_and_undo(editor, fake_sandbox):
    run(editor(command="create", path="/workspace/f", file_text="1\n2\n3"))
    with pytest.raises(EditorError) as e:
        run(editor(command="insert", path="/workspace/f", insert_line=5, new_str="x"))
    assert str(e.value) == (
        "Invalid `insert_line` parameter: 5. It should be within the range of lines of the "
        "file: [0, 3]"
    )
    run(editor(command="insert", path="/workspace/f", insert_line=0, new_str="top"))
    run(editor(command="insert", path="/workspace/f", insert_line=4, new_str="end"))
    assert fake_sandbox.host_path("/workspace/f").read_text() == "top\n1\n2\n3\nend"
    out = run(editor(command="undo_edit", path="/workspace/f"))
    assert out.startswith("Last edit to /workspace/f undone successfully.")
    assert fake_sandbox.host_path("/workspace/f").read_text() == "top\n1\n2\n3"
    run(editor(command="undo_edit", path="/workspace/f"))
    run(editor(command="undo_edit", path="/workspace/f"))  # the create itself
    fake_sandbox.host_path("/workspace/g").write_text("x")
    with pytest.raises(EditorError, match=r"^No edit history found for /workspace/g\.$"):
        run(editor(command="undo_edit", path="/workspace/g"))


def test_edits_are_byte_exact(editor, fake_sandbox):
    original = b"all:\n\tcc -o x x.c\r\nlatin1: \xe9\xff\n"
    fake_sandbox.host_path("/workspace/Makefile").write_bytes(original)
    run(editor(command="str_replace", path="/workspace/Makefile", old_str="cc", new_str="gcc"))
    assert fake_sandbox.host_path("/workspace/Makefile").read_bytes() == original.replace(
        b"cc -o", b"gcc -o"
    )
    run(editor(command="undo_edit", path="/workspace/Makefile"))
    assert fake_sandbox.host_path("/workspace/Makefile").read_bytes() == original


def test_view_range_validation(editor):
    run(editor(command="create", path="/workspace/f", file_text="a\nb\nc\nd"))
    out = run(editor(command="view", path="/workspace/f", view_range=[2, 3]))
    assert out.endswith("     2\tb\n     3\tc\n")
    assert run(editor(command="view", path="/workspace/f", view_range=[3, -1])).endswith(
        "     3\tc\n     4\td\n"
    )
    with pytest.raises(EditorError, match=r"Its first element `0` should be within the range"):
        run(editor(command="view", path="/workspace/f", view_range=[0, 2]))
    with pytest.raises(EditorError, match=r"Its second element `9` should be smaller"):
        run(editor(command="view", path="/workspace/f", view_range=[1, 9]))
    with pytest.raises(EditorError, match=r"should be larger or equal than its first `3`"):
        run(editor(command="view", path="/workspace/f", view_range=[3, 2]))


def test_directory_view_two_levels_without_hidden(editor, fake_sandbox):
    for rel in ("a/b/c/deep.txt", "a/top.txt", ".git/config", "a/.hidden"):
        path = fake_sandbox.host_path(f"/workspace/{rel}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    out = run(editor(command="view", path="/workspace"))
    assert out.startswith(
        "Here's the files and directories up to 2 levels deep in /workspace, excluding "
        "hidden items:\n"
    )
    listed = out.splitlines()[1:]
    assert "/workspace/a/b" in listed and "/workspace/a/top.txt" in listed
    assert not any("deep.txt" in p or ".git" in p or ".hidden" in p for p in listed)
    with pytest.raises(EditorError, match="only the `view` command can be used on directories"):
        run(editor(command="str_replace", path="/workspace/a", old_str="x", new_str="y"))


def test_long_file_is_clipped(editor, fake_sandbox):
    fake_sandbox.host_path("/workspace/big").write_text("line\n" * 10_000)
    out = run(editor(command="view", path="/workspace/big"))
    assert TRUNCATED_MESSAGE in out
    assert " 3200\tline" in out and " 3300\t" not in out  # 16,000 chars of content shown


def test_hostile_names_are_data(editor, fake_sandbox):
    name = "/workspace/it's $(touch pwned) `x`\nnew;line..txt"
    run(editor(command="create", path=name, file_text="ok"))
    assert fake_sandbox.host_path(name).read_text() == "ok"
    assert not any(p.name == "pwned" for p in fake_sandbox.root.rglob("*"))
    view = run(editor(command="view", path="/workspace"))
    assert "it's $(touch pwned)" in view
