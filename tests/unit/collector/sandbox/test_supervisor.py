"""The in-container shell (``collector/sandbox/supervisor/``) run locally: framing, capping,
state, timeouts; the folder stays standard-library only, and its mounted copy covers all of it.

It runs here as a plain subprocess (no container), started as the host starts it in a
sandbox (``python3 -I .../supervisor/__main__.py``), so nothing in these tests may ask it to
kill processes; it refuses ``kill -1`` outside a sandbox anyway (checked below).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile

import pytest

from sandpiper.collector.sandbox.base import ExecOutcome
from sandpiper.collector.sandbox.client import _exec_result
from sandpiper.collector.sandbox.isolation import SUPERVISOR_HOST_DIR

SUPERVISOR = [sys.executable, "-I", str(SUPERVISOR_HOST_DIR / "__main__.py")]
"""How the host starts it in a sandbox: isolated mode, no folder on ``sys.path``."""


class Shell:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(SUPERVISOR,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        assert json.loads(self.proc.stdout.readline())["ready"]

    def call(self, req: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        req["len"] = len(payload)
        self.proc.stdin.write(json.dumps(req).encode() + b"\n" + payload)
        self.proc.stdin.flush()
        header = json.loads(self.proc.stdout.readline())
        return header, self.proc.stdout.read(header["len"])

    def exec(self, command: str, timeout_s: float = 10, cap: int = 1000, **kw):
        req = {"op": "exec", "command": command, "timeout_s": timeout_s, "cap": cap, **kw}
        return _exec_result(*self.call(req))


@pytest.fixture
def shell():
    s = Shell()
    yield s
    s.proc.stdin.close()
    s.proc.wait(timeout=10)


def test_exit_status_and_streams(shell):
    r = shell.exec("echo out; echo err >&2; exit 7")
    assert (r.stdout, r.stderr, r.exit_code, r.outcome) == ("out\n", "err\n", 7, ExecOutcome.OK)


def test_cwd_and_environment_persist(shell, tmp_path):
    shell.exec(f"cd {tmp_path}; export A=1; B=two; unset HOME")
    r = shell.exec('pwd; echo "$A $B ${HOME-unset}"')
    assert r.stdout == f"{tmp_path}\n1 two unset\n"


def test_per_call_env_and_clean_env_do_not_persist(shell):
    assert shell.exec("echo $X", env={"X": "1"}).stdout == "1\n"
    assert shell.exec("echo ${X-none}").stdout == "none\n"
    shell.exec("export Y=agent")
    assert shell.exec("echo ${Y-none}", clean_env=True).stdout == "none\n"
    assert shell.exec("echo $Y").stdout == "agent\n"


def test_output_is_capped_with_head_tail_and_total(shell):
    r = shell.exec("printf 'HEAD'; head -c 5000000 /dev/zero | tr '\\0' x; printf 'TAIL'", cap=100)
    assert r.stdout_bytes_total == 5_000_008
    assert r.stdout.startswith("HEAD") and r.stdout.endswith("TAIL")
    assert "[... 4999908 bytes of output omitted ...]" in r.stdout


def test_timeout_kills_the_process_group(shell, tmp_path):
    marker = tmp_path / "survivor"
    r = shell.exec(f"(sleep 2; touch {marker}) & sleep 30", timeout_s=0.5)
    assert r.outcome is ExecOutcome.TIMED_OUT and r.exit_code is None
    assert r.duration_ms < 5000
    shell.exec("sleep 2.5")
    assert not marker.exists()


def test_background_process_does_not_block(shell):
    r = shell.exec("sleep 5 & echo started", timeout_s=10)
    assert r.stdout == "started\n" and r.duration_ms < 2000


def test_syntax_error_is_a_normal_result(shell):
    r = shell.exec("if then fi")
    assert r.outcome is ExecOutcome.OK and r.exit_code == 2 and "syntax error" in r.stderr
    assert shell.exec("echo still").stdout == "still\n"


def test_binary_files_round_trip(shell, tmp_path):
    data = bytes(range(256)) * 20_000  # 5 MB, every byte value
    path = str(tmp_path / "sub" / "blob.bin")
    assert shell.call({"op": "write", "path": path, "mode": 0o600}, data)[0] == {"len": 0}
    _header, back = shell.call({"op": "read", "path": path})
    assert back == data
    assert shell.call({"op": "read", "path": str(tmp_path / "nope")})[0]["error"] == (
        "FileNotFoundError"
    )


def test_untar_rejects_escapes(shell, tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escape")
        tar.addfile(info, io.BytesIO(b""))
    header, _ = shell.call({"op": "untar", "dest": str(tmp_path / "d")}, buf.getvalue())
    assert header["error"] == "ValueError" and not (tmp_path / "escape").exists()


def test_refuses_kill_all_outside_a_sandbox(shell):
    header, _ = shell.call({"op": "kill_all"})
    assert header["error"] == "RuntimeError"
    assert shell.exec("echo alive").stdout == "alive\n"


def test_line_range_reads_scan_a_bounded_amount(tmp_path, monkeypatch):
    """A sparse file of any size costs no space: a line-range read stops scanning it."""
    import errno

    from sandpiper.collector.sandbox.supervisor import files

    monkeypatch.setattr(files, "MAX_SCAN_BYTES", 1 << 20)
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(1 << 40)  # 1 TB
    with pytest.raises(OSError) as raised:
        files.read_lines({"path": str(sparse), "first": 1, "last": 2, "limit": 100})
    assert raised.value.errno == errno.EFBIG
    small = tmp_path / "small"
    small.write_bytes(b"a\nb\nc\n")
    req = {"path": str(small), "first": 2, "last": 2, "limit": 100}
    assert files.read_lines(req) == ({"n_lines": 4, "truncated": False}, b"b\n")


def test_listen_serves_one_peer_over_a_unix_socket_and_unlinks_it(tmp_path):
    """``--listen``: ready on stdout once the socket listens, the same framing over the
    socket, the socket file gone once the host is connected, and end-of-file ends the
    shell (the host's ``_kill_shell``)."""
    import socket

    path = tmp_path / "s"
    # stdin stays open, as the host's `podman exec` pipe does: at its end-of-file a shell
    # that is not connected yet exits (DEVNULL made this test race its own connect)
    proc = subprocess.Popen([*SUPERVISOR, "--listen", str(path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] and ready["socket"] == str(path)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(path))
        rfile, wfile = conn.makefile("rb"), conn.makefile("wb")
        req = {"op": "exec", "command": "echo hi; exit 3", "timeout_s": 10, "cap": 100, "len": 0}
        wfile.write(json.dumps(req).encode() + b"\n")
        wfile.flush()
        header = json.loads(rfile.readline())
        r = _exec_result(header, rfile.read(header["len"]))
        assert (r.stdout, r.exit_code) == ("hi\n", 3)
        assert not path.exists()  # nothing else can connect
        conn.shutdown(socket.SHUT_RDWR)
        conn.close()
        assert proc.wait(timeout=10) == 0
        assert proc.stdout.read() == b""  # the exec pipe carried nothing after ready
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()


def test_endless_writers_still_meet_the_deadline_and_the_drain(shell):
    """A writer as fast as the shell reads (``yes``) in the foreground is killed at its
    deadline; one left in the background after the command holds the pipes, and the shell
    still answers within its drain time."""
    import time

    started = time.monotonic()
    r = shell.exec("yes", timeout_s=1, cap=1000)
    assert r.outcome is ExecOutcome.TIMED_OUT and time.monotonic() - started < 5
    assert r.stdout_bytes_total > 1_000_000
    started = time.monotonic()
    # held by the writer, the call would last its whole timeout (10 s) and time out; the
    # drain takes 0.05 s, and the bound leaves room for a loaded machine (2 s failed once
    # beside a busy suite, with `yes` spinning on one of the two cores)
    r = shell.exec("yes > /dev/stdout & echo started", timeout_s=10, cap=1000)
    took = time.monotonic() - started
    assert r.outcome is ExecOutcome.OK and r.exit_code == 0 and "started" in r.stdout
    assert took < 6, took
    # the shell closed its end of the pipe: the background writer dies of SIGPIPE


def test_commands_start_from_the_launcher_not_from_the_shell(shell):
    """The command's parent is the launcher (a child of the shell), the same one each time."""
    shell_pid = str(shell.proc.pid)
    first = shell.exec("echo $PPID; ps -o ppid= -p $PPID").stdout.split()
    second = shell.exec("echo $PPID").stdout.split()
    assert first[1] == shell_pid and first[0] != shell_pid and second[0] == first[0]


def test_a_command_that_kills_the_launcher_is_reported_killed_and_the_next_one_runs(shell):
    r = shell.exec("kill -9 $PPID; echo after")
    assert r.exit_code == 137 and r.outcome is ExecOutcome.OK and r.stdout == "after\n"
    r = shell.exec("echo $PPID")
    assert r.ok and r.stdout.strip().isdigit()


def test_a_launcher_stopped_between_commands_is_replaced(shell):
    import time

    launcher = shell.exec("echo $PPID").stdout.strip()
    r = shell.exec(f"(sleep 0.2; kill -STOP {launcher}) >/dev/null 2>&1 &")
    assert r.ok
    time.sleep(0.5)
    started = time.monotonic()
    r = shell.exec("echo $PPID", timeout_s=5)
    assert r.ok and r.stdout.strip() != launcher and time.monotonic() - started < 1


def test_a_launcher_stopped_during_a_command_costs_that_command_its_deadline(shell):
    """The command stops its own launcher, which then cannot report its end: the command
    runs to its deadline, then the launcher is killed and the next command gets a new one."""
    import time

    started = time.monotonic()
    r = shell.exec("kill -STOP $PPID; echo stopped", timeout_s=1)
    assert r.outcome is ExecOutcome.TIMED_OUT and r.stdout == "stopped\n"
    assert time.monotonic() - started < 4
    assert shell.exec("echo ok").stdout == "ok\n"


def test_large_environments_and_every_byte_reach_the_launched_command(shell):
    """The request travels as one length-prefixed message: a 100 KB exported value (over a
    socket buffer's worth with the rest) and non-UTF-8 bytes arrive intact."""
    r = shell.exec("export BIG=$(head -c 100000 /dev/zero | tr '\\0' x); X=$'\\xff\\x01'")
    assert r.ok
    r = shell.exec('echo ${#BIG}; printf %s "$X" | od -An -tx1')
    assert r.stdout.split() == ["100000", "ff", "01"]


def test_a_launcher_whose_limits_the_agent_lowered_is_replaced(shell):
    """``prlimit`` works on a process of one's own uid: a launcher left without descriptors
    cannot take a command's pipes, so the command goes to a fresh launcher instead."""
    launcher = shell.exec("echo $PPID").stdout.strip()
    r = shell.exec(
        f"python3 -c 'import resource as r; r.prlimit({launcher}, r.RLIMIT_NOFILE, (3, 3))'"
    )
    assert r.ok, r
    r = shell.exec("echo $PPID")
    assert r.ok and r.stdout.strip() not in ("", launcher), r


def test_the_supervisor_imports_only_the_standard_library_and_its_own_modules():
    """The container has python3 and nothing else: every module of the folder imports the
    standard library or a sibling (relatively: ``supervisor`` in a sandbox)."""
    import ast

    siblings = {p.stem for p in SUPERVISOR_HOST_DIR.glob("*.py")}
    for path in sorted(SUPERVISOR_HOST_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [(node.module or "").split(".")[0]]
            elif isinstance(node, ast.ImportFrom):  # relative: a sibling of this folder
                names = []
                assert node.level == 1, (path.name, node.lineno)
                assert node.module is None or node.module in siblings, (path.name, node.module)
                assert node.module or {a.name for a in node.names} <= siblings, path.name
            else:
                continue
            outside = [n for n in names if n not in sys.stdlib_module_names]
            assert not outside, f"{path.name}:{node.lineno} imports {outside}"


def test_the_mounted_copy_holds_every_file_and_its_name_covers_them(tmp_path, monkeypatch):
    """``mounted_files`` copies the whole folder, and a change to any file (or a new file)
    names a new copy: no sandbox runs a mix of two versions."""
    from sandpiper.collector.sandbox import isolation

    monkeypatch.setattr(isolation, "MOUNTED_FILES_ROOT", tmp_path)
    ((inside, copy),) = isolation.mounted_files().items()
    assert inside == isolation.SUPERVISOR_DIR
    files = isolation.supervisor_files()
    assert {"__main__.py", "server.py", "grader.py"} <= set(files)
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == files
    assert copy.parent.name == isolation.content_digest(files)
    assert oct(copy.parent.stat().st_mode & 0o777) == "0o700"
    digests = {isolation.content_digest(files)}
    for name in files:
        changed = {**files, name: files[name] + b"\n"}
        digests.add(isolation.content_digest(changed))
    digests.add(isolation.content_digest({**files, "extra.py": b""}))
    assert len(digests) == len(files) + 2
