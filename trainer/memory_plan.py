"""Memory planner: will this run fit on this GPU, before anything is loaded?

``sandpiper plan`` (and the start-up check of ``sandpiper learn`` / ``sandpiper collect``)
computes, per GPU and in bytes, what one learner rank holds at its peak and what a vLLM server
sharing the GPU takes, from the model's ``config.json`` and the run's config alone:

- **parameters** counted exactly by building the model on the meta device (no weights read),
  untied as the learner trains it (``checkpoint.untie_output_layer``: a tied model's output
  layer becomes its own matrix, so it counts twice what the published count says);
- **state** by precision and ZeRO stage, sharded as DeepSpeed 0.19 shards it over the
  ``world_size`` data-parallel ranks: stage 1 shards the fp32 master copy and Adam's two fp32
  moments, stage 2 also the gradients, stage 3 also the parameters; optimiser offload moves
  master and moments to host memory, parameter offload (stage 3) the parameters;
- **activations** of one micro-batch from what autograd saves in a Llama/Qwen decoder layer
  (:func:`layer_activation_bytes`, measured against ``saved_tensors_hooks`` and against peak
  memory on CPU, see ``tests/unit/trainer/test_memory_plan.py``), with and without gradient
  checkpointing;
- **the logprob step**: ``learner.logprob_chunk_tokens`` rows of logits at a time
  (``logprobs.selected_logprobs``), or full (tokens x vocabulary) logits for a model the
  chunked path does not support;
- **buffers**: DeepSpeed's gradient buckets (``reduce_bucket_size``, ``allgather_bucket_size``,
  ZeRO-3's live parameters), the optimiser step's temporaries, the CUDA context and an
  allocator fragmentation margin;
- **the vLLM share** when a server runs on the same GPU: ``gpu_memory_utilization`` x the GPU,
  split into weights (serving dtype), KV-cache tokens (``2 x layers x kv_heads x head_dim x
  dtype bytes`` each) and how many ``max_model_len`` sequences they hold.

Peak = state + gradients + the largest of (activations + logprob step, the gradient bucket, the
optimiser step's temporaries): activations are gone by the time gradients are bucketed and the
step runs. Gradients are counted whole through the forward pass because a step of several
micro-batches accumulates them.

This module imports only the standard library at the top (``sandpiper --help`` stays fast);
torch and transformers are imported inside :func:`model_shape`.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from sandpiper.errors import ConfigError

GIB = 1024**3

GPU_BYTES: dict[str, int] = {
    # Usable memory as torch reports it (``torch.cuda.get_device_properties(i).total_memory``,
    # printed by PyTorch's OutOfMemoryError as "GPU 0 has a total capacity of X GiB"), not the
    # marketing figure: H200 139.81 GiB (nvidia-smi: 143,771 MiB; PLATFORM.md: "about 139 GiB
    # usable"), H100 80 GB 79.11 GiB, A100 80 GB 79.15 GiB, L40S 44.39 GiB — the capacities in
    # public OOM reports from those GPUs (found through the project's code search).
    "h200": int(139.81 * GIB),
    "h100-80gb": int(79.11 * GIB),
    "a100-80gb": int(79.15 * GIB),
    "l40s": int(44.39 * GIB),
}

CUDA_CONTEXT_BYTES = GIB
"""The CUDA context, cuBLAS workspaces and NCCL buffers of one process: memory torch's
allocator never sees (typically 0.5-1 GiB on Hopper)."""
FRAGMENTATION = 0.05
"""Share of the learner's tensor bytes held back for the caching allocator's fragmentation."""
VLLM_OVERHEAD_BYTES = 2 * GIB
"""What a vLLM server spends inside its memory fraction besides weights and KV cache: its
profiling run's activations, CUDA graphs and sampler buffers (an estimate, not measured)."""

Precision = Literal["bf16", "fp32"]


class PlanError(ConfigError):
    """A model or setting the planner cannot size (unknown GPU name, config without the
    decoder's dimensions). Commands print it as one line."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder's dimensions and exact parameter counts (from its config.json)."""

    architecture: str
    params_published: int
    """Parameters as published (a tied embedding and output layer counted once)."""
    params_trained: int
    """Parameters the learner trains: the output layer untied from the embedding."""
    largest_param: int
    """Elements of the largest single parameter (the step's per-tensor temporaries)."""
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool
    """Per-head RMSNorm on queries and keys (Qwen3)."""
    max_position_embeddings: int


