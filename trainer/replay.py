"""``sandpiper replay``: compare loss / correction configurations on the batches a run trained
on, without training.

For each learner step of a run the store knows which groups it consumed
(``group_states.consumed_by_step``) and which policy it started from (the checkpoint of
version ``step - 1``). Replay reloads that policy, rebuilds the step's sequences exactly as
the learner did (same groups, same packing, sampler logprobs from the store) and, for every
*variant* (a set of ``LearnerConfig`` loss fields over the run's own config), computes the
gradient the first optimiser pass would have taken, micro-batch by micro-batch. Per step and
variant it reports:

- ``ess``: effective sample size ``(sum w)^2 / (n sum w^2)`` of the weights the loss applied
  (0 for masked / rejected tokens); ``ess_raw`` of the raw weights ``pi_prox / pi_behav``;
- ``masked_frac``: loss tokens that got no gradient (IS mask, rejection, M2PO);
  ``truncated_frac``: weights truncated at ``is_cap``; ``clipped_frac``: PPO/CISPO ratio clip
  (0 on a step's first pass, where the ratio is 1: shown for completeness);
- ``grad_norm`` of the summed gradient ``G``; ``grad_var``: ``(1/M) sum_j ||M g_j - G||^2``
  over the ``M`` micro-batches (each scaled to estimate ``G``), and ``grad_rel_var`` =
  ``grad_var / ||G||^2``;
- ``cos_ref``: cosine between ``G`` and the gradient of the *reference*: token-level,
  untruncated importance weights with the run's advantages and aggregation, the unbiased
  estimate of the on-policy gradient.

Memory: one flat float64 gradient per variant (plus the reference) is held at a time, i.e.
``(variants + 1) * parameters * 8`` bytes; fine for small models, heavy for large ones
(replay fewer variants at once). See docs/replay.md for how to read the table.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sandpiper.config import LearnerConfig
from sandpiper.config.loading import _parse_value
from sandpiper.errors import ConfigError, LearnerError
from sandpiper.store.records import TrainGroup
from sandpiper.trainer.advantages import batch_advantages
from sandpiper.trainer.engine import World
from sandpiper.trainer.loss import LossConfig, LossStats, grpo_loss
from sandpiper.trainer.optimise import shard
from sandpiper.trainer.packing import (
    MicroBatch,
    TrainSequence,
    pack_rows,
    packed_logprobs,
    plan_rows,
    token_scales,
)

VARIANT_FIELDS = frozenset(
    {"objective", "eps_low", "eps_high", "is_level", "is_mode", "is_cap", "is_lo", "is_hi",
     "reject", "reject_level", "reject_lo", "reject_hi", "m2po_tau", "kl_coef",
     "kl_is_correction", "advantage", "adv_eps", "loss_agg", "loss_constant"}
)  # fmt: skip
"""``LearnerConfig`` fields a variant may set (the ones that change the loss, not training)."""

REFERENCE = "reference"
"""Name of the built-in unbiased estimator every variant is compared with."""

DEFAULT_VARIANTS = (
    "as-run:",
    "no-correction: is_mode='none'",
    "tis-token-2: is_mode='truncate' is_level='token' is_cap=2.0",
    "icepop-token: is_mode='mask' is_level='token' is_lo=0.5 is_hi=2.0",
    "tis-seq-mean-2: is_mode='truncate' is_level='sequence_mean' is_cap=2.0",
    "gspo: objective='gspo' eps_low=3e-4 eps_high=4e-4 loss_agg='sequence_mean'",
    "cispo: objective='cispo' eps_low=1.0 eps_high=4.0",
    "reject-seq-mean-k3: reject='k3' reject_level='sequence_mean' reject_hi=0.01",
    "reject-token-k1: reject='k1' reject_level='token' reject_lo=-0.69 reject_hi=0.69",
    "m2po-0.04: m2po_tau=0.04 is_mode='none'",
    "batch-std: advantage='batch_std'",
)
"""What ``sandpiper replay`` compares when no ``--variant`` is given."""

METRICS = ("ess", "ess_raw", "masked_frac", "truncated_frac", "clipped_frac", "grad_norm",
           "grad_var", "grad_rel_var", "cos_ref", "loss")  # fmt: skip
"""The per-(step, variant) figures, in table order."""


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    overrides: dict[str, Any]
    learner: LearnerConfig


@dataclass(slots=True)
class ReplayResult:
    """Everything ``sandpiper replay`` prints, plots and logs."""

    run_id: str
    variants: list[dict[str, Any]]
    """``{"name", "overrides"}`` per variant (the reference first)."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """One per (learner step, variant): ``step``, ``variant``, ``tokens``, ``micro_batches``
    and :data:`METRICS`."""
    skipped: list[dict[str, Any]] = field(default_factory=list)
    """Steps that could not be replayed: ``{"step", "reason"}``."""

    def summary(self) -> list[dict[str, Any]]:
        """Per variant: the mean of each metric over the replayed steps (in variant order)."""
        out = []
        for v in self.variants:
            rows = [r for r in self.rows if r["variant"] == v["name"]]
            if not rows:
                continue
            row: dict[str, Any] = {"variant": v["name"], "steps": len(rows)}
            for m in METRICS:
                vals = [r[m] for r in rows if r[m] is not None and math.isfinite(r[m])]
                row[m] = float(np.mean(vals)) if vals else None
            out.append(row)
        return out

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "summary": self.summary()}, indent=1)


def parse_variant(spec: str, base: LearnerConfig) -> Variant:
    """``"name: key=value key=value"`` (values are TOML literals) over ``base``."""
    name, colon, rest = spec.partition(":")
    name = name.strip()
    if not colon or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ConfigError(
            f"variant {spec!r}: expected 'name: field=value ...' with a name of letters, "
            "digits, '_', '-', '.'"
        )
    overrides: dict[str, Any] = {}
    for item in rest.split():
        key, eq, value = item.partition("=")
        if not eq or key not in VARIANT_FIELDS:
            raise ConfigError(
                f"variant {name!r}: {item!r} is not field=value with a field among "
                f"{', '.join(sorted(VARIANT_FIELDS))}"
            )
        overrides[key] = _parse_value(value)
    try:
        learner = LearnerConfig.model_validate({**base.model_dump(), **overrides})
    except ValueError as e:
        raise ConfigError(f"variant {name!r}: {e}") from None
    return Variant(name, overrides, learner)


def reference_variant(base: LearnerConfig) -> Variant:
    """Token-level, untruncated IS over the run's advantages and aggregation: unbiased."""
    overrides = {"objective": "ppo", "is_level": "token", "is_mode": "truncate",
                 "is_cap": math.inf, "reject": "none", "m2po_tau": 0.0}  # fmt: skip
    return Variant(REFERENCE, overrides, base.model_copy(update=overrides))


