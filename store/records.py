"""Typed records that cross between collector, store and learner. Nothing else crosses.

The collector builds :class:`GroupRecord` objects (a GRPO group of episodes, each a list of
turns with the exact token ids the model saw and sampled) and hands them to the store's
writer. The learner receives :class:`TrainBatch` objects from the store's reader: the same
episodes flattened into per-token numpy arrays ready for packing.

Conventions:
- Array fields end in ``_T`` (one entry per token); they are numpy arrays, never lists.
- ``None`` means "not applicable" and is documented per field.
- Timestamps are timezone-aware UTC datetimes; durations are milliseconds (``_ms``).
- Token ids of all turns of an episode, concatenated in turn order, are exactly the context
  the model saw; the learner trains on those ids, never on re-tokenized text.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from sandpiper.config import SamplingLimits


def utcnow() -> datetime:
    """This process's clock, the one every Python-side timestamp comes from (rows, claims).
    Leases and heartbeats use the store's clock (:func:`sandpiper.store.leases.store_now`), which
    every host of a run shares."""
    return datetime.now(UTC)


class StopReason(StrEnum):
    """Why an episode ended. Infra kinds make the episode invalid (see ``INFRA_STOPS``)."""

    SUBMITTED = "submitted"
    MAX_TURNS = "max_turns"
    MAX_TOKENS = "max_tokens"
    CONTEXT_EXCEEDED = "context_exceeded"
    NO_TOOL_CALL = "no_tool_call"
    """The model answered without calling a tool (the final message is its answer)."""
    MODEL_ERROR = "model_error"
    SANDBOX_DIED = "sandbox_died"
    """The agent's commands broke its sandbox (its shell cannot be restarted, the container
    ran out of pids or memory, ...) while the container still ran: the policy's outcome,
    graded like any other (otherwise a policy learns to escape its penalties this way)."""
    SANDBOX_LOST = "sandbox_lost"
    """The container was lost for reasons the agent cannot cause (the host removed or
    killed it, podman failed) or failed before the agent acted: invalid."""
    INFRA_ERROR = "infra_error"
    """Any other failure outside the policy: the inference client, the store, or a bug of
    the collector itself (its traceback is logged and its error recorded)."""
    CANCELLED = "cancelled"
    TASK_ERROR = "task_error"
    """The task itself is broken (failing setup.sh, missing test script or image, a reward
    it cannot score): not the policy's doing, so the episode is invalid."""
    TIME_LIMIT = "time_limit"
    """An external agent ran past its time limit (killed; graded as it stands)."""
    AGENT_ERROR = "agent_error"
    """An external agent exited with an error after calling the model (graded)."""
    BAD_SAMPLER_OUTPUT = "bad_sampler_output"
    """A sampled token's logprob or policy version was not finite (or a version negative or
    fractional): set by the store at ingest (``store.validation``), never by the agent."""


INFRA_STOPS = frozenset(
    {
        StopReason.MODEL_ERROR,
        StopReason.SANDBOX_LOST,
        StopReason.INFRA_ERROR,
        StopReason.CANCELLED,
        StopReason.TASK_ERROR,
        StopReason.BAD_SAMPLER_OUTPUT,
    }
)
"""Stops not caused by the policy (infrastructure, broken tasks): invalid episodes, never 0."""


MIN_VALID_EPISODES = 2
"""The GRPO rule, in one place: a group needs this many valid episodes for an advantage (a
reward against the others' mean and spread). A train group with fewer is stored ``invalid``
(``store/to_arrow.py``), the learner skips one (``trainer/advantages.py``), and the
``zero_variance_share`` view counts only groups with as many (``analysis/views.py``)."""


class GroupStatus(StrEnum):
    COLLECTING = "collecting"
    READY = "ready"
    CLAIMED = "claimed"
    """Taken by a learner step that has not registered its policy yet (lease-protected)."""
    CONSUMED = "consumed"
    DROPPED_STALE = "dropped_stale"
    INVALID = "invalid"
    """Fewer than :data:`MIN_VALID_EPISODES` valid episodes: no advantage can be computed."""
    DEAD = "dead"
    """Stored, but a learner could not read it: set aside in ``dead_groups`` (never trained
    on until ``sandpiper store retry-dead`` gives it back)."""


