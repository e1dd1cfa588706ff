"""VLLMServer supervision against a fake server process (no vLLM needed): start-up health
wait, version set, stop by process group, restart after death with the weights restored."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from sandpiper.collector.inference.vllm_server import OMP_SPIN_COUNT, VLLMServer
from sandpiper.config import InferenceConfig
from sandpiper.errors import InferenceError
from tests.fixtures.vllm import free_port

FAKE_SERVER = r"""
import http.server, json, subprocess, sys
port, calls_path, child_pid_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
child = subprocess.Popen(["sleep", "300"])  # stands in for vLLM's engine-core process
open(child_pid_path, "w").write(str(child.pid))

class Handler(http.server.BaseHTTPRequestHandler):
    def _reply(self):
        n = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        with open(calls_path, "a") as f:
            f.write(json.dumps([self.command, self.path, body]) + "\n")
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")
    do_GET = do_POST = _reply
    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


class FakeVLLMServer(VLLMServer):
    """Runs the fake instead of vLLM; ``workdir`` holds its call log and child pid."""

    workdir: Path = Path()
    crash: bool = False

    def command(self) -> list[str]:
        if self.crash:
            return [sys.executable, "-c", "import sys; print('boom: bad flag'); sys.exit(3)"]
        script = self.workdir / "fake_vllm.py"
        script.write_text(FAKE_SERVER)
        return [sys.executable, str(script), str(self.port), str(self.calls), str(self.child)]

    @property
    def calls(self) -> Path:
        return self.workdir / "calls.jsonl"

    @property
    def child(self) -> Path:
        return self.workdir / "child.pid"

    def posted(self) -> list[tuple[str, object]]:
        lines = self.calls.read_text().splitlines() if self.calls.exists() else []
        return [(path, body) for method, path, body in map(json.loads, lines) if method == "POST"]


def make_server(tmp_path: Path, **kwargs) -> FakeVLLMServer:
    server = FakeVLLMServer(
        model_dir=tmp_path / "model",
        port=free_port(),
        startup_timeout_s=30.0,
        log_path=tmp_path / "server.log",
        **kwargs,
    )
    server.workdir = tmp_path
    return server


def _tmpdir(monkeypatch, path: Path) -> None:
    """``TMPDIR`` for the servers' wrappers, and for this process (``tempfile`` caches it)."""
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child of an exited parent may linger as a zombie until reaped by init
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_command_line_has_the_flags_the_collector_relies_on() -> None:
    config = InferenceConfig(base_port=9000, max_model_len=1024, kv_cache_gib=2)
    server = VLLMServer.from_config(config, "/models/tiny", index=2)
    cmd = server.command()
    assert server.url == "http://127.0.0.1:9002"
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in [
        ("--model", "/models/tiny"),
        ("--max-model-len", "1024"),
        ("--dtype", "float32"),
        ("--logprobs-mode", "raw_logprobs"),
    ]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enable-scale-out" in cmd and "--enforce-eager" in cmd
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"  # single process
    multi = VLLMServer.from_config(config.model_copy(update={"single_process": False}), "/m")
    assert "--distributed-executor-backend" not in multi.command()


def test_environment_shortens_the_openmp_spin_unless_the_caller_chose_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = VLLMServer(model_dir=Path("/m"), port=9000, kv_cache_gib=3)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = server.environment()
    assert env["GOMP_SPINCOUNT"] == str(OMP_SPIN_COUNT)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_SERVER_DEV_MODE"] == "1"
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")  # the caller's choice is kept
    assert server.environment()["GOMP_SPINCOUNT"] == "300000"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # so is a wait policy (it sets the spin)
    assert "GOMP_SPINCOUNT" not in server.environment()


def test_start_sets_version_and_stop_kills_the_process_group(tmp_path: Path) -> None:
    with make_server(tmp_path, initial_version=3) as server:
        assert server.is_alive() and server.healthy()
        assert server.posted() == [("/update_weight_version", {"new_version": "3"})]
        assert server.version == 3
        child_pid = int(server.child.read_text())
        assert pid_alive(child_pid)
    assert not server.is_alive()
    assert wait_until(lambda: not pid_alive(child_pid)), "engine child survived stop()"


def test_dead_server_is_restarted_with_its_last_weights(
    tmp_path: Path, short_tmp_path: Path, monkeypatch
) -> None:
    base = short_tmp_path  # a socket path must fit under it
    _tmpdir(monkeypatch, base)
    server = make_server(tmp_path)
    server.start()
    try:
        server.record_weights(tmp_path / "policy-v7", 7)
        assert server.ensure_running() is False
        os.killpg(server.pid, signal.SIGKILL)
        assert wait_until(lambda: not server.is_alive())
        assert server.ensure_running() is True
        assert server.restarts == 1 and server.healthy()
        assert server.posted()[-2:] == [
            (
                "/collective_rpc",
                {
                    "method": "reload_weights",
                    "kwargs": {"weights_path": str(tmp_path / "policy-v7")},
                },
            ),
            ("/update_weight_version", {"new_version": "7"}),
        ]
        # the killed server's private TMPDIR was removed, the new one's is there
        (scratch,) = base.glob("sandpiper-tmp-*")
        assert scratch.name.startswith(f"sandpiper-tmp-{server.pid}-")
    finally:
        server.stop()
    assert list(base.glob("sandpiper-tmp-*")) == []