# ---- one step -----------------------------------------------------------------------------


def sequences(
    groups: Sequence[TrainGroup], learner: LearnerConfig, version: int
) -> list[TrainSequence]:
    """The step's sequences as the learner builds them (advantage per ``learner``)."""
    adv = batch_advantages(groups, mode=learner.advantage, eps=learner.adv_eps)
    by_id = {g.group_id: g for g in groups}
    out = []
    for kept in adv.kept:
        group = by_id[kept.group_id]
        for episode, a in zip(group.episodes, kept.advantages_G, strict=True):
            if a is None or not episode.loss_mask_T[1:].any():
                continue
            out.append(TrainSequence(
                episode.episode_id, episode.token_ids_T, episode.loss_mask_T,
                episode.behaviour_logprobs_T, a, version - group.min_policy_version,
            ))  # fmt: skip
    return out


def pack_step(
    seqs: Sequence[TrainSequence], learner: LearnerConfig, micro_batch_tokens: int
) -> list[MicroBatch]:
    """Micro-batches of one minibatch holding the whole step (``minibatches = 1``)."""
    scales = token_scales(
        seqs, mode=learner.loss_agg, total_loss_tokens=sum(s.loss_tokens for s in seqs),
        total_seqs=len(seqs), constant=learner.loss_constant,
    )  # fmt: skip
    # The learner's order (optimise.build_minibatch on one rank): same micro-batches.
    one = World(0, 1, torch.device("cpu"))
    pairs = shard(list(zip(seqs, scales, strict=True)), [len(s.token_ids_T) for s in seqs], one)
    plan = plan_rows([len(s.token_ids_T) for s, _ in pairs], micro_batch_tokens)
    return [pack_rows([[pairs[i] for i in row] for row in rows]) for rows in plan]