class Role(StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class Split(StrEnum):
    TRAIN = "train"
    VALIDATION = "validation"


class ToolErrorKind(StrEnum):
    """What went wrong with one tool call; ``NONE`` when it ran (whatever its exit code)."""

    NONE = "none"
    BAD_JSON = "bad_json"
    FORMAT_ERROR = "format_error"
    """A bash_block reply without exactly one fenced bash block."""
    UNKNOWN_TOOL = "unknown_tool"
    BAD_ARGUMENTS = "bad_arguments"
    ARGUMENTS_TOO_LARGE = "arguments_too_large"
    TOOL_ERROR = "tool_error"
    """The tool ran and reported a usage error (e.g. str_replace found no match)."""
    TIMED_OUT = "timed_out"
    OOM_KILLED = "oom_killed"
    SANDBOX_DIED = "sandbox_died"
    """The agent's commands broke its sandbox (see ``StopReason.SANDBOX_DIED``)."""
    SANDBOX_LOST = "sandbox_lost"
    """The container was lost to the host (see ``StopReason.SANDBOX_LOST``)."""


@dataclass(frozen=True, slots=True)
class RunRecord:
    run_id: str
    """Human-readable unique run name."""
    config_json: str
    """The resolved run config as JSON."""
    code_version: str
    """``git describe`` of the code that started the run, or the package version."""
    created_at: datetime = field(default_factory=utcnow)


@dataclass(frozen=True, slots=True)
class PolicyRecord:
    run_id: str
    version: int
    """0 is the initial model; each learner step registers version + 1."""
    checkpoint_uri: str
    """Folder with safetensors weights (untied output layer), tokenizer and config."""
    parent_version: int | None
    """Version this one was trained from; None for version 0."""
    learner_step: int | None
    """Learner step that produced it; None for version 0."""
    created_at: datetime = field(default_factory=utcnow)


@dataclass(frozen=True, slots=True)
class Fence:
    """Who writes: the learner in charge of ``run_id`` under ``term`` (see ``store/leases.py``).

    Claims, releases and registrations that carry a fence are refused with
    ``NotLeaderError`` unless the run's lease still names this learner and term."""

    run_id: str
    learner_id: str
    term: int


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """The current leadership lease of a run (one row of ``learner_leases``)."""

    run_id: str
    learner_id: str
    """``host:pid:start:random`` of the learner process in charge."""
    term: int
    """1 for the first leader; +1 at each change of leader."""
    expires_at: datetime
    """Store clock; a standby may take over once this has passed."""
    held: bool = False
    """True when the learner that asked holds this lease."""


@dataclass(frozen=True, slots=True)
class TaskRecord:
    task_id: str
    source: str
    """Where the task came from (file name or dataset name)."""
    format: str
    """``jsonl_math``, ``jsonl_qa``, ``folder``, ``llm_in_sandbox``, ..."""
    instruction: str
    reference: dict[str, Any]
    """Reference data for the reward (answer, banned patterns, reward kind, ...)."""
    data_uri: str | None
    """Task folder with seed files and tests; None for prompt-only tasks."""
    split: Split = Split.TRAIN


@dataclass(frozen=True, slots=True)
class ToolCallRecord:
    index: int
    """Position among the tool calls of its assistant turn."""
    name: str
    """Tool name as the model wrote it (may be unknown)."""
    arguments_json: str
    """Arguments as JSON text (the raw text when it did not parse)."""
    output: str
    """What the agent was shown (already capped head + tail)."""
    output_bytes_total: int
    """Bytes the tool produced before capping."""
    exit_code: int | None
    """Shell exit status; None for tools without one or when the command never finished."""
    duration_ms: float
    timed_out: bool
    error_kind: ToolErrorKind = ToolErrorKind.NONE


@dataclass(frozen=True, slots=True)
class TurnRecord:
    index: int
    role: Role
    text: str
    """Decoded text of this segment (for people; the learner uses token ids)."""
    token_ids_T: np.ndarray
    """int32 token ids of this segment as the model saw them (prompt) or sampled them."""
    logprobs_T: np.ndarray | None
    """float32 sampling logprobs of sampled tokens; None for non-sampled segments."""
    policy_versions_T: np.ndarray | None
    """int32 policy version that sampled each token; None for non-sampled segments."""
    trainable: bool
    """True for sampled assistant tokens (in the loss); False for prompt and tool output."""
    started_at: datetime = field(default_factory=utcnow)
    duration_ms: float = 0.0
    tool_calls: tuple[ToolCallRecord, ...] = ()


@dataclass(frozen=True, slots=True)
class EpisodeRecord:
    episode_id: str
    """Globally unique (uuid4 hex)."""
    sample_index: int
    """0..G-1 within its group."""
    stop_reason: StopReason
    valid: bool
    """False for infrastructure failures: excluded from advantages, never scored 0."""
    trainable: bool
    """False for evaluation-mode episodes without token ids / logprobs."""
    reward: float | None
    """None when invalid or not scored."""
    reward_breakdown: dict[str, Any]
    """Components of the reward (tests passed, math_verify, banned-pattern penalty, ...)."""
    turns: tuple[TurnRecord, ...]
    started_at: datetime
    duration_ms: float
    sandbox_id: str | None
    """Container that ran the episode; None without a sandbox."""
    error: str | None = None
    """Human-readable cause of an infra failure; None otherwise."""

    @property
    def completion_tokens(self) -> int:
        return sum(len(t.token_ids_T) for t in self.turns if t.trainable)

    @property
    def total_tokens(self) -> int:
        return sum(len(t.token_ids_T) for t in self.turns)

    @property
    def policy_version_range(self) -> tuple[int, int] | None:
        """(min, max) version over sampled tokens; None when nothing was sampled. Negative
        entries (-1: unknown, see ``store.validation``) are not versions and are skipped."""
        spans = [t.policy_versions_T for t in self.turns if t.policy_versions_T is not None]
        spans = [s[s >= 0] for s in spans if len(s)]
        spans = [s for s in spans if len(s)]
        if not spans:
            return None
        return int(min(s.min() for s in spans)), int(max(s.max() for s in spans))


@dataclass(frozen=True, slots=True)
class GroupSampling:
    """How a group's episodes were sampled: the ``groups.sampling_params`` JSON column.

    One shape for every writer (the collector, evaluation of an external endpoint, tests and
    synthetic runs); fields that do not apply are None and left out of the JSON."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens_per_turn: int | None = None
    max_turns: int | None = None
    max_episode_tokens: int | None = None
    """Budget of sampled tokens over the episode."""
    context_limit: int | None = None
    tool_format: str | None = None
    endpoint: str | None = None
    """Evaluation of an external OpenAI-compatible endpoint: its URL."""
    model: str | None = None
    """Evaluation of an external endpoint: the model name asked for."""

    @classmethod
    def from_limits(cls, limits: SamplingLimits) -> GroupSampling:
        """The record of episodes sampled under ``limits`` (the collector's and the gateway's
        groups): the run's one :class:`~sandpiper.config.SamplingLimits`, stored in
        this record's own JSON form (which earlier releases' values still read into)."""
        return cls(
            temperature=limits.temperature,
            top_p=limits.top_p,
            max_tokens_per_turn=limits.max_tokens_per_turn,
            max_turns=limits.max_turns,
            max_episode_tokens=limits.max_episode_tokens,
            context_limit=limits.context_limit,
            tool_format=limits.tool_format,
        )

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__ if getattr(self, k) is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GroupSampling:
        """Read a stored value, also the shapes of earlier releases (the collector's nested
        ``limits``, ``max_tokens`` for the per-turn limit)."""
        flat = {**data.get("limits", {}), **{k: v for k, v in data.items() if k != "limits"}}
        if "max_tokens" in flat:
            flat.setdefault("max_tokens_per_turn", flat.pop("max_tokens"))
        return cls(**{k: v for k, v in flat.items() if k in cls.__slots__})


@dataclass(frozen=True, slots=True)
class GroupRecord:
    group_id: str
    """``{run_id}/{task_id}/{seq}``: the id of the task slot the store issued (see
    :class:`SlotLease`), so a re-sent group dedups and two collectors never share an id."""
    run_id: str
    task_id: str
    split: Split
    sampling_params: GroupSampling
    episodes: tuple[EpisodeRecord, ...]
    created_at: datetime = field(default_factory=utcnow)
    collector_id: str | None = None
    """Registered id of the collector process that produced it; None outside a collector."""
    slot_lease: int | None = None
    """Lease number of the slot it fills (``SlotLease.lease``); the store refuses it if the
    slot was re-issued since. None: not from a slot (tests, imports, SFT demonstrations)."""


@dataclass(frozen=True, slots=True)
class SlotLease:
    """One task slot ``(run, task, seq)`` issued to one collector by the store.

    A slot is one GRPO group to collect. The store issues each slot to one collector at a
    time; ``lease`` counts the issues (1 for the first), so a group produced under an older
    lease (its collector was declared dead and the slot re-issued) is refused at write."""

    run_id: str
    task_id: str
    seq: int
    """0, 1, 2, ... per (run, task): how many groups of that task were issued before it."""
    lease: int
    collector_id: str

    @property
    def group_id(self) -> str:
        return f"{self.run_id}/{self.task_id}/{self.seq}"


@dataclass(frozen=True, slots=True)
class CollectorRecord:
    """A registered collector process (a row of the ``collectors`` table)."""

    collector_id: str
    """``{host}:{pid}:{start time}:{random}``; unique per process, never reused."""
    run_id: str
    host: str
    """``collector.host_id`` or the host name."""
    pid: int
    """Pid in the collector's own PID namespace (information only; never used to judge life)."""
    started_at: datetime
    heartbeat_at: datetime
    stopped_at: datetime | None
    """Set by a clean stop, or when a successor on the same spool retired it; None = running
    or killed (then its heartbeat lapses)."""
    policy_version: int | None = None
    """The policy version it serves or is loading (announced before every reload, so
    checkpoint retention keeps that folder); None until it announces one."""


