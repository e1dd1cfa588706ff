"""What both sides of the race (bench/race_bench.py) are given, and the check that it is equal.

One :class:`RaceSettings` holds every setting the two systems share (group size, samples per
step, learning rate, KL, token limits, sampling, budget). :func:`sandpiper_config` turns it
into the ``RunConfig`` that ``sandpiper collect`` + ``sandpiper learn`` read;
:func:`trl_config` into the keyword arguments of TRL's ``GRPOConfig``. Nothing else sets
those values, and :func:`fairness_rows` reads them back *from the two configs* (not from the
settings) and refuses a race where any differs: task ids, start checkpoint hash, sampling,
optimiser and limits.

The task suites are in bench/race_suites.py. The tasks and the start checkpoint are the
same for every race seed (``task_seed``); ``seed`` varies sampling and data order on both
sides.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from race_suites import REPO, RG_PREFIX, SUITES

MODELS = {"tiny": REPO / "runs" / "tiny-model", "smollm2": REPO / "runs" / "smollm2-135m"}


@dataclass(frozen=True, slots=True)
class RaceSettings:
    """Every setting both sides share. Names carry units."""

    model: str = "tiny"
    suite: str = "sum"
    minutes: float = 10.0
    """Wall-clock training budget of each side."""
    group_size: int = 8
    groups_per_step: int = 4
    """Samples per optimiser step = group_size * groups_per_step, on both sides."""
    lr: float = 3e-4
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    max_turns: int = 3
    max_tokens_per_turn: int = 72
    max_episode_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    train_tasks: int = 96
    heldout_tasks: int = 24
    eval_samples_per_task: int = 2
    eval_marks: int = 10
    """Evaluation points per side after the start (evenly spread over the budget; the
    bench's default is one a minute)."""
    seed: int = 0
    """The run's seed: sampling and data order on both sides (one race per seed)."""
    task_seed: int = 0
    """Seed of the tasks (and the warm start), the same for every race seed."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, not {self.model!r}")
        family = self.suite.removeprefix(RG_PREFIX)
        if self.suite not in SUITES and not (self.suite.startswith(RG_PREFIX) and family):
            raise ValueError(
                f"suite must be one of {', '.join(SUITES)} or {RG_PREFIX}FAMILY, not {self.suite!r}"
            )
        if self.minutes <= 0 or self.group_size < 2 or self.groups_per_step < 1:
            raise ValueError("minutes > 0, group_size >= 2 and groups_per_step >= 1 are needed")

    @property
    def samples_per_step(self) -> int:
        return self.group_size * self.groups_per_step

    @property
    def model_dir(self) -> Path:
        return MODELS[self.model]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


TOOL_LINE = '{{- "\\n" + (tool | tojson) -}}'
"""How the Hermes tool template (sandpiper/models/data, the tiny model's) renders one tool schema."""

CANONICAL_TOOL_LINE = (
    "{%- set fn = tool.function if tool.function is defined else tool -%}"
    "{%- set params = fn.parameters if fn.parameters is defined else {} -%}"
    "{%- set props = params.properties if params.properties is defined else {} -%}"
    '{{- "\\n{\\"type\\": \\"function\\", \\"function\\": {\\"name\\": " + (fn.name | tojson)'
    ' + ", \\"description\\": " + (fn.description | tojson)'
    ' + ", \\"parameters\\": {\\"type\\": \\"object\\", \\"properties\\": {" -}}'
    "{%- for name, prop in props.items() -%}"
    '{{- (name | tojson) + ": {\\"type\\": " + (prop.type | tojson) + "}"'
    ' + ("" if loop.last else ", ") -}}'
    "{%- endfor -%}"
    '{{- "}, \\"required\\": " + ((params.required if params.required is defined else [])'
    ' | tojson) + "}}}" -}}'
)
"""The same line rendering only what both sides' schemas share: name, description,
parameter names and types, required list. Sandpiper's ``brief`` schemas render exactly as
before (so a model warm-started on them sees the same text); a schema TRL derives from a
Python method (``transformers.utils.get_json_schema``: parameter descriptions, a ``return``
entry, no empty ``required``) renders to the same bytes. Without it the two sides' prompts
differ by a few dozen tokens, and a tiny model trained on one garbles its calls on the
other (measured: TRL's first steps made no parsable tool call)."""


def canonical_tool_template(template: str) -> str:
    """The chat template with :data:`CANONICAL_TOOL_LINE` for its tool line."""
    if TOOL_LINE not in template:
        raise ValueError("the chat template has no Hermes tool line to canonicalise")
    return template.replace(TOOL_LINE, CANONICAL_TOOL_LINE)


def model_hash(model_dir: str | Path) -> str:
    """SHA-256 of the checkpoint's weight files and chat template: the start both sides load."""
    digest = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors")) + sorted(
        Path(model_dir).glob("chat_template.jinja")
    )
    if not any(f.suffix == ".safetensors" for f in files):
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


# --- the two configs ---------------------------------------------------------------------


def sandpiper_config(
    settings: RaceSettings, *, start: Path, tasks: Path, runs_dir: Path, name: str
) -> Any:
    """The RunConfig of ``sandpiper collect`` + ``sandpiper learn`` (demo config + settings)."""
    from sandpiper.config import load_config

    base = REPO / "configs" / ("demo.toml" if settings.model == "tiny" else "demo-smollm2.toml")
    cfg = load_config(base, ["--runs_dir", str(runs_dir), "--name", name,
                             "--store.url", f"duckdb:///{runs_dir}/{name}/store.duckdb",
                             "--tracking.enabled", "false", "--seed", str(settings.seed)])  # fmt: skip
    c, le = cfg.collector, cfg.learner
    c.tasks, c.validation_fraction = str(tasks), 0.0
    c.tool_parser = "hermes"  # TRL's environment_factory needs tool calls in the template
    # TRL offers the tools with race_trl.SandboxEnv's docstrings, the brief descriptions
    # (configs/demo-smollm2.toml leaves the full ones: ~240 prompt tokens more on one side)
    c.tool_descriptions = "brief"
    c.group_size, c.max_turns = settings.group_size, settings.max_turns
    c.max_tokens_per_turn, c.max_episode_tokens = (
        settings.max_tokens_per_turn,
        settings.max_episode_tokens,
    )
    c.temperature, c.top_p = settings.temperature, settings.top_p
    le.model, le.lr, le.kl_coef = str(start), settings.lr, settings.kl_coef
    le.groups_per_step, le.max_grad_norm = settings.groups_per_step, settings.max_grad_norm
    le.weight_decay, le.eps_low, le.eps_high = (
        settings.weight_decay,
        settings.clip_eps_low,
        settings.clip_eps_high,
    )
    le.advantage, le.loss_agg, le.epochs, le.minibatches = "std", "token_mean", 1, 1
    le.max_steps = 0  # the wall-clock budget ends the run
    # its own port: another run on this machine (the demo, a test beside it) may hold the
    # default 8100, and the collector refuses a port in use (a CI run failed so)
    from race_eval import _free_port

    cfg.inference.base_port = _free_port()
    # every version stays on disk: the eval harness picks one per wall-clock mark (the bench
    # then deletes those no mark reads); weights only, as TRL saves them: a SmolLM2 training
    # state (fp32 weights and AdamW moments, 1.9 GB) with each of ~40 versions filled the disk
    le.checkpoint_retention = False
    le.save_train_state = False
    return cfg


TRL_GENERATION_PATHS = ("vllm-colocate", "vllm-server", "transformers", "vllm-async")
"""How TRL's side generates: vLLM in TRL's own process (``use_vllm=True,
vllm_mode="colocate"``), a ``trl vllm-serve`` server (``vllm_mode="server"``), transformers
``generate`` (``use_vllm=False``), or TRL's asynchronous trainer (``AsyncGRPOTrainer`` on a
vLLM server, bench/race_trl_async.py). docs/race.md, "TRL's generation path", says which ran
here."""

TRL_VLLM_DEFAULTS: dict[str, Any] = {
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None,
}
"""TRL 1.16's own defaults for its sampler-mismatch correction (``GRPOConfig``), spelled out so
that ``race.json`` records them; a unit test checks they are still TRL's defaults."""


def trl_shared_kwargs(settings: RaceSettings, *, output_dir: Path) -> dict[str, Any]:
    """The config fields both TRL trainers (GRPOTrainer, AsyncGRPOTrainer) take alike."""
    return {
        "output_dir": str(output_dir),
        "use_cpu": True,
        "num_generations": settings.group_size,
        "per_device_train_batch_size": settings.samples_per_step,
        "gradient_accumulation_steps": 1,
        "learning_rate": settings.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": settings.weight_decay,
        "max_grad_norm": settings.max_grad_norm,
        "epsilon": settings.clip_eps_low,
        "epsilon_high": settings.clip_eps_high,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "max_completion_length": settings.max_episode_tokens,
        "max_tool_calling_iterations": settings.max_turns - 1,
        "max_steps": 100_000,  # the wall-clock budget ends the run (a callback stops it)
        "save_strategy": "no",
        "logging_steps": 1,
        "report_to": [],
        "seed": settings.seed,
        "dataloader_num_workers": 0,
        **TRL_CPU_PRECISION,
    }


def trl_config(
    settings: RaceSettings, *, output_dir: Path, generation: str = "transformers"
) -> dict[str, Any]:
    """Keyword arguments of TRL's ``GRPOConfig`` for the same run.

    One generation batch = one optimiser step of ``samples_per_step`` rollouts (as one
    Sandpiper learner step); ``scale_rewards="group"`` and ``loss_type="dapo"`` (TRL's default:
    per-token mean over the generation batch) are Sandpiper's ``advantage="std"`` and
    ``loss_agg="token_mean"``; a constant learning rate as Sandpiper's learner.
    ``max_completion_length`` bounds the whole multi-turn completion (tool results included),
    as ``max_episode_tokens`` does. ``beta`` is ``kl_coef`` (0.0, TRL's default too). With
    vLLM, TRL keeps its own importance-sampling correction (:data:`TRL_VLLM_DEFAULTS`), as
    Sandpiper keeps its own (the learner's ``is_*`` defaults): neither is a shared setting."""
    if generation not in TRL_GENERATION_PATHS:
        raise ValueError(f"generation must be one of {', '.join(TRL_GENERATION_PATHS)}")
    if generation == "vllm-async":  # another trainer, another config class
        from race_trl_async import async_trl_config

        return async_trl_config(settings, output_dir=output_dir)
    kwargs: dict[str, Any] = {
        **trl_shared_kwargs(settings, output_dir=output_dir),
        "steps_per_generation": 1,
        "num_iterations": 1,
        "beta": settings.kl_coef,
        "scale_rewards": "group",
        "loss_type": "dapo",
        "use_vllm": generation != "transformers",
    }
    if generation != "transformers":
        kwargs["vllm_mode"] = generation.removeprefix("vllm-")
        kwargs.update(TRL_VLLM_DEFAULTS)
    return kwargs


TRL_CPU_PRECISION = {"bf16": False, "gradient_checkpointing": False}
"""Set on both TRL paths: GRPOConfig's own defaults are bf16 autocast and gradient
checkpointing on, which on this CPU make TRL's step 12 times slower (SmolLM2: 4.1 against
49.4 tokens/s, bench/learner_bench.py); fp32 without checkpointing is TRL's fastest here and
what Sandpiper's learner runs on CPU (``precision = "auto"``). Compared by the fairness rows."""


def learner_precision_on_cpu(learner: Any) -> str:
    """The precision Sandpiper's learner trains in on a CPU (``auto`` is fp32 there)."""
    return "fp32" if learner.precision == "auto" else learner.precision


# --- fairness ----------------------------------------------------------------------------

TRL_LOSS_AGG = {"dapo": "token_mean", "grpo": "sequence_mean"}
"""TRL's ``loss_type`` as Sandpiper's ``loss_agg``: ``dapo`` divides the summed token losses
by the generation batch's loss tokens (``num_items_in_batch``), as ``token_mean`` divides by
the optimiser minibatch's (one step = one batch on both sides); ``grpo`` averages each
sequence's tokens, then the sequences, as ``sequence_mean``."""


@dataclass(frozen=True, slots=True)
class FairnessRow:
    setting: str
    sandpiper: Any
    trl: Any

    @property
    def equal(self) -> bool:
        return self.sandpiper == self.trl


def fairness_rows(
    sp: Any,
    trl: dict[str, Any],
    *,
    sp_task_ids: list[str],
    trl_task_ids: list[str],
    sp_model_hash: str,
    trl_model_hash: str,
) -> list[FairnessRow]:
    """Each shared setting as each side's config holds it."""
    c, le = sp.collector, sp.learner
    rows = [
        ("train task ids", sp_task_ids, trl_task_ids),
        ("start checkpoint sha256", sp_model_hash, trl_model_hash),
        ("group size", c.group_size, trl["num_generations"]),
        ("samples per step", c.group_size * le.groups_per_step,
         trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"]),
        ("learning rate", le.lr, trl["learning_rate"]),
        ("lr schedule", "constant", trl["lr_scheduler_type"]),
        ("KL coefficient", le.kl_coef, trl["beta"]),
        ("clip eps low / high", (le.eps_low, le.eps_high), (trl["epsilon"], trl["epsilon_high"])),
        ("max grad norm", le.max_grad_norm, trl["max_grad_norm"]),
        ("weight decay", le.weight_decay, trl["weight_decay"]),
        ("advantage", "group std", {"group": "group std"}.get(trl["scale_rewards"])),
        ("loss aggregation", le.loss_agg, TRL_LOSS_AGG.get(trl["loss_type"])),
        ("updates per batch", le.epochs * le.minibatches, trl["num_iterations"]),
        ("temperature", c.temperature, trl["temperature"]),
        ("top_p", c.top_p, trl["top_p"]),
        ("max completion tokens", c.max_episode_tokens, trl["max_completion_length"]),
        ("max tool rounds", c.max_turns - 1, trl["max_tool_calling_iterations"]),
        ("seed", sp.seed, trl["seed"]),
        ("precision (CPU)", learner_precision_on_cpu(le),
         "bf16" if trl.get("bf16", True) else "fp32"),  # GRPOConfig's default: bf16
        ("gradient checkpointing", le.gradient_checkpointing,
         trl.get("gradient_checkpointing", True)),
    ]  # fmt: skip
    return [FairnessRow(*row) for row in rows]


class UnfairRace(ValueError):
    """The two sides would not get the same work."""


def check_fair(rows: list[FairnessRow]) -> None:
    """Raise :class:`UnfairRace` naming every setting that differs."""
    bad = [r for r in rows if not r.equal]
    if bad:
        raise UnfairRace(
            "; ".join(f"{r.setting}: sandpiper {r.sandpiper!r} != trl {r.trl!r}" for r in bad)
        )


def side_by_side(rows: list[FairnessRow]) -> str:
    """The configs as a plain table (task ids shortened to count + first/last)."""

    def show(value: Any) -> str:
        if isinstance(value, list) and len(value) > 3:
            return f"{len(value)} ids {value[0]}..{value[-1]}"
        return str(value)

    width = max(len(r.setting) for r in rows)
    lines = [f"{'setting':<{width}}  {'sandpiper':<32}  trl"]
    for r in rows:
        mark = "" if r.equal else "   <-- DIFFERS"
        lines.append(f"{r.setting:<{width}}  {show(r.sandpiper):<32}  {show(r.trl)}{mark}")
    return "\n".join(lines)


# --- levers: overrides on Sandpiper's side only -------------------------------------------


def with_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Sandpiper's config with ``KEY=VALUE`` overrides (``learner.max_lag=3``) applied
    through its own loader: the resolved config as TOML plus dotted overrides, so the
    values are parsed, validated and explained as ``--part.field VALUE`` on the CLI."""
    if not overrides:
        return cfg
    import tempfile

    from sandpiper.config import load_config
    from sandpiper.config.loading import to_toml

    args = []
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--sandpiper-set takes KEY=VALUE (learner.max_lag=3), not {item!r}")
        args.append(f"--{key.strip()}={value}")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "race-sandpiper.toml"
        path.write_text(to_toml(cfg))
        return load_config(path, args)


def refuse_shared_overrides(
    before: list[FairnessRow], after: list[FairnessRow], overrides: list[str]
) -> None:
    """Raise :class:`UnfairRace` (one line) when an override moved a shared race setting:
    those reach both sides through :class:`RaceSettings`, never one side alone."""
    changed = [a.setting for a, b in zip(before, after, strict=True) if a.sandpiper != b.sandpiper]
    if changed:
        raise UnfairRace(
            f"--sandpiper-set {' '.join(overrides)} changes what both sides share "
            f"({', '.join(changed)}); the race sets those for both sides, not one"
        )
