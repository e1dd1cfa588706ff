"""The learner loop: claim a batch of ready groups, train one policy version, register it.

Per step: latest registered policy (version v) -> claim ``groups_per_step`` ready groups no
older than ``max_lag`` versions -> group advantages -> packed micro-batches -> GRPO with
importance correction over minibatches x epochs -> checkpoint ``v+1`` (atomic folder) ->
``store.policy_versions.register(v+1, claim_id=...)``, which in ONE transaction records the policy,
the learner step and marks the claimed groups consumed.

Crash safety follows from that transaction: a learner killed at any point either registered
``v+1`` (its groups are consumed) or did not (the next learner in charge takes its claim
back). One learner is in charge of a run at a time (a lease in the store, see
``trainer/leadership.py``); every claim and registration carries its term, so a deposed
learner's late write is refused and it stops. A learner (restarted, or a standby taking
over) continues from the latest *registered* version: its weights, optimiser, scheduler and
RNG state (``trainer/resume.py``), so it ends where an uninterrupted run would.

Only rank 0 talks to the store and to MLflow; what it learns is broadcast to the other ranks.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from sandpiper.config import LearnerSettings
from sandpiper.errors import LearnerError, NotLeaderError, PolicyConflictError, StoreError
from sandpiper.store.records import PolicyRecord, TrainBatch
from sandpiper.store.step_metrics import StepMetrics
from sandpiper.trainer import ranks, resume
from sandpiper.trainer.advantages import batch_advantages
from sandpiper.trainer.checkpoint import (
    commit_folder,
    folder_bytes,
    gather_state_dict,
    load_model,
    load_tokenizer,
    policy_folder_name,
    publish_dtype,
    save_checkpoint,
    space_shortfall,
    temp_folder,
    write_weights,
)
from sandpiper.trainer.engine import (
    World,
    broadcast_from_main,
    build_engine,
    destroy_engine,
)
from sandpiper.trainer.leadership import LeaseKeeper, new_learner_id, wait_for_leadership
from sandpiper.trainer.loss import LossConfig, LossStats, grpo_loss
from sandpiper.trainer.optimise import build_minibatch, optimise, reduce_stats, split_minibatches
from sandpiper.trainer.packing import MicroBatch, TrainSequence, packed_logprobs, score_temperature
from sandpiper.trainer.prefix import Sharing, attention_tokens, unsupported_reason
from sandpiper.trainer.retention import RetentionPolicy, prune_checkpoints
from sandpiper.trainer.store_api import LearnerStore
from sandpiper.trainer.threads import FollowIdleCores
from sandpiper.trainer.tracking import Tracker

log = logging.getLogger(__name__)

_LOG_METRICS = {"reward/mean": "reward", "sft/nll": "nll", "kl/sampler_vs_learner": "kl"}
"""Metrics worth one glance in the learner's log line (all of them go to MLflow)."""


def _brief(metrics: StepMetrics) -> str:
    values = metrics.to_json()
    shown = [f"{label} {values[key]:.3g}" for key, label in _LOG_METRICS.items() if key in values]
    return (", " + ", ".join(shown)) if shown else ""


