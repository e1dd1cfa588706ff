"""Children die with their parent (``collector.inference.lifeline``), and a stop is not held by a thread
blocked in a call (``collector.daemon.shutdown``). Real processes, no services: an owner process is
killed with SIGKILL and every process its wrapped child started must be gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from sandpiper.collector.inference import lifeline
from tests.conftest import REPO

OWNER = textwrap.dedent(
    """
    import subprocess, sys, time
    from sandpiper.collector.inference import lifeline
    # a group member, one that leaves the group (setsid) and a Python that setsid()s itself
    script = (
        "sleep 1000 & echo $!; setsid sleep 1001 & echo $!; "
        "python3 -c 'import os, time; os.setsid(); print(os.getpid(), flush=True); "
        "time.sleep(1002)' & wait"
    )
    argv, fds = lifeline.wrap(["sh", "-c", script])
    proc = subprocess.Popen(argv, pass_fds=fds, start_new_session=True, stdout=sys.stdout)
    print(proc.pid, flush=True)
    time.sleep(1000)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_children_die_with_an_owner_killed_by_sigkill(tmp_path):
    out = tmp_path / "pids"
    with out.open("w") as f:
        owner = subprocess.Popen([sys.executable, "-c", OWNER], cwd=REPO, stdout=f)
    try:
        deadline = time.monotonic() + 30
        while len(out.read_text().split()) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(p) for p in out.read_text().split()]
        assert len(pids) == 4, out.read_text()
        assert all(_alive(p) for p in pids)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        # the wrapper asks the child to stop, waits GRACE_S at most, then SIGKILLs the rest
        assert _wait_gone(pids, lifeline.GRACE_S + 10) == []
    finally:
        if owner.poll() is None:
            owner.kill()
        for pid in [int(p) for p in out.read_text().split()]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