@dataclass(slots=True)
class _Acc:
    """Running sums of one variant over a step's micro-batches."""

    total: torch.Tensor
    sq_norms: float = 0.0
    loss: float = 0.0
    stats: LossStats = field(default_factory=LossStats)


def replay_step(
    model: torch.nn.Module,
    groups: Sequence[TrainGroup],
    version: int,
    variants: Sequence[Variant],
    *,
    micro_batch_tokens: int,
    ref_model: torch.nn.Module | None = None,
) -> list[dict[str, Any]]:
    """Rows (one per variant) for one step; ``variants[0]`` is the cosine reference."""
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    packed = []
    for v in variants:
        seqs = sequences(groups, v.learner, version)
        packed.append(pack_step(seqs, v.learner, micro_batch_tokens) if seqs else [])
    if not packed[0]:
        return []
    layout = [m.input_ids for m in packed[0]]
    for v, micros in zip(variants, packed, strict=True):  # same sequences, same packing
        if [m.input_ids.shape for m in micros] != [t.shape for t in layout] or not all(
            torch.equal(a.input_ids, b) for a, b in zip(micros, layout, strict=True)
        ):
            raise LearnerError(f"variant {v.name}: packing differs from the reference's")
    accs = [_Acc(torch.zeros(n_params, dtype=torch.float64)) for _ in variants]
    model.eval()  # no dropout: the gradient is a function of the data alone
    for j, micro in enumerate(packed[0]):
        logp_T = packed_logprobs(model, micro)
        ref_T = None
        if ref_model is not None:
            with torch.no_grad():
                ref_T = packed_logprobs(ref_model, micro)
        for v, micros, acc in zip(variants, packed, accs, strict=True):
            mb = micros[j]
            loss, stats = grpo_loss(
                logp_T, logp_T.detach(), mb.logp_behav_T, mb.advantages_T, mb.loss_mask_T,
                mb.token_scale_T, mb.seq_index_T, mb.num_seqs, LossConfig.from_learner(v.learner),
                ref_T,
            )  # fmt: skip
            grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            g = torch.cat([
                (gr if gr is not None else torch.zeros_like(p)).reshape(-1).double()
                for gr, p in zip(grads, params, strict=True)
            ])  # fmt: skip
            acc.total += g
            acc.sq_norms += float(g @ g)
            acc.loss += float(loss.detach())
            acc.stats = acc.stats + stats
        del logp_T
    m = len(packed[0])
    ref_total = accs[0].total
    rows = []
    for v, acc in zip(variants, accs, strict=True):
        s = acc.stats.summary()
        norm2 = float(acc.total @ acc.total)
        var = m * acc.sq_norms - norm2
        denom = math.sqrt(norm2) * float(ref_total.norm())
        rows.append({
            "variant": v.name, "tokens": int(acc.stats.tokens), "micro_batches": m,
            "ess": s["is/ess_applied"], "ess_raw": s["is/ess"],
            "masked_frac": s["is/dropped_frac"], "truncated_frac": s["is/truncated_frac"],
            "clipped_frac": s["loss/clipped_frac"], "grad_norm": math.sqrt(norm2),
            "grad_var": var if m > 1 else None,
            "grad_rel_var": var / norm2 if m > 1 and norm2 > 0 else None,
            "cos_ref": float(acc.total @ ref_total) / denom if denom > 0 else None,
            "loss": acc.loss,
        })  # fmt: skip
    return rows


# ---- the run -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepBatch:
    """What one learner step consumed, read back from the store."""

    step: int
    from_version: int
    checkpoint_uri: str | None
    """Checkpoint of ``from_version``; None when the store has no such policy."""
    group_ids: tuple[str, ...]