class WriteOutcome(StrEnum):
    """What the store did with one group handed to ``write_groups``."""

    STORED = "stored"
    """Newly stored (the only outcome a collector counts as done)."""
    REPLAYED = "replayed"
    """Already stored with the same episodes: a re-send of the same group (idempotent)."""
    DUPLICATE = "duplicate"
    """ERROR: the id is stored with other episodes (another collector produced it)."""
    SUPERSEDED = "superseded"
    """ERROR: its slot was re-issued to another collector (this one was declared dead)."""
    DEAD = "dead"
    """ERROR: the store failed on this group alone while it took others (e.g. a value one
    backend refuses): set aside in ``dead_groups`` / ``<spool>/dead/``, see retry-dead."""


@dataclass(frozen=True, slots=True)
class WriteReport:
    """Per-group outcome of one ``write_groups`` call."""

    outcomes: dict[str, WriteOutcome]
    """group_id -> outcome, for every group handed in."""

    def ids(self, outcome: WriteOutcome) -> list[str]:
        return [g for g, o in self.outcomes.items() if o is outcome]

    @property
    def n_stored(self) -> int:
        return len(self.ids(WriteOutcome.STORED))

    @property
    def rejected(self) -> dict[str, WriteOutcome]:
        """The groups refused as errors (duplicate or superseded)."""
        bad = (WriteOutcome.DUPLICATE, WriteOutcome.SUPERSEDED)
        return {g: o for g, o in self.outcomes.items() if o in bad}