AGENT_OWNER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from sandpiper.collector.gateway.external import _run_agent
    out = Path(sys.argv[1])
    # an agent that starts a helper of its own and writes both pids
    agent = ["sh", "-c", f"sleep 1000 & echo $$ $! > {out}.tmp; mv {out}.tmp {out}; wait"]
    asyncio.run(_run_agent(agent, {"PATH": "/usr/bin:/bin"}, out.parent, out.parent / "log", 1000))
    """
)


def test_an_external_agent_dies_with_a_collector_killed_by_sigkill(tmp_path):
    """An ``agent_command`` agent (Codex, Claude Code, ...) runs under the lifeline too."""
    out = tmp_path / "agent-pids"
    owner = subprocess.Popen([sys.executable, "-c", AGENT_OWNER, str(out)], cwd=REPO)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(p) for p in out.read_text().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        assert _wait_gone(pids, lifeline.GRACE_S + 10) == []
    finally:
        if owner.poll() is None:
            owner.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_wrapper_reports_its_child_exit_status_and_passes_signals_on():
    argv, fds = lifeline.wrap(["sh", "-c", "exit 3"])
    assert subprocess.run(argv, pass_fds=fds, check=False).returncode == 3
    argv, fds = lifeline.wrap(["sh", "-c", "kill -9 $$"])
    assert subprocess.run(argv, pass_fds=fds, check=False).returncode == -signal.SIGKILL
    argv, fds = lifeline.wrap(["sleep", "100"])
    proc = subprocess.Popen(argv, pass_fds=fds, start_new_session=True)
    time.sleep(0.5)  # the child is started
    proc.terminate()  # the wrapper alone: it passes SIGTERM on to the child
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert lifeline.wrapped_command(argv) == ["sleep", "100"]
    assert lifeline.wrapped_command(["sleep", "100"]) is None


TMP_OWNER = textwrap.dedent(
    """
    import subprocess, sys, time
    from sandpiper.collector.inference import lifeline
    # what vLLM does: a socket-like file and a child that writes there too
    script = 'echo $TMPDIR; touch "$TMPDIR/ipc-socket"; sleep 1000 & wait'
    argv, fds = lifeline.wrap(["sh", "-c", script], private_tmp=True)
    subprocess.Popen(argv, pass_fds=fds, start_new_session=True, stdout=sys.stdout)
    time.sleep(1000)
    """
)


def _private_folders(base: Path) -> list[Path]:
    return list(base.glob("sandpiper-tmp-*"))


def test_a_private_tmp_goes_with_its_child_however_the_owner_ends(
    tmp_path, short_tmp_path, monkeypatch
):
    """vLLM leaves sockets and a rendezvous file in ``TMPDIR``: under ``private_tmp`` they live
    in a folder of the child's own, removed after a normal exit and after the owner's SIGKILL."""
    base = short_tmp_path  # a socket path must fit under it
    monkeypatch.setenv("TMPDIR", str(base))  # where the wrapper makes the child's folder
    argv, fds = lifeline.wrap(["sh", "-c", 'touch "$TMPDIR/x"; echo $TMPDIR'], private_tmp=True)
    assert lifeline.wrapped_command(argv) == ["sh", "-c", 'touch "$TMPDIR/x"; echo $TMPDIR']
    done = subprocess.run(argv, pass_fds=fds, capture_output=True, text=True, check=True)
    scratch = Path(done.stdout.strip())
    assert scratch.parent == base and scratch.name.startswith("sandpiper-tmp-")
    assert _private_folders(base) == []  # removed with the files the child left

    # torch's kernel cache stays shared, where the next start finds it: what the child
    # compiles into its temp folder's cache lands in the cache torch uses without a private
    # folder, and stays (a private copy made every vLLM start compile its kernels again)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setattr(tempfile, "tempdir", None)  # torch's rule, read under TMPDIR=base
    shared = Path(default_cache_dir())
    assert shared.parent == base
    compile_ = ["sh", "-c", f'touch "$TMPDIR/{shared.name}/kernel.so"']
    argv_compile, fds_compile = lifeline.wrap(compile_, private_tmp=True)
    subprocess.run(argv_compile, pass_fds=fds_compile, check=True)
    assert (shared / "kernel.so").is_file() and _private_folders(base) == []

    # a temp folder too long for a socket path inside it: the private folder goes to /tmp
    long = tmp_path / ("x" * 60)
    long.mkdir()
    env = {**os.environ, "TMPDIR": str(long)}
    done = subprocess.run(argv, pass_fds=fds, capture_output=True, text=True, check=True, env=env)
    assert Path(done.stdout.strip()).parent == Path("/tmp")
    assert not Path(done.stdout.strip()).exists()

    out = tmp_path / "owner.out"
    with out.open("w") as f:
        owner = subprocess.Popen([sys.executable, "-c", TMP_OWNER], cwd=REPO, stdout=f)
    try:
        deadline = time.monotonic() + 30
        while not any(p.glob("ipc-socket") for p in _private_folders(base)):
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + lifeline.GRACE_S + 10
        while _private_folders(base) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _private_folders(base) == []
        assert (shared / "kernel.so").is_file()  # the link went, not what it points to
    finally:
        if owner.poll() is None:
            owner.kill()


STUCK = textwrap.dedent(
    """
    import asyncio, threading, time
    from sandpiper.collector.daemon.shutdown import call_bounded, exit_now_if_stuck, run_process

    async def main(stop):
        # a store call started before the stop and blocked (a DuckDB lock held elsewhere)
        poll = asyncio.create_task(asyncio.to_thread(time.sleep, 1000))
        print("ready", flush=True)
        await stop.wait()
        poll.cancel()
        try:
            await call_bounded(time.sleep, 1000, timeout_s=0.5)  # the final, bounded call
        except TimeoutError:
            print("bounded", flush=True)
        return "done"

    print(run_process(main), flush=True)
    exit_now_if_stuck(0)
    """
)


def test_a_stop_is_not_held_by_calls_blocked_in_threads():
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        elapsed = time.monotonic() - t0
        assert proc.stdout.read().split() == ["bounded", "done"]
    finally:
        if proc.poll() is None:
            proc.kill()
    # the bounded call's 0.5 s and exit_now_if_stuck's 1 s wait for idle threads, not 1000 s
    assert elapsed < 10, elapsed


def test_close_writer_abandons_a_writer_that_holds_groups():
    from sandpiper.collector.daemon.shutdown import close_writer

    class Writer:
        spool = Path("/spool")
        closed = abandoned = False

        def abandon(self) -> int:
            self.abandoned = True
            return self._pending

        def __init__(self, pending: int) -> None:
            self._pending = pending

        def pending(self) -> int:
            return self._pending

        def close(self) -> None:
            self.closed = True

    holding, empty = Writer(2), Writer(0)
    close_writer(holding)
    close_writer(empty)
    assert not holding.closed and holding.abandoned and empty.closed and not empty.abandoned


def test_a_killed_child_not_yet_reaped_no_longer_runs():
    """An orphaned server is replaced as soon as it is dead; a zombie (killed, its parent
    not waiting yet) holds no port, so waiting for its process entry to vanish waited 10 s."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert lifeline.runs(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while lifeline.runs(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not lifeline.runs(child.pid)
        assert Path(f"/proc/{child.pid}").exists()  # a zombie: not reaped yet
    finally:
        child.kill()
        child.wait()
    assert not lifeline.runs(child.pid)
