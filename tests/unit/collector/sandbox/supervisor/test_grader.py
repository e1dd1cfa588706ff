"""The grader's file handling, on the host (no container needed): the workspace is made
plain (links, FIFOs and sockets refused, hard links broken) and the result file is read
without following links and with a size cap."""

from __future__ import annotations

import os
import socket

from sandpiper.collector.sandbox.supervisor import grader as _grader


def test_make_plain_refuses_links_fifos_sockets_and_breaks_hard_links(tmp_path):
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / "a.py").write_text("A")
    (ws / "b.txt").write_text("B")
    os.link(ws / "b.txt", ws / "hard.txt")
    (ws / "link").symlink_to("/etc/passwd")
    (ws / "dirlink").symlink_to(tmp_path)
    os.mkfifo(ws / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(ws / "sock"))
    sock.close()
    (ws / "sub").chmod(0o000)

    refused = _grader._make_plain(str(ws), os.getuid())

    assert sorted(refused) == ["dirlink", "fifo", "link", "sock"]
    assert sorted(os.listdir(ws)) == ["b.txt", "hard.txt", "sub"]
    assert os.stat(ws / "hard.txt").st_nlink == 1 and (ws / "hard.txt").read_text() == "B"
    assert (ws / "sub" / "a.py").read_text() == "A"  # a mode-000 folder is opened again


def test_copy_plain_copies_only_regular_files_and_folders(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_text("F")
    (src / "link").symlink_to(src / "d" / "f")
    os.mkfifo(src / "fifo")
    dest.mkdir()
    refused = _grader._copy_plain(str(src), str(dest))
    assert sorted(refused) == ["fifo", "link"]
    assert (dest / "d" / "f").read_text() == "F" and not (dest / "link").exists()


def test_read_result_no_links_no_huge_files(tmp_path):
    path = tmp_path / "result.json"
    assert _grader._read_result(str(path)) == (None, "the tests wrote no result file")
    path.write_text('{"reward": 1}')
    assert _grader._read_result(str(path)) == ('{"reward": 1}', None)
    path.unlink()
    (tmp_path / "elsewhere").write_text('{"reward": 1}')
    path.symlink_to(tmp_path / "elsewhere")
    text, error = _grader._read_result(str(path))
    assert text is None and "cannot be opened" in error
    path.unlink()
    os.mkfifo(path)
    assert _grader._read_result(str(path))[1] == "the result path is not a regular file"
    path.unlink()
    path.write_bytes(b" " * (_grader.MAX_RESULT_BYTES + 1))
    assert "exceeds" in _grader._read_result(str(path))[1]


def test_refused_names_are_bounded_and_valid_utf8():
    """The reply header is one line the host reads bounded: never every refused name."""
    names = [os.fsdecode(b"bad-\xff"), "\x1b]0;t\x07"] + [f"l{i:05d}" for i in range(30_000)]
    shown = _grader._shown(names)
    assert len(shown) == _grader.MAX_REFUSED_SHOWN
    assert shown[0] == "bad-\\xff" and shown[1] == "\x1b]0;t\x07"
    assert shown[-1] == f"... and {len(names) - _grader.MAX_REFUSED_SHOWN + 1} more"
    "".join(shown).encode("utf-8")  # no lone surrogates
    assert _grader._shown(["a", "b"]) == ["a", "b"]