@functools.lru_cache(maxsize=16)
def _cached_shape(folder: str) -> ModelShape:
    return _build_shape(Path(folder))


SHIPPED_MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"
"""Published ``config.json`` files (no weights) of the models the shipped GPU configs name:
a hub id (``Qwen/Qwen2.5-7B-Instruct``) or a folder not yet imported (``runs/models/qwen3-4b``)
is sized from ``configs/models/<its last part, lower-cased>/``, as ``sandpiper config check``
validates it."""


def model_shape(model: str | Path) -> ModelShape:
    """The shape of the model whose ``config.json`` is ``model`` or is in folder ``model``
    (cached per folder: a meta build of a 4 B model takes seconds)."""
    path = Path(model)
    folder = path.parent if path.is_file() else path
    if not (folder / "config.json").is_file():
        folder = SHIPPED_MODELS / path.name.lower()
    if not (folder / "config.json").is_file():
        raise PlanError(
            f"{model}: no config.json to size the model from (nor a shipped one in {folder})"
        )
    return _cached_shape(str(folder.resolve()))


def _build_shape(folder: Path) -> ModelShape:
    """Built on the meta device (no memory, no weights) and untied exactly as
    ``checkpoint.untie_output_layer`` unties the learner's model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sandpiper.trainer.checkpoint import untie_output_layer

    config = AutoConfig.from_pretrained(str(folder))
    text = config.get_text_config()
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    published = sum(p.numel() for p in built.parameters())  # parameters() counts a tie once
    tied = bool(getattr(config, "tie_word_embeddings", False))  # before untying rewrites it
    untie_output_layer(built)
    trained = list(built.parameters())
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return ModelShape(
        architecture=(config.architectures or [type(built).__name__])[0],
        params_published=published,
        params_trained=sum(p.numel() for p in trained),
        largest_param=max(p.numel() for p in trained),
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        heads=text.num_attention_heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        head_dim=head_dim,
        vocab=text.vocab_size,
        tied=tied,
        qk_norm=any(name.endswith("self_attn.q_norm") for name, _ in built.named_modules()),
        max_position_embeddings=getattr(text, "max_position_embeddings", 0) or 0,
    )


def layer_activation_bytes(shape: ModelShape, act_bytes: int, *, packed: bool) -> int:
    """Bytes autograd saves per token in one decoder layer (transformers' Llama/Qwen2/Qwen3
    code, sdpa attention), written out from what each op keeps for its backward:

    - each RMSNorm (two per layer): its input in fp32 (``.to(float32)``: a copy in bf16, the
      input itself in fp32) and the normalised values in the activation dtype (for the weight
      multiply), ``4h + b h``; its output is saved by the projections that read it, ``b h``;
    - attention: the rotated queries and keys and the values (rotary embedding saves only its
      cos/sin, shared by all layers), the attention output (the kernels return it laid out so
      that o_proj's input is the same storage) and the log-sum-exp (fp32, one per head);
      packed rows carry a mask, which makes transformers repeat keys and values to all heads
      (no GQA in sdpa with a mask): ``4 b q`` instead of ``b (2 q + 2 kv)``;
    - Qwen3's per-head query/key norms: ``(4 + b) (q + kv)``;
    - the MLP: gate and up projections, the activation, and down_proj's input, ``4 b i``;
    - the two rsqrt values, fp32.

    Measured with ``torch.autograd.graph.saved_tensors_hooks`` on the tiny model (Qwen2, fp32
    and bf16, one sequence and packed): equal to the byte. The mask that packed rows need is
    extra (:func:`mask_bytes`)."""
    b, h, i = act_bytes, shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norms = 2 * (4 * h + 2 * b * h) + 2 * 4
    attention = (4 * b * q if packed else b * (2 * q + 2 * kv)) + 4 * shape.heads
    qk_norm = (4 + b) * (q + kv) if shape.qk_norm else 0
    return norms + attention + qk_norm + 4 * b * i


def mask_bytes(act_bytes: int, *, rows: int, row_tokens: int) -> tuple[int, int]:
    """(once per micro-batch, per layer) bytes of the attention mask of packed rows:
    transformers builds one boolean (rows, 1, L, L) block-causal mask from the restarting
    position ids, and sdpa converts it to the activation dtype in every layer and saves that
    copy for the backward (measured: a (1, 1, L, L) fp32 tensor per layer)."""
    square = rows * row_tokens * row_tokens
    return square, square * act_bytes


@dataclass(frozen=True, slots=True)
class LearnerSetup:
    """What the planner needs to know about one learner rank (from the run config)."""

    precision: Precision = "fp32"
    zero_stage: int = 0
    world_size: int = 1
    micro_batch_tokens: int = 4096
    row_tokens: int = 4096
    """Tokens of the longest row (``inference.max_model_len``: one sequence never splits)."""
    packed: bool = True
    """Rows hold several sequences (the usual case): a mask, and keys/values repeated."""
    gradient_checkpointing: bool = False
    logprob_chunk_tokens: int = 1024
    """``learner.logprob_chunk_tokens``; 0 = full (tokens x vocabulary) logits (the learner
    before chunking, and architectures ``logprobs.supports_chunked`` refuses)."""
    loss_token_fraction: float = 1.0
    """Share of a micro-batch's tokens that are in the loss (sampled tokens)."""
    offload_optimizer: bool = False
    offload_param: bool = False
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    stage3_max_live_parameters: int = 1_000_000_000
    device: Literal["cuda", "cpu"] = "cuda"


@dataclass(frozen=True, slots=True)
class VllmShare:
    """A vLLM server on the same GPU as the learner."""

    gpu_memory_utilization: float
    dtype_bytes: int = 2
    max_model_len: int = 4096
    servers: int = 1
    """Servers on this GPU (each takes its own fraction)."""
    tensor_parallel: int = 1
    """GPUs one server spans: each holds 1/tp of the weights and of every KV head set."""


@dataclass(slots=True)
class MemoryPlan:
    """Every term of one GPU's budget, in bytes, and whether it fits."""

    gpu: str
    gpu_bytes: int
    params_trained: int
    learner: dict[str, int] = field(default_factory=dict)
    """Per learner rank on this GPU: weights, master, gradients, optimizer, activations, ..."""
    host: dict[str, int] = field(default_factory=dict)
    """What offload puts in host memory instead (per rank)."""
    vllm: dict[str, int] = field(default_factory=dict)
    """The vLLM share (empty when no server shares the GPU)."""
    learner_peak: int = 0
    checkpointing: dict[str, dict[str, int]] = field(default_factory=dict)
    """Both sides of ``learner.gradient_checkpointing`` ("on", "off"): the micro-batch's
    ``activations``, the ``recompute_layer`` and the rank's ``peak``; the plan uses one."""
    vllm_bytes: int = 0
    total: int = 0
    fits: bool = False
    reasons: list[str] = field(default_factory=list)
    setup: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _logprob_bytes(shape: ModelShape, setup: LearnerSetup, b: int, tokens: int) -> int:
    """Peak of the logprob step beyond the decoder's activations."""
    v, n = shape.vocab, max(1, int(tokens * setup.loss_token_fraction))
    if setup.logprob_chunk_tokens:
        c = min(setup.logprob_chunk_tokens, n)
        # logprobs.selected_logprobs: the loss positions' hidden states (copied out, saved),
        # and one chunk at a time: its logits (b), their fp32 upcast (bf16 only) and
        # log-softmax, then in the backward (recomputed) that, the incoming gradient and
        # its own: 3 x c x V fp32 and the gradient of the bf16 logits
        return n * shape.hidden * b + c * v * (12 + (b if b != 4 else 0))
    # packed_logprobs: full logits (T x V), the loss rows copied out of them, upcast to fp32
    # for the cross-entropy, whose log-softmax (fp32) is saved; its backward holds that, the
    # incoming gradient and its own (3 x n x V fp32), then scatters into zeros of (T x V).
    forward = tokens * v * b + n * v * b + (n * v * 4 if b != 4 else 0) + n * v * 4
    backward = 3 * n * v * 4 + tokens * shape.hidden * b
    return max(forward, backward)


def learner_terms(shape: ModelShape, setup: LearnerSetup) -> tuple[dict[str, int], dict[str, int]]:
    """(on the GPU, in host memory) bytes of one learner rank at its peak, term by term."""
    n, w, stage = shape.params_trained, max(1, setup.world_size), setup.zero_stage
    b = 2 if setup.precision == "bf16" else 4
    shard = math.ceil(n / w)
    gpu: dict[str, int] = {}
    host: dict[str, int] = {}
    weights = (shard if stage == 3 else n) * b
    (host if setup.offload_param and stage == 3 else gpu)["weights"] = weights
    # a separate fp32 master copy: DeepSpeed's bf16 optimisers keep one, and ZeRO 1-3 clone
    # their fp32 partition even when the module is fp32 already
    master_elems = (shard if stage >= 1 else n) if (b != 4 or stage >= 1) else 0
    opt_elems = shard if stage >= 1 else n
    state_place = host if setup.offload_optimizer else gpu
    state_place["master_fp32"] = master_elems * 4
    state_place["optimizer_adam"] = opt_elems * 8  # exp_avg + exp_avg_sq, fp32
    grads = (shard if stage >= 2 else n) * b
    gpu["gradients"] = grads
    tokens = setup.micro_batch_tokens
    rows = max(1, tokens // max(1, setup.row_tokens))
    layer = layer_activation_bytes(shape, b, packed=setup.packed)
    mask_once, mask_layer = (
        mask_bytes(b, rows=rows, row_tokens=setup.row_tokens) if setup.packed else (0, 0)
    )
    final_norm = tokens * (4 * shape.hidden + b * shape.hidden)
    if setup.gradient_checkpointing:
        # each layer keeps only its input; the backward recomputes one layer (with its mask
        # copy) at a time, after the logprob step's backward is done
        acts = tokens * shape.layers * b * shape.hidden + final_norm + mask_once
        recompute = tokens * layer + mask_layer
    else:
        acts = tokens * shape.layers * layer + final_norm + mask_once + shape.layers * mask_layer
        recompute = 0
    gpu["recompute_layer"] = recompute
    gpu["activations"] = acts
    gpu["logprob_step"] = _logprob_bytes(shape, setup, b, tokens)
    # gradient buckets: stage 0 flattens up to reduce_bucket_size gradient elements at the
    # accumulation boundary (engine.allreduce_no_retain), stages 1-2 reduce through buckets of
    # reduce_bucket_size (two with overlap_comm), stage 3 also holds gathered live parameters
    bucket_elems = min(n, setup.reduce_bucket_size)
    buckets = bucket_elems * b * (2 if setup.overlap_comm and stage >= 1 else 1)
    if stage == 3:
        buckets += min(n, setup.stage3_max_live_parameters, setup.allgather_bucket_size) * b
    # AdamW's step: foreach on CUDA (one fp32 temporary the size of the rank's partition),
    # one parameter at a time on CPU; the bf16 optimisers also upcast the gradients to fp32
    step_elems = opt_elems if setup.device == "cuda" else shape.largest_param
    step_tmp = 0 if setup.offload_optimizer else step_elems * 4
    if b != 4 and not setup.offload_optimizer:
        step_tmp += opt_elems * 4
    gpu["grad_buckets"] = buckets
    gpu["optimizer_step_tmp"] = step_tmp
    return gpu, host


def learner_peak(gpu_terms: Mapping[str, int], device: str) -> int:
    """Peak bytes of one rank from :func:`learner_terms` (see the module docstring)."""
    resident = sum(
        gpu_terms.get(k, 0) for k in ("weights", "master_fp32", "optimizer_adam", "gradients")
    )
    working = gpu_terms["activations"] + max(
        gpu_terms["logprob_step"], gpu_terms.get("recompute_layer", 0)
    )
    transient = max(working, gpu_terms["grad_buckets"], gpu_terms["optimizer_step_tmp"])
    tensors = resident + transient
    if device != "cuda":
        return tensors
    return tensors + int(tensors * FRAGMENTATION) + CUDA_CONTEXT_BYTES


def vllm_terms(shape: ModelShape, share: VllmShare, gpu_bytes: int) -> dict[str, int]:
    """A vLLM server's share of a GPU: its fraction, its weights, KV cache and sequences."""
    budget = int(share.gpu_memory_utilization * gpu_bytes)
    tp = max(1, share.tensor_parallel)
    weights = shape.params_published * share.dtype_bytes // tp  # vLLM serves a tied model tied
    kv_heads = max(1, shape.kv_heads // tp)  # heads split over the server's GPUs (>= 1 each)
    kv_per_token = 2 * shape.layers * kv_heads * shape.head_dim * share.dtype_bytes
    kv = max(0, budget - weights - VLLM_OVERHEAD_BYTES)
    tokens = kv // kv_per_token
    return {
        "budget": budget * share.servers,
        "weights": weights,
        "overhead": VLLM_OVERHEAD_BYTES,
        "kv_cache": kv,
        "kv_bytes_per_token": kv_per_token,
        "kv_tokens": tokens,
        "concurrent_sequences": tokens // max(1, share.max_model_len),
        "servers": share.servers,
        "max_model_len": share.max_model_len,
    }


def plan(
    shape: ModelShape,
    setup: LearnerSetup,
    *,
    gpu: str,
    gpu_bytes: int,
    vllm: VllmShare | None = None,
    learner_ranks_on_gpu: int = 1,
) -> MemoryPlan:
    """The budget of one GPU that holds ``learner_ranks_on_gpu`` learner ranks (0 for an
    inference-only GPU) and, if ``vllm``, a vLLM server's share."""
    out = MemoryPlan(gpu=gpu, gpu_bytes=gpu_bytes, params_trained=shape.params_trained)
    out.setup = asdict(setup)
    if learner_ranks_on_gpu:
        out.learner, out.host = learner_terms(shape, setup)
        out.learner_peak = learner_ranks_on_gpu * learner_peak(out.learner, setup.device)
        for on in (True, False):
            terms = learner_terms(shape, replace(setup, gradient_checkpointing=on))[0]
            out.checkpointing["on" if on else "off"] = {
                "activations": terms["activations"],
                "recompute_layer": terms["recompute_layer"],
                "peak": learner_peak(terms, setup.device),
            }
    if vllm is not None:
        out.vllm = vllm_terms(shape, vllm, gpu_bytes)
        out.vllm_bytes = out.vllm["budget"]
        if out.vllm["concurrent_sequences"] < 1:
            out.reasons.append(
                f"vLLM at gpu_memory_utilization {vllm.gpu_memory_utilization} has room for "
                f"{out.vllm['kv_tokens']:,} KV tokens: not one sequence of "
                f"max_model_len {vllm.max_model_len}"
            )
    out.total = out.learner_peak + out.vllm_bytes
    if out.total > gpu_bytes:
        out.reasons.append(
            f"needs {out.total / GIB:.1f} GiB of {gpu_bytes / GIB:.1f} GiB "
            f"(learner {out.learner_peak / GIB:.1f}, vLLM {out.vllm_bytes / GIB:.1f})"
        )
    out.fits = not out.reasons
    return out


def gpu_bytes_of(name: str) -> tuple[str, int]:
    """``(name, bytes)`` of ``--gpu``: a known name (:data:`GPU_BYTES`) or ``NAME=GiB``."""
    key = name.strip().lower()
    if key in GPU_BYTES:
        return key, GPU_BYTES[key]
    label, eq, size = name.partition("=")
    try:
        if eq:
            return label.strip() or "gpu", int(float(size) * GIB)
    except ValueError:
        pass
    raise PlanError(
        f"--gpu {name!r}: give one of {', '.join(GPU_BYTES)} or NAME=GiB (e.g. a6000=47.4)"
    )


def ds_settings(path: str | Path) -> dict[str, Any]:
    """The parts of a DeepSpeed JSON the planner reads (ZeRO stage, precision, offload, buckets)."""
    config = json.loads(Path(path).read_text())
    zero = config.get("zero_optimization") or {}
    opt_off = (zero.get("offload_optimizer") or {}).get("device", "none")
    par_off = (zero.get("offload_param") or {}).get("device", "none")
    stage = int(zero.get("stage", 0))
    return {
        "zero_stage": stage,
        "bf16": (config.get("bf16") or {}).get("enabled", False) is True,  # "auto": the learner
        "offload_optimizer": opt_off not in (None, "none"),
        "offload_param": par_off not in (None, "none"),
        "reduce_bucket_size": int(zero.get("reduce_bucket_size", 5e8)),
        "allgather_bucket_size": int(zero.get("allgather_bucket_size", 5e8)),
        "overlap_comm": bool(zero.get("overlap_comm", stage == 3)),
        "stage3_max_live_parameters": int(zero.get("stage3_max_live_parameters", 1e9)),
    }