# ---- what the learner reads -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TrainEpisode:
    episode_id: str
    reward: float | None
    valid: bool
    token_ids_T: np.ndarray
    """int32, all turns concatenated in order."""
    loss_mask_T: np.ndarray
    """bool, True on tokens sampled by the policy (trainable turns)."""
    behaviour_logprobs_T: np.ndarray
    """float32 sampling logprob of each token; NaN where ``loss_mask_T`` is False."""
    policy_versions_T: np.ndarray
    """int32 version that sampled each token; -1 where ``loss_mask_T`` is False."""
    segment_starts: tuple[int, ...] = (0,)
    """Token offsets where a training sequence starts: 0, plus every ``user`` turn after the
    first (a gateway episode whose agent rewrote its history; its segments share the
    episode's advantage, see collector/gateway/assembly.py)."""

    def segments(self) -> list[tuple[int, int]]:
        """(start, end) token ranges of the episode's training sequences."""
        bounds = [*self.segment_starts, len(self.token_ids_T)]
        return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


@dataclass(frozen=True, slots=True)
class TrainGroup:
    group_id: str
    task_id: str
    min_policy_version: int
    """Oldest policy version of any sampled token in the group (what staleness uses)."""
    episodes: tuple[TrainEpisode, ...]
    temperature: float = 1.0
    """Sampling temperature of the group's episodes (``groups.sampling_params``): the
    learner scores their tokens at it when the stored logprobs are processed ones."""


@dataclass(frozen=True, slots=True)
class TrainBatch:
    claim_id: str
    """Identifies this claim; pass it back when registering the trained policy."""
    groups: tuple[TrainGroup, ...]
    dropped_stale: int
    """Groups marked ``dropped_stale`` while assembling this batch."""
    current_version: int
    """Latest registered policy version when the batch was claimed."""

    @property
    def group_ids(self) -> tuple[str, ...]:
        return tuple(g.group_id for g in self.groups)