def _megabytes(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _written(metrics: StepMetrics, dtype: torch.dtype) -> str:
    """``12.3 MB written (bfloat16 weights 4.1 MB, train state 8.2 MB)``."""
    total, state = metrics.checkpoint_bytes or 0.0, metrics.train_state_bytes
    weights = f"{str(dtype).removeprefix('torch.')} weights {_megabytes(total - (state or 0))}"
    parts = [weights] + ([f"train state {_megabytes(state)}"] if state is not None else [])
    return f"{_megabytes(total)} written ({', '.join(parts)})"


def checkpoint_dir(cfg: LearnerSettings) -> Path:
    return Path(cfg.learner.checkpoint_dir or cfg.run_dir / "policies")


class Learner:
    """Holds the engine and the current policy version; :meth:`run` is the main loop."""

    def __init__(self, cfg: LearnerSettings, store: LearnerStore | None, world: World) -> None:
        self.cfg, self.lc, self.store, self.world = cfg, cfg.learner, store, world
        self.run_id = cfg.name
        # Unique per process: a restarted learner is a new learner, never one that could
        # mistake another live process's claims or lease for its own.
        self.learner_id = broadcast_from_main(new_learner_id() if world.is_main else None, world)
        self.loss_cfg = LossConfig.from_learner(self.lc)
        torch.manual_seed(cfg.seed)
        self.cores: FollowIdleCores | None = None
        if self.lc.torch_threads == "auto":
            self.cores = FollowIdleCores()
        elif self.lc.torch_threads is not None:
            torch.set_num_threads(self.lc.torch_threads)
        self.fence = wait_for_leadership(
            store, run_id=self.run_id, learner_id=self.learner_id,
            lease_s=self.lc.leader_lease_s, world=world,
            poll_s=max(self.lc.poll_interval_s, self.lc.leader_lease_s / 6),
        )  # fmt: skip
        self.keeper: LeaseKeeper | None = None
        self._engine_destroyed = False
        if world.is_main:
            self.keeper = LeaseKeeper(store, self.fence, lease_s=self.lc.leader_lease_s)
        try:
            self.version, start_dir, v0_dir, state_dir = self._resolve_start()
            self.tokenizer = load_tokenizer(start_dir)
            model = load_model(start_dir)
            self.ref_model = self._reference_model(v0_dir) if self.lc.kl_coef else None
            self.engine = build_engine(
                model, ds_config_path=self.lc.deepspeed_config, world=world, lr=self.lc.lr,
                weight_decay=self.lc.weight_decay, max_grad_norm=self.lc.max_grad_norm,
                precision=self.lc.precision,
                gradient_checkpointing=self.lc.gradient_checkpointing,
            )  # fmt: skip
            self.publish_dtype = publish_dtype(self.engine)
            self.sharing = self._sharing()
            self._unsaved: Path | None = None
            """The latest version's folder, if this learner published it without a training
            state (:meth:`finish` adds one)."""
            self._version_bytes: dict[bool, float] = {}
            """Bytes the last version wrote, without and with the training state."""
            if state_dir is not None:
                self._resume(state_dir, start_dir)
        except BaseException:
            self.close(release=True)
            raise
        self.tracker: Tracker | None = None

    def _sharing(self) -> Sharing | None:
        """How to share prefixes (``learner.share_prefix``), or None: off, or the policy (or
        reference) model cannot honour the shared layout's mask, which the log says."""
        if not self.lc.share_prefix:
            return None
        for model in (self.engine, self.ref_model):
            reason = None if model is None else unsupported_reason(model)
            if reason is not None:
                log.warning("learner.share_prefix: packing unshared: %s", reason)
                return None
        # rows within inference.max_model_len (and the micro-batch): the planner's row
        rows = min(self.cfg.max_model_len, self.lc.micro_batch_tokens)
        return Sharing(rows, attention_tokens(self.engine.module.config))

    def pack(self, seqs: list[TrainSequence]) -> list[MicroBatch]:
        """Micro-batches of one minibatch, prefixes shared as :attr:`sharing` says."""
        return build_minibatch(seqs, learner_cfg=self.lc, world=self.world, sharing=self.sharing)

    @property
    def term(self) -> int:
        return self.fence.term

    def close(self, *, release: bool = True) -> None:
        """Stop renewing the lease (``release`` hands it to a standby at once) and take the
        engine's hooks off the model; the weights stay readable, training is over.

        Why the hooks: ZeRO-3 puts autograd hooks on every parameter, held from C++ where
        the garbage collector cannot see them, and they hold the engine and with it its
        process groups. Left on, the groups' gloo threads outlive
        :func:`~sandpiper.trainer.engine.shutdown_distributed` (9 per rank were left)
        and the exit can abort."""
        if self.keeper is not None:
            self.keeper.close(release=release)
            self.keeper = None
        engine = getattr(self, "engine", None)  # absent when __init__ failed before it
        if engine is not None and not self._engine_destroyed:
            self._engine_destroyed = True
            try:
                destroy_engine(engine)
            except Exception:  # teardown: must not hide the error the run may be raising
                log.warning("could not release the DeepSpeed engine", exc_info=True)

    # ---- start-up ------------------------------------------------------------------

    def _resolve_start(self) -> tuple[int, str, str, str | None]:
        """(version, its folder, version 0's folder, the folder of the training state to
        resume from or None) to start from; registers v0 if missing.

        Always the latest *registered* version: a learner never continues from weights it
        did not register (a folder without a policy row is someone's unfinished work). The
        training state is the newest registered one (``save_train_state``), normally the
        latest version's own (see :meth:`_resume`).
        """
        found: tuple[int, str, str, str | None] | None = None
        if self.world.is_main:
            assert self.store is not None
            latest = self.store.policy_versions.latest(self.run_id)
            if latest is None:
                v0 = save_checkpoint(
                    load_model(self.lc.model),
                    self.checkpoint_dir / policy_folder_name(0, self.term),
                    tokenizer=load_tokenizer(self.lc.model),
                )
                latest = PolicyRecord(self.run_id, 0, str(v0.resolve()), None, None)
                self._register(latest, claim_id=None, metrics=None)
                first = latest
                state = None
            else:
                policies = self.store.policy_versions.all(self.run_id)
                first = policies[0]
                state = resume.newest_with_state(policies) if self.lc.save_train_state else None
            state_uri = None if state is None else state.checkpoint_uri
            found = (latest.version, latest.checkpoint_uri, first.checkpoint_uri, state_uri)
        version, uri, v0_uri, state_uri = broadcast_from_main(found, self.world)
        if not Path(uri).is_dir():
            raise LearnerError(
                f"policy {version} of run {self.run_id}: {uri} is not a folder this host can "
                "read; put learner.checkpoint_dir on a filesystem every learner and collector "
                "host mounts at the same path"
            )
        return version, uri, v0_uri, state_uri

    def _resume(self, state_dir: str, start_dir: str) -> None:
        """Load the newest training state: weights, optimiser, scheduler and RNG.

        It is the latest version's own unless that version was published without one
        (``train_state_every`` > 1 and the last learner did not stop cleanly): then the
        newest state is that of an older version, and the learner continues from it, the
        updates of the versions after it lost (their groups stay consumed). The version
        count goes on from the latest version, which stays registered and served until the
        next one replaces it."""
        resume.load_train_state(self.engine, state_dir, rank=self.world.rank)
        if not self.world.is_main:
            return
        if Path(state_dir) == Path(start_dir):
            log.info("resumed version %d with its optimiser and RNG state", self.version)
        else:
            log.warning(
                "version %d has no training state: resumed from the newest one, in %s (its "
                "weights, optimiser and RNG); the updates of the versions after it are lost",
                self.version, state_dir,
            )  # fmt: skip

    @property
    def checkpoint_dir(self) -> Path:
        return checkpoint_dir(self.cfg)

    def _reference_model(self, v0_dir: str) -> torch.nn.Module:
        ref = load_model(v0_dir).to(self.world.device)
        ref.eval().requires_grad_(False)
        return ref

    def _register(self, record: PolicyRecord, *, claim_id: str | None, metrics: dict | None):
        assert self.store is not None and self.keeper is not None
        self.keeper.check()
        self.store.policy_versions.register(
            record, claim_id=claim_id, metrics=metrics, fence=self.fence
        )

    # ---- the loop ------------------------------------------------------------------

    def run(self, tracker: Tracker | None = None) -> int:
        """Train until ``max_steps`` versions exist or no batch came for ``max_idle_s``."""
        self.tracker = tracker
        steps = 0
        while not (self.lc.max_steps and self.version >= self.lc.max_steps):
            got = broadcast_from_main(
                self._next_batch() if self.world.is_main else None, self.world
            )
            if isinstance(got, str):
                raise LearnerError(got)
            if got is None:
                break
            self.train_step(got)
            steps += 1
        self.finish()
        return steps

    def _next_batch(self) -> TrainBatch | str | None:
        """A batch, None when idle for too long, or why this learner must stop (a string)."""
        try:
            return self._wait_for_batch()
        except NotLeaderError as e:
            return str(e)

    def _wait_for_batch(self) -> TrainBatch | None:
        assert self.store is not None and self.keeper is not None
        idle_since = time.monotonic()
        while True:
            self.keeper.check()
            batch = self.store.claims.claim(
                run_id=self.run_id, learner_id=self.learner_id, n_groups=self.lc.groups_per_step,
                max_lag=self.lc.max_lag, lease_s=self.lc.claim_lease_s, fence=self.fence,
            )  # fmt: skip
            if batch is not None:
                return batch
            if self.lc.max_idle_s and time.monotonic() - idle_since > self.lc.max_idle_s:
                return None
            time.sleep(self.lc.poll_interval_s)

    def sequences(self, batch: TrainBatch) -> tuple[list[TrainSequence], StepMetrics]:
        """Episodes with a non-zero advantage, plus reward/advantage/staleness metrics."""
        adv = batch_advantages(batch.groups, mode=self.lc.advantage, eps=self.lc.adv_eps)
        by_id = {g.group_id: g for g in batch.groups}
        seqs: list[TrainSequence] = []
        for kept in adv.kept:
            group = by_id[kept.group_id]
            lag = self.version - group.min_policy_version
            temperature = score_temperature(group, self.cfg.logprobs_mode)
            for episode, a in zip(group.episodes, kept.advantages_G, strict=True):
                if a is None:
                    continue
                # one sequence per segment (a gateway episode may have several), same advantage
                for k, (lo, hi) in enumerate(episode.segments()):
                    if not episode.loss_mask_T[lo + 1 : hi].any():
                        continue
                    seq_id = episode.episode_id if k == 0 else f"{episode.episode_id}#{k}"
                    seqs.append(
                        TrainSequence(
                            seq_id, episode.token_ids_T[lo:hi], episode.loss_mask_T[lo:hi],
                            episode.behaviour_logprobs_T[lo:hi], a, lag, temperature,
                        )
                    )  # fmt: skip
        lags = Counter(self.version - g.min_policy_version for g in batch.groups)
        advs = np.array([s.advantage for s in seqs]) if seqs else np.zeros(1)
        r = adv.rewards if len(adv.rewards) else np.zeros(1)
        metrics = StepMetrics(
            groups=len(batch.groups),
            groups_zero_variance=adv.zero_variance_groups,
            groups_too_few_valid=adv.too_few_valid_groups,
            groups_dropped_stale=batch.dropped_stale,
            episodes_invalid=adv.invalid_episodes,
            sequences=len(seqs),
            reward_mean=float(r.mean()), reward_std=float(r.std()),
            reward_min=float(r.min()), reward_max=float(r.max()),
            advantage_mean=float(advs.mean()), advantage_std=float(advs.std()),
            advantage_abs_max=float(np.abs(advs).max()),
            staleness_mean=float(np.mean([self.version - g.min_policy_version
                                          for g in batch.groups] or [0])),
            lag_counts={k: float(n) for k, n in sorted(lags.items())},
        )  # fmt: skip
        return seqs, metrics

    def _grpo_loss(
        self, logp_T: torch.Tensor, micro: MicroBatch, logp_prox_T: torch.Tensor
    ) -> tuple[torch.Tensor, LossStats]:
        ref_T = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_T = packed_logprobs(
                    self.ref_model, micro, chunk_tokens=self.lc.logprob_chunk_tokens
                )
        return grpo_loss(
            logp_T, logp_prox_T, micro.logp_behav_T, micro.advantages_T, micro.loss_mask_T,
            micro.token_scale_T, micro.seq_index_T, micro.num_seqs, self.loss_cfg, ref_T,
        )  # fmt: skip

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Train on one claimed batch and register the next version with its groups."""
        started = time.perf_counter()
        seqs, metrics = self.sequences(batch)
        if seqs:
            minibatches = [self.pack(mb) for mb in split_minibatches(seqs, self.lc.minibatches)]
            if self.cores is not None:
                metrics.torch_threads = float(self.cores.begin())
            result = optimise(
                self.engine, minibatches, self._grpo_loss, epochs=self.lc.epochs,
                logprob_chunk_tokens=self.lc.logprob_chunk_tokens,
            )  # fmt: skip
            if self.cores is not None:
                self.cores.end()
            metrics.update(reduce_stats(result.stats, self.world).summary())
            metrics.grad_norm = result.grad_norm
            metrics.optimizer_steps = result.optimizer_steps
        metrics.tokens = float(sum(len(s.token_ids_T) for s in seqs))
        metrics.loss_tokens = float(sum(s.loss_tokens for s in seqs))
        return self.publish(metrics, started, claim_id=batch.claim_id)

    def publish(
        self, metrics: StepMetrics, started: float, *, claim_id: str | None
    ) -> dict[str, float]:
        """Checkpoint ``version + 1`` and register it (with the claim) in the store; returns
        the step's metrics as stored (``StepMetrics.to_json``).

        Every rank writes its share into one temporary folder (the training state is
        sharded); rank 0 renames it into place and registers it. If the store refuses (this
        learner was deposed, or the version exists), the folder is deleted and every rank
        raises: the learner never continues from weights it did not register.
        """
        new_version = self.version + 1
        with_state = self._state_due(new_version)
        weights = gather_state_dict(self.engine, dtype=self.publish_dtype, rank=self.world.rank)
        train_s = time.perf_counter() - started
        out = self.checkpoint_dir / policy_folder_name(new_version, self.term)
        short = None
        if self.world.is_main and with_state in self._version_bytes:
            short = space_shortfall(self.checkpoint_dir, self._version_bytes[with_state],
                                    what=f"policy v{new_version}")  # fmt: skip
        short = broadcast_from_main(short, self.world)
        if short is not None:  # every rank, before any writes: its claim goes back
            raise LearnerError(short)
        tmp = broadcast_from_main(temp_folder(out) if self.world.is_main else None, self.world)
        if with_state:  # collective, first: the ranks are together here
            resume.save_train_state(self.engine, tmp, rank=self.world.rank)
        if self.world.is_main:  # then rank 0 alone, while the others wait outside a collective
            write_weights(self.engine.module, tmp, tokenizer=self.tokenizer, state_dict=weights)
        del weights
        ranks.arrive_together(self.world.world_size, rank=self.world.rank)  # all shards written
        refused = None
        if self.world.is_main:
            refused = self._commit(new_version, tmp, out, metrics, started, train_s, claim_id)
        refused = broadcast_from_main(refused, self.world)
        if refused is not None:
            raise LearnerError(refused)
        self.version, self._unsaved = new_version, out if not with_state else None
        return metrics.to_json()

    def _state_due(self, version: int) -> bool:
        """Whether ``version`` is published with the training state: every
        ``train_state_every``-th, and the last one before ``max_steps`` stops the run."""
        if not self.lc.save_train_state:
            return False
        last = bool(self.lc.max_steps) and version >= self.lc.max_steps
        return last or version % self.lc.train_state_every == 0

    def finish(self) -> None:
        """At a clean stop: add the training state to the latest version if this learner
        published it without one (``train_state_every`` > 1), so that a restart resumes
        exactly. Collective. Written to a temporary sub-folder, renamed once every rank is
        done: a reader sees the whole state or none."""
        folder = self._unsaved
        if folder is None:
            return
        name = broadcast_from_main(
            f".{resume.STATE_DIR}.tmp-{secrets.token_hex(4)}" if self.world.is_main else None,
            self.world,
        )
        resume.save_train_state(self.engine, folder, rank=self.world.rank, name=name)
        ranks.arrive_together(self.world.world_size, rank=self.world.rank)
        if self.world.is_main:
            (folder / name).rename(folder / resume.STATE_DIR)
            log.info("policy v%d: training state added at the stop (%s)", self.version,
                     _megabytes(folder_bytes(folder / resume.STATE_DIR)))  # fmt: skip
        self._unsaved = None

    def _commit(
        self, new_version: int, tmp: Path, out: Path, metrics: StepMetrics,
        started: float, train_s: float, claim_id: str | None,
    ) -> str | None:  # fmt: skip
        """Rank 0: rename, register, log, prune; returns why the store refused, or None."""
        try:
            commit_folder(tmp, out)
        except LearnerError as e:
            return str(e)
        metrics.checkpoint_bytes = float(folder_bytes(out))
        with_state = (out / resume.STATE_DIR).is_dir()
        self._version_bytes[with_state] = metrics.checkpoint_bytes
        if with_state:
            metrics.train_state_bytes = float(folder_bytes(out / resume.STATE_DIR))
        metrics.train_s = train_s
        metrics.step_s = step_s = time.perf_counter() - started
        metrics.tokens_per_s = (metrics.tokens or 0.0) / max(train_s, 1e-9)
        record = PolicyRecord(
            self.run_id, new_version, str(out.resolve()), self.version, new_version
        )
        try:
            self._register(record, claim_id=claim_id, metrics=metrics.to_json())
        except (NotLeaderError, PolicyConflictError) as e:
            shutil.rmtree(out, ignore_errors=True)  # never registered: nobody uses it
            log.error("%s", e)
            return str(e)
        log.info(
            "policy v%d: %.0f tokens in %.1f s (%.0f tokens/s)%s; %s",
            new_version, metrics.tokens or 0.0, step_s, metrics.tokens_per_s, _brief(metrics),
            _written(metrics, self.publish_dtype),
        )  # fmt: skip
        if self.tracker is not None:
            self.tracker.log_step(new_version, metrics.to_json())
        if self.lc.checkpoint_retention:
            self._prune()
        return None

    def _prune(self) -> None:
        rule = RetentionPolicy(
            self.lc.checkpoint_keep_last, self.lc.checkpoint_keep_every,
            self.lc.checkpoint_grace_s, self.cfg.collector_heartbeat_ttl_s,
        )  # fmt: skip
        try:
            prune_checkpoints(
                self.store, run_id=self.run_id, checkpoint_dir=self.checkpoint_dir,
                term=self.term, rule=rule,
            )  # fmt: skip
        except (OSError, StoreError) as e:  # retention is housekeeping: never stop training
            log.warning("checkpoint retention skipped this step: %s", e)