def consumed_steps(store: Any, run_id: str, steps: tuple[int, int] | None) -> list[StepBatch]:
    """The run's learner steps in ``[first, last]`` (all when None) with their groups, in the
    order the learner claimed them (commit time, then id)."""
    import sqlalchemy as sa

    from sandpiper.store import schema as T

    ls, gs, g, pol = T.learner_steps, T.group_states, T.groups, T.policies
    q = sa.select(ls.c.step, ls.c.policy_version).where(ls.c.run_id == run_id)
    if steps is not None:
        q = q.where(ls.c.step >= steps[0], ls.c.step <= steps[1])
    with store.connect_readonly() as conn:
        found = conn.execute(q.order_by(ls.c.step)).all()
        uris = dict(conn.execute(sa.select(pol.c.version, pol.c.checkpoint_uri)
                                 .where(pol.c.run_id == run_id)).all())  # fmt: skip
        members: dict[int, list[str]] = {}
        rows = conn.execute(
            sa.select(gs.c.consumed_by_step, gs.c.group_id)
            .join(g, g.c.group_id == gs.c.group_id)
            .where(gs.c.run_id == run_id, gs.c.consumed_by_step.in_([r.step for r in found]))
            .order_by(g.c.committed_at, g.c.group_id)
        ).all()
    for step, gid in rows:
        members.setdefault(step, []).append(gid)
    return [
        StepBatch(
            r.step,
            r.policy_version - 1,
            uris.get(r.policy_version - 1),
            tuple(members.get(r.step, ())),
        )
        for r in found
    ]


def run_learner_config(store: Any, run_id: str, fallback: LearnerConfig) -> LearnerConfig:
    """The learner section of the run's stored config (fields this code does not know are
    dropped); ``fallback`` when the store holds none."""
    import sqlalchemy as sa

    from sandpiper.store import schema as T

    with store.connect_readonly() as conn:
        stored = conn.execute(
            sa.select(T.runs.c.config_json).where(T.runs.c.run_id == run_id)
        ).scalar()
    if stored is None:
        raise LearnerError(f"no run {run_id!r} in {store.url}")
    if isinstance(stored, str):
        stored = json.loads(stored)
    section = (stored or {}).get("learner") if isinstance(stored, dict) else None
    if not isinstance(section, dict):
        return fallback
    known = {k: v for k, v in section.items() if k in LearnerConfig.model_fields}
    return LearnerConfig.model_validate(known)


def replay_run(
    store: Any,
    run_id: str,
    variants: Sequence[Variant],
    *,
    steps: tuple[int, int] | None,
    micro_batch_tokens: int,
    progress: Any = None,
) -> ReplayResult:
    """Replay every step in ``steps`` (see the module docstring); ``variants[0]`` must be the
    reference. ``progress(step, rows)`` is called after each step."""
    from sandpiper.store.claims import load_groups
    from sandpiper.trainer.checkpoint import load_model

    result = ReplayResult(run_id, [{"name": v.name, "overrides": v.overrides} for v in variants])
    batches = consumed_steps(store, run_id, steps)
    if not batches:
        raise LearnerError(
            f"run {run_id!r} has no learner steps{'' if steps is None else f' in {steps}'}"
        )
    ref_model = None
    if any(v.learner.kl_coef for v in variants):
        uri = consumed_steps(store, run_id, None)[0].checkpoint_uri
        ref_model = None if uri is None else load_model(_v0(uri)).requires_grad_(False).eval()
    for b in batches:
        reason = None
        if not b.group_ids:
            reason = "no consumed groups recorded"
        elif b.checkpoint_uri is None or not Path(b.checkpoint_uri).is_dir():
            reason = f"checkpoint of version {b.from_version} is gone ({b.checkpoint_uri})"
        if reason:
            result.skipped.append({"step": b.step, "reason": reason})
            continue
        with store.connect_readonly() as conn:
            groups = load_groups(conn, list(b.group_ids), b.from_version)
        assert b.checkpoint_uri is not None  # a missing checkpoint was skipped above
        model = load_model(b.checkpoint_uri)
        rows = replay_step(model, groups, b.from_version, variants,
                           micro_batch_tokens=micro_batch_tokens, ref_model=ref_model)  # fmt: skip
        if not rows:
            result.skipped.append({"step": b.step, "reason": "no group with a reward spread"})
            continue
        for row in rows:
            result.rows.append({"step": b.step, **row})
        if progress is not None:
            progress(b.step, rows)
    return result


def _v0(uri: str) -> str:
    """The run's first checkpoint folder, next to ``uri`` (``v000000``)."""
    return str(Path(uri).parent / "v000000")
