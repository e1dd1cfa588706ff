"""A synthetic run that looks like real collection, for tests, docs and trying the report.

:func:`synthetic_run` builds, deterministically from a seed, everything a collector and a
learner would have written: tasks, policy versions, GRPO groups of episodes with turns
(token ids, logprobs, per-token policy versions, some spanning an in-flight weight update),
tool calls (successes, non-zero exits, usage errors, bad JSON, time-outs), infrastructure
failures flagged invalid, and learner-step metrics (importance weights, ESS, KL, ...).
Rewards rise with the policy version so that plots show a trend.

:func:`populate` writes such a run into a :class:`sandpiper.store.Store` through its public API
(the same path the collector and the learner take)::

    from sandpiper.store import Store
    from sandpiper.testing.synthetic import populate, synthetic_run

    store = Store("duckdb:///runs/demo.duckdb")
    store.init()
    populate(store, synthetic_run(seed=0))
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from sandpiper.store.records import (
    INFRA_STOPS,
    EpisodeRecord,
    GroupRecord,
    GroupSampling,
    PolicyRecord,
    Role,
    RunRecord,
    Split,
    StopReason,
    TaskRecord,
    ToolCallRecord,
    ToolErrorKind,
    TurnRecord,
)
from sandpiper.store.step_metrics import StepMetrics

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
"""Start of the synthetic run (fixed so that outputs are reproducible)."""

# (task id, format, base success probability): easy tasks saturate, hard ones stay at 0,
# which produces the zero-variance groups GRPO has to skip.
TASKS: tuple[tuple[str, str, float], ...] = (
    ("math-add", "jsonl_math", 0.85),
    ("math-mul", "jsonl_math", 0.55),
    ("math-frac", "jsonl_math", 0.30),
    ("fix-off-by-one", "folder", 0.45),
    ("fix-import", "folder", 0.65),
    ("write-parser", "folder", 0.15),
    ("impossible-proof", "jsonl_qa", 0.0),
    ("echo-answer", "jsonl_qa", 1.0),
)


@dataclass(frozen=True, slots=True)
class LearnerStepData:
    """What one learner step registers: the new policy and its metrics."""

    policy: PolicyRecord
    group_ids: tuple[str, ...]
    """Groups trained on in this step, oldest first (what the simulated learner took)."""
    metrics: dict[str, float]


@dataclass(slots=True)
class SyntheticRun:
    """Everything :func:`populate` writes, in the order it writes it."""

    run: RunRecord
    tasks: list[TaskRecord]
    initial_policy: PolicyRecord
    groups_by_version: dict[int, list[GroupRecord]] = field(default_factory=dict)
    """Groups sampled while the given version was current (before the next step)."""
    steps: list[LearnerStepData] = field(default_factory=list)
    groups_per_step: int = 4
    """Groups the simulated learner takes per step."""
    max_lag: int = 1
    """Groups more than this many versions older than the learner are dropped as stale."""
    dropped_group_ids: list[str] = field(default_factory=list)
    """Groups the simulated learner dropped as stale (older than ``max_lag`` versions)."""

    @property
    def groups(self) -> list[GroupRecord]:
        return [g for v in sorted(self.groups_by_version) for g in self.groups_by_version[v]]

    @property
    def episodes(self) -> list[EpisodeRecord]:
        return [e for g in self.groups for e in g.episodes]


def synthetic_run(
    *,
    seed: int = 0,
    run_id: str = "synthetic",
    num_versions: int = 5,
    groups_per_version: int = 6,
    group_size: int = 4,
    groups_per_step: int = 4,
    max_lag: int = 1,
) -> SyntheticRun:
    """Build a reproducible run with ``num_versions`` learner steps after version 0.

    The simulated learner takes ``groups_per_step`` groups oldest first and drops groups more
    than ``max_lag`` versions old; with fewer groups per step than per version a backlog
    builds up, so consumed groups have staleness 0 and 1 and some are dropped as stale.
    """
    # Seeded by run id too: two runs in one store never share episode ids.
    rng = random.Random(f"{run_id}:{seed}")
    np_rng = np.random.default_rng([seed, zlib.crc32(run_id.encode())])
    tasks = [
        TaskRecord(
            task_id=task_id,
            source="synthetic.jsonl",
            format=fmt,
            instruction=f"Solve the task {task_id!r}.",
            reference={"answer": "42", "reward": "tests" if fmt == "folder" else "math_verify"},
            data_uri=f"tasks/{task_id}" if fmt == "folder" else None,
        )
        for task_id, fmt, _ in TASKS
    ]
    config = {"collector": {"group_size": group_size}, "learner": {"algo": "grpo"}}
    run = RunRecord(
        run_id=run_id, config_json=json.dumps(config), code_version="synthetic", created_at=T0
    )
    out = SyntheticRun(
        run=run,
        tasks=tasks,
        initial_policy=PolicyRecord(run_id, 0, f"runs/{run_id}/policies/v0", None, None, T0),
        groups_per_step=groups_per_step,
        max_lag=max_lag,
    )
    seq = 0
    backlog: list[tuple[int, GroupRecord]] = []
    for version in range(num_versions + 1):
        groups = []
        for _ in range(groups_per_version):
            task_id, _, p_base = TASKS[rng.randrange(len(TASKS))]
            started = T0 + timedelta(minutes=10 * version + rng.uniform(0, 9))
            gen = _EpisodeGen(rng, np_rng, version, _success_p(p_base, version), started)
            episodes = tuple(gen.episode(i) for i in range(group_size))
            groups.append(
                GroupRecord(
                    group_id=f"{run_id}/{task_id}/{seq}",
                    run_id=run_id,
                    task_id=task_id,
                    split=Split.TRAIN,
                    sampling_params=GroupSampling(max_tokens_per_turn=256),
                    episodes=episodes,
                    created_at=started,
                )
            )
            seq += 1
        out.groups_by_version[version] = groups
        if version < num_versions:
            backlog.extend((version, g) for g in groups)
            dropped = [g for v, g in backlog if version - v > max_lag]
            out.dropped_group_ids.extend(g.group_id for g in dropped)
            backlog = [(v, g) for v, g in backlog if version - v <= max_lag]
            taken, backlog = backlog[:groups_per_step], backlog[groups_per_step:]
            out.steps.append(_learner_step(rng, run_id, version, [g for _, g in taken]))
    return out


def _success_p(p_base: float, version: int) -> float:
    """Tasks that are neither impossible nor trivial get easier as training goes on."""
    if p_base in (0.0, 1.0):
        return p_base
    return min(0.97, p_base + 0.07 * version)


def _learner_step(
    rng: random.Random, run_id: str, version: int, groups: list[GroupRecord]
) -> LearnerStepData:
    valid = [e.reward for g in groups for e in g.episodes if e.valid and e.reward is not None]
    w_mean = 1.0 + rng.uniform(-0.03, 0.03)
    metrics = StepMetrics(  # the fields the learner fills (store.step_metrics)
        is_w_mean=w_mean,
        is_w_min=w_mean - rng.uniform(0.2, 0.5),
        is_w_max=w_mean + rng.uniform(0.3, 1.5),
        is_ess=rng.uniform(0.85, 0.99),
        clipped_frac=rng.uniform(0.0, 0.05),
        is_masked_frac=rng.uniform(0.0, 0.02),
        kl_sampler_vs_learner=rng.uniform(1e-4, 5e-3),
        reward_mean=float(np.mean(valid)) if valid else 0.0,
        tokens_per_s=rng.uniform(800, 1200),
    ).to_json()
    policy = PolicyRecord(
        run_id=run_id,
        version=version + 1,
        checkpoint_uri=f"runs/{run_id}/policies/v{version + 1}",
        parent_version=version,
        learner_step=version + 1,
        created_at=T0 + timedelta(minutes=10 * version + 9.5),
    )
    return LearnerStepData(policy, tuple(g.group_id for g in groups), metrics)


class _EpisodeGen:
    """Builds the episodes of one group: same task, same starting policy version."""

    def __init__(
        self,
        rng: random.Random,
        np_rng: np.random.Generator,
        version: int,
        p_success: float,
        started_at: datetime,
    ) -> None:
        self.rng, self.np_rng = rng, np_rng
        self.version, self.p_success, self.started_at = version, p_success, started_at

    def episode(self, sample_index: int) -> EpisodeRecord:
        rng = self.rng
        stop = self._stop_reason()
        valid = stop not in INFRA_STOPS
        solved = valid and stop == StopReason.SUBMITTED and rng.random() < self.p_success
        # One episode in five of a non-initial version straddles a weight update.
        spans_update = self.version > 0 and rng.random() < 0.2
        turns, clock = self._turns(stop, spans_update)
        duration_ms = (clock - self.started_at).total_seconds() * 1000.0
        breakdown: dict[str, Any] = {}
        reward = None
        if valid:
            reward = 1.0 if solved else 0.0
            breakdown = {"tests_passed": int(solved), "tests_total": 1, "format_ok": True}
            if sample_index == 0 and self.version % 2 == 1:
                # an external agent through the gateway (collector/gateway/assembly.py)
                breakdown["gateway"] = {
                    "calls": len(turns) // 2, "segments": 1 + self.version % 3,
                    "restart_reasons": {"message 1 differs from what the model saw": 1},
                    "retokenization_mismatches": self.version % 2,
                }  # fmt: skip
        return EpisodeRecord(
            episode_id=f"{rng.getrandbits(128):032x}",
            sample_index=sample_index,
            stop_reason=stop,
            valid=valid,
            trainable=True,
            reward=reward,
            reward_breakdown=breakdown,
            turns=tuple(turns),
            started_at=self.started_at,
            duration_ms=duration_ms,
            sandbox_id=f"sp-{rng.getrandbits(32):08x}",
            error=_infra_error(stop),
        )

    def _stop_reason(self) -> StopReason:
        roll = self.rng.random()
        if roll < 0.06:
            return self.rng.choice([StopReason.SANDBOX_LOST, StopReason.MODEL_ERROR])
        if roll < 0.14:
            return StopReason.MAX_TURNS
        if roll < 0.18:
            return StopReason.CONTEXT_EXCEEDED
        return StopReason.SUBMITTED

    def _turns(self, stop: StopReason, spans_update: bool) -> tuple[list[TurnRecord], datetime]:
        rng, clock = self.rng, self.started_at
        turns = [
            self._turn(0, Role.SYSTEM, "You are a careful agent.", 24, clock),
            self._turn(1, Role.USER, "Solve the task and call submit.", 40, clock),
        ]
        n_actions = {StopReason.MAX_TURNS: 6, StopReason.SUBMITTED: rng.randint(1, 4)}.get(
            stop, rng.randint(1, 3)
        )
        versions = (self.version, self.version + 1) if spans_update else (self.version,)
        for step in range(n_actions):
            last = step == n_actions - 1
            version = versions[-1] if (last and len(versions) > 1) else versions[0]
            split = versions if (last and len(versions) > 1) else (version,)
            tool = "submit" if last and stop == StopReason.SUBMITTED else self._tool_name()
            calls = (self._tool_call(tool),)
            n_tokens = rng.randint(20, 120)
            sampled = self._turn(
                len(turns), Role.ASSISTANT, f"Calling {tool}.", n_tokens, clock, split
            )
            sampled = _with_calls(sampled, calls)
            clock += timedelta(milliseconds=sampled.duration_ms)
            turns.append(sampled)
            output = calls[0].output
            turns.append(self._turn(len(turns), Role.TOOL, output, rng.randint(5, 60), clock))
            clock += timedelta(milliseconds=calls[0].duration_ms)
        return turns, clock

    def _turn(
        self,
        index: int,
        role: Role,
        text: str,
        n_tokens: int,
        at: datetime,
        versions: tuple[int, ...] | None = None,
    ) -> TurnRecord:
        ids_T = self.np_rng.integers(3, 1000, size=n_tokens, dtype=np.int32)
        if versions is None:
            return TurnRecord(index, role, text, ids_T, None, None, False, at, 0.0)
        logprobs_T = -self.np_rng.exponential(0.6, size=n_tokens).astype(np.float32)
        # The update lands partway through the turn: earlier tokens keep the old version.
        cut = n_tokens // 2 if len(versions) > 1 else n_tokens
        versions_T = np.full(n_tokens, versions[-1], dtype=np.int32)
        versions_T[:cut] = versions[0]
        duration_ms = n_tokens * self.rng.uniform(3.0, 8.0)
        return TurnRecord(index, role, text, ids_T, logprobs_T, versions_T, True, at, duration_ms)

    def _tool_name(self) -> str:
        roll = self.rng.random()
        if roll < 0.6:
            return "execute_bash"
        return "str_replace_editor" if roll < 0.95 else "browse_web"

    def _tool_call(self, name: str) -> ToolCallRecord:
        rng = self.rng
        args = {"command": "python -m pytest -q"} if name == "execute_bash" else {"path": "a.py"}
        exit_code: int | None = 0
        error, timed_out, output = ToolErrorKind.NONE, False, "ok"
        duration_ms = rng.lognormvariate(3.5, 1.0)
        roll = rng.random()
        if name == "browse_web":
            error, exit_code, output = ToolErrorKind.UNKNOWN_TOOL, None, "unknown tool browse_web"
        elif name == "execute_bash" and roll < 0.08:
            error, timed_out, exit_code = ToolErrorKind.TIMED_OUT, True, None
            output, duration_ms = "command timed out after 30 s", 30_000.0
        elif name == "execute_bash" and roll < 0.3:
            exit_code, output = 1, "FAILED test_a.py::test_answer"
        elif name == "str_replace_editor" and roll < 0.15:
            error, output = ToolErrorKind.TOOL_ERROR, "No replacement was performed."
        elif roll > 0.97:
            error, exit_code, output = ToolErrorKind.BAD_JSON, None, "arguments are not JSON"
        output_bytes = len(output.encode()) * (rng.choice([1, 1, 1, 400]))
        return ToolCallRecord(
            index=0,
            name=name,
            arguments_json=json.dumps(args),
            output=output,
            output_bytes_total=output_bytes,
            exit_code=exit_code,
            duration_ms=duration_ms,
            timed_out=timed_out,
            error_kind=error,
        )


def _with_calls(turn: TurnRecord, calls: tuple[ToolCallRecord, ...]) -> TurnRecord:
    return TurnRecord(
        turn.index,
        turn.role,
        turn.text,
        turn.token_ids_T,
        turn.logprobs_T,
        turn.policy_versions_T,
        turn.trainable,
        turn.started_at,
        turn.duration_ms,
        calls,
    )


def _infra_error(stop: StopReason) -> str | None:
    if stop == StopReason.SANDBOX_LOST:
        return "the container was removed by the host"
    if stop == StopReason.MODEL_ERROR:
        return "inference server returned HTTP 500 twice"
    return None


def populate(store: Any, run: SyntheticRun) -> None:
    """Write ``run`` into an initialised ``store`` the way collector and learner would.

    Per version: commit its groups, then let a learner claim ``run.groups_per_step`` groups
    (the store drops stale ones) and register the next policy with the step's metrics.
    Which groups are consumed or dropped is the store's decision, as in a real run.
    """
    store.ensure_run(run.run)
    store.upsert_tasks(run.tasks)
    store.policy_versions.register(run.initial_policy)
    for version, groups in sorted(run.groups_by_version.items()):
        store.write_groups(groups)
        if version >= len(run.steps):
            continue
        step = run.steps[version]
        batch = store.claims.claim(
            run_id=run.run.run_id,
            learner_id="synthetic-learner",
            n_groups=run.groups_per_step,
            max_lag=run.max_lag,
        )
        if batch is not None:
            store.policy_versions.register(
                step.policy, claim_id=batch.claim_id, metrics=step.metrics
            )
