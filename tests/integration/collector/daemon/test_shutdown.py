"""Shutdown and crash hygiene of ``sandpiper collect``, as real processes.

- ``kill -9`` of a collector that started its own vLLM server (multi-process mode, so the
  server has an engine-core child of its own): every process the collector started is gone
  within the lifeline's grace period, and the server's port is free.
- SIGTERM while another process holds the DuckDB store's lock (every store call waits for
  it, longer than the drain timeout): the collector exits within its drain timeout, one log
  line says what stays in the spool, the spool still holds those groups, and they commit
  once the lock is released.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from sandpiper.collector.sandbox.janitor import remove_containers
from tests.conftest import REPO
from tests.fixtures.vllm import free_port, tiny_model_copy

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _write_toml(path: Path, cfg: dict) -> Path:
    lines = [f"{k} = {json.dumps(v)}" for k, v in cfg.items() if not isinstance(v, dict)]
    for key, value in cfg.items():
        if isinstance(value, dict):
            lines.append(f"[{key}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in value.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _start(toml: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "sandpiper.cli", "collect", "--config", str(toml)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


def _descendants(root: int) -> list[int]:
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat[stat.rfind(")") + 2 :].split()[1])
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parent.items() if pp == pid]
        found += kids
        frontier += kids
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(pair.split("=", 1) for pair in pairs if "=" in pair)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "(gone)"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.long
def test_kill_9_leaves_no_server_or_other_child(sandbox_image, tmp_path):
    from sandpiper.collector.inference.lifeline import GRACE_S

    model = tiny_model_copy(tmp_path / "tiny-model")
    port = free_port()
    toml = _write_toml(
        tmp_path / "kill9.toml",
        {
            "name": "it-kill9",
            "runs_dir": str(tmp_path / "runs"),
            "store": {"url": f"duckdb:///{tmp_path / 'store.duckdb'}"},
            "sandbox": {"pool_size": 1, "memory_mb": 256, "workspace_size_mb": 64},
            # multi-process: the API server starts an engine-core process of its own
            "inference": {"base_port": port, "single_process": False, "max_model_len": 2048},
            "learner": {"model": str(model)},
            "collector": {
                "tasks": str(REPO / "tasks/demo.jsonl"),
                "group_size": 2, "max_turns": 2, "max_tokens_per_turn": 32,
                "max_concurrent_episodes": 2, "max_unconsumed_groups": 1000,
            },
        },
    )  # fmt: skip
    log = tmp_path / "collector.log"
    proc = _start(toml, log)
    left: list[int] = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"collector exited:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        else:
            raise AssertionError(f"vLLM never answered:\n{log.read_text()[-3000:]}")
        time.sleep(5.0)  # let it collect: sandbox shells and scoring children start too
        children = _descendants(proc.pid)
        names = {pid: _cmdline(pid) for pid in children}
        (wrapper,) = [pid for pid, c in names.items() if "lifeline.py" in c and "vllm" in c]
        # the API server and its engine-core process, both under the lifeline wrapper
        server_pids = _descendants(wrapper)
        assert len(server_pids) >= 2, names
        # vLLM's sockets and rendezvous file are in the server's own TMPDIR ...
        scratch = Path(_environ(server_pids[0])["TMPDIR"])
        assert scratch.name.startswith("sandpiper-tmp-"), scratch
        assert list(scratch.glob("vllm_dist_*")) and any(p.is_socket() for p in scratch.iterdir())
        # ... but its compiled kernels in the shared cache, where the next start finds them
        kernels = list(scratch.glob("torchinductor_*"))
        assert kernels and all(p.is_symlink() for p in kernels), list(scratch.iterdir())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + GRACE_S + 20
        while (left := [p for p in children if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], {p: names[p] for p in left}
        assert not _port_open(port)
        assert not scratch.exists()  # ... which went with the server
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in left:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        asyncio.run(remove_containers({"sandpiper.run": "it-kill9"}, state_dir=None))


HOLD_LOCK = textwrap.dedent(
    """
    import sys, time
    from sandpiper.store.locking import DuckDBFileLock
    with DuckDBFileLock(sys.argv[1], timeout_s=60).hold(write=True):
        print("held", flush=True)
        sys.stdin.read()  # until the test closes our stdin
    """
)


def test_sigterm_with_the_store_locked_stops_within_the_drain_timeout(
    vllm_server, sandbox_image, tmp_path
):
    from sandpiper.store import Store

    db = tmp_path / "store.duckdb"
    spool = tmp_path / "spool"
    drain_s = 8.0  # running groups get 6 s of it, the final commit 2 s (GROUPS_SHARE)
    toml = _write_toml(
        tmp_path / "locked.toml",
        {
            "name": "it-locked",
            "runs_dir": str(tmp_path / "runs"),
            # every store call waits up to 300 s for the lock: far past the drain timeout
            "store": {"url": f"duckdb:///{db}", "flush_interval_s": 0.2,
                      "lock_timeout_s": 300.0, "spool_dir": str(spool)},
            "sandbox": {"pool_size": 1, "memory_mb": 256, "workspace_size_mb": 64},
            "inference": {"server_urls": [vllm_server.url], "max_model_len": 2048},
            "learner": {"model": str(vllm_server.model_dir)},
            "collector": {
                "tasks": str(REPO / "tasks/demo.jsonl"), "host_id": "h1",
                "group_size": 2, "max_turns": 2, "max_tokens_per_turn": 32,
                "max_concurrent_episodes": 2, "max_unconsumed_groups": 1000,
                "policy_poll_s": 0.5, "drain_timeout_s": drain_s,
            },
        },
    )  # fmt: skip
    log = tmp_path / "collector.log"
    proc = _start(toml, log)
    holder = None
    try:
        store = Store(f"duckdb:///{db}")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"collector exited:\n{log.read_text()[-3000:]}"
            try:
                if store.claims.group_ids("it-locked"):
                    break
            except Exception:  # the collector holds the lock for a moment
                pass
            time.sleep(0.5)
        else:
            raise AssertionError(f"no group stored:\n{log.read_text()[-3000:]}")
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD_LOCK, str(db)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        own_spool = spool / "h1"
        deadline = time.monotonic() + 300
        while not list(own_spool.glob("*.group")) and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        assert list(own_spool.glob("*.group")), "no group waited in the spool"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=drain_s + 120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running:\n{log.read_text()[-4000:]}") from None
        elapsed = time.monotonic() - t0
        text = log.read_text()
        assert code == 0, text[-3000:]
        # the stop keeps to the drain timeout; closing the one sandbox container follows it
        assert elapsed < drain_s + 15, (elapsed, text[-3000:])
        spooled = sorted(own_spool.glob("*.group"))
        assert spooled, "the uncommitted groups must stay in the spool"
        said = [line for line in text.splitlines() if "not committed" in line]
        assert len(said) == 1 and str(own_spool) in said[0], said
        assert f"{len(spooled)} groups not committed" in said[0], (said, spooled)
    finally:
        if proc.poll() is None:
            proc.kill()
        if holder is not None:
            holder.communicate(timeout=30)  # closing its stdin releases the lock
        asyncio.run(remove_containers({"sandpiper.run": "it-locked"}, state_dir=None))
    # with the lock free, the spool commits: nothing acknowledged was lost
    before = set(store.claims.group_ids("it-locked"))
    with store.writer(spool_dir=str(own_spool), flush_interval_s=0.1) as writer:
        writer.flush(timeout_s=60)
    after = set(store.claims.group_ids("it-locked"))
    assert len(after - before) == len(spooled)