def test_server_that_dies_during_start_up_reports_its_log(tmp_path: Path) -> None:
    server = make_server(tmp_path)
    server.crash = True
    with pytest.raises(InferenceError, match=r"exited with 3(.|\n)*boom: bad flag"):
        server.start()
    assert not server.is_alive()


def test_from_config_uses_log_dir_and_server_args(tmp_path: Path) -> None:
    config = InferenceConfig(log_dir=str(tmp_path), server_args=["--max-num-seqs", "8"])
    server = VLLMServer.from_config(config, "/m", index=1)
    assert server.log_path == tmp_path / f"vllm-{config.base_port + 1}.log"
    assert server.command()[-2:] == ["--max-num-seqs", "8"]


def test_start_servers_starts_all_or_none(tmp_path: Path, monkeypatch) -> None:
    """The one launcher (collector and gateway): all servers healthy and supervised, logs in
    the given folder; one failing start stops the others through the exit stack."""
    import asyncio
    import contextlib

    from sandpiper.collector.inference.vllm_server import start_servers

    def fake_command(self: VLLMServer) -> list[str]:
        workdir = tmp_path / str(self.port)
        workdir.mkdir(exist_ok=True)
        script = workdir / "fake_vllm.py"
        script.write_text(FAKE_SERVER)
        if self.port == crash_port:
            return [sys.executable, "-c", "raise SystemExit(4)"]
        return [sys.executable, str(script), str(self.port), str(workdir / "c"), str(workdir / "p")]

    monkeypatch.setattr(VLLMServer, "command", fake_command)
    base = free_port()
    config = InferenceConfig(num_servers=2, base_port=base, startup_timeout_s=30.0)

    async def start(log_dir: Path | None = tmp_path) -> None:
        async with contextlib.AsyncExitStack() as stack:
            servers = await start_servers(config, tmp_path / "model", stack, log_dir=log_dir)
            assert [s.port for s in servers] == [base, base + 1]
            assert all(s.is_alive() and s.healthy() for s in servers)
            assert servers[1].log_path == tmp_path / f"vllm-{base + 1}.log"
            alive.extend(servers)
        assert not any(s.is_alive() for s in alive), "servers left running after the stack"

    crash_port, alive = -1, []
    asyncio.run(start())

    crash_port = base + 1
    with pytest.raises(InferenceError, match="exited with 4"):
        asyncio.run(start())
    healthy_child = int((tmp_path / str(base) / "p").read_text())
    assert wait_until(lambda: not pid_alive(healthy_child)), "the healthy server was left running"


def test_start_servers_prefers_the_configured_log_dir(tmp_path: Path, monkeypatch) -> None:
    """``inference.log_dir`` wins over the run's folder (it once did nothing in `collect`)."""
    import asyncio
    import contextlib

    from sandpiper.collector.inference.vllm_server import start_servers

    async def idle(self: VLLMServer) -> None:
        return None

    monkeypatch.setattr(VLLMServer, "start", lambda self: None)
    monkeypatch.setattr(VLLMServer, "stop", lambda self: None)
    monkeypatch.setattr(VLLMServer, "supervise", idle)

    async def log_paths(config: InferenceConfig) -> list[Path | None]:
        async with contextlib.AsyncExitStack() as stack:
            servers = await start_servers(config, "/m", stack, log_dir=tmp_path / "run")
            return [s.log_path for s in servers]

    base = InferenceConfig(num_servers=2)
    ports = [base.base_port, base.base_port + 1]
    assert asyncio.run(log_paths(base)) == [tmp_path / "run" / f"vllm-{p}.log" for p in ports]
    configured = base.model_copy(update={"log_dir": str(tmp_path / "logs")})
    assert asyncio.run(log_paths(configured)) == [
        tmp_path / "logs" / f"vllm-{p}.log" for p in ports
    ]


def test_server_left_by_a_crashed_owner_is_reaped_on_next_start(
    tmp_path: Path, short_tmp_path: Path, monkeypatch
) -> None:
    base = short_tmp_path  # a socket path must fit under it
    _tmpdir(monkeypatch, base)  # where the servers' private TMPDIRs go
    first = make_server(tmp_path)
    first.start()
    orphan_pid = first.pid
    assert orphan_pid is not None
    # the owner dies without stop(): a new owner starts the same server on the same port
    second = make_server(tmp_path)
    second.port = first.port
    try:
        (scratch,) = base.glob("sandpiper-tmp-*")  # the wrapper's private TMPDIR, named by its pid
        assert scratch.name.startswith(f"sandpiper-tmp-{orphan_pid}-")
        second.start()
        assert wait_until(lambda: not pid_alive(orphan_pid)), "orphan not reaped"
        assert second.is_alive() and second.healthy() and second.pid != orphan_pid
        assert tmp_path.joinpath("server.pid").read_text() == str(second.pid)
    finally:
        second.stop()
        first._proc = None  # already reaped; do not signal a recycled pid
    assert not tmp_path.joinpath("server.pid").exists()
    # the SIGKILLed orphan's private TMPDIR went with it, the stopped server's too
    assert list(base.glob("sandpiper-tmp-*")) == []
