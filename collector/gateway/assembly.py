"""The calls of one gateway episode become one stored trajectory (the native turn layout).

- The first call, and every call that does not extend an earlier one token for token
  (see :mod:`sandpiper.collector.gateway.session`), contributes a ``user`` turn holding its
  whole prompt: a **segment start**. The learner trains each segment as its own sequence, all
  segments of an episode sharing the episode's advantage (``TrainEpisode.segment_starts``).
- An extending call contributes a ``tool`` turn with only the appended ids (tool results,
  a new user message, the next generation prompt) — not trainable, exactly as the native
  loop stores tool results — so a well-behaved agent's episode is one sequence, identical in
  layout to a native episode.
- Every call contributes an ``assistant`` turn with the sampled ids, their logprobs and
  per-token policy versions, and the tool calls parsed from it (with the outputs the agent
  sent back in the next call, when it did).

:class:`GatewayStats` (segments, restarts and their reasons, re-tokenization mismatches) is
stored in the episode's ``reward_breakdown["gateway"]`` and shown by the
``gateway_episodes`` analysis view, so a mismatch is visible, never hidden.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sandpiper.collector.gateway.session import GatewayCall
from sandpiper.store.records import Role, ToolCallRecord, ToolErrorKind, TurnRecord


@dataclass(frozen=True, slots=True)
class GatewayStats:
    calls: int
    segments: int
    """Training sequences the episode becomes (1 when every call extended the previous)."""
    restart_reasons: dict[str, int] = field(default_factory=dict)
    retokenization_mismatches: int = 0
    """Extending calls where re-rendering the messages would have given other ids."""

    def as_json(self) -> dict[str, object]:
        return {
            "calls": self.calls,
            "segments": self.segments,
            "restart_reasons": dict(self.restart_reasons),
            "retokenization_mismatches": self.retokenization_mismatches,
        }


def call_id(call_index: int, tool_index: int) -> str:
    """The id the gateway gives a tool call (how tool results are matched back to it)."""
    return f"call_{call_index}_{tool_index}"


def assemble(
    calls: Sequence[GatewayCall], decode: Callable[[Sequence[int]], str]
) -> tuple[tuple[TurnRecord, ...], GatewayStats]:
    """Turns of the stored trajectory, and the stats of how they were joined.

    Calls form a prefix tree (each extending call names its parent). A call that extends
    the last call of a chain continues that chain; any other call starts a segment (its
    whole prompt, a ``user`` turn): a restart, or a second branch from the same call (the
    first branch keeps the chain). Chains are stored one after another, in the order they
    started, so each is one contiguous training sequence even when an agent interleaved a
    sub-agent's calls with its own."""
    chains: list[list[GatewayCall]] = []
    tail: dict[int, int] = {}
    """Call index → the chain it ends."""
    restarts = Counter[str]()
    for call in calls:
        parent = call.parent if call.parent is not None else call.index - 1
        chain = tail.pop(parent, None) if call.extends else None
        if chain is None:
            if call.restart_reason is not None:
                restarts[call.restart_reason] += 1
            chain = len(chains)
            chains.append([])
        chains[chain].append(call)
        tail[call.index] = chain
    turns: list[TurnRecord] = []
    for calls_of_chain in chains:
        for k, call in enumerate(calls_of_chain):
            if k == 0:
                turns.append(_plain(len(turns), Role.USER, call.prompt_ids, call, decode))
            elif call.delta_ids:
                turns.append(_plain(len(turns), Role.TOOL, call.delta_ids, call, decode))
            turns.append(_sampled(len(turns), call))
    stats = GatewayStats(
        calls=len(calls),
        segments=len(chains),
        restart_reasons=dict(restarts),
        retokenization_mismatches=sum(c.retokenized_differs for c in calls),
    )
    return tuple(turns), stats


def _plain(
    index: int,
    role: Role,
    ids: Sequence[int],
    call: GatewayCall,
    decode: Callable[[Sequence[int]], str],
) -> TurnRecord:
    return TurnRecord(
        index=index,
        role=role,
        text=decode(ids),
        token_ids_T=np.asarray(ids, dtype=np.int32),
        logprobs_T=None,
        policy_versions_T=None,
        trainable=False,
        started_at=call.started_at,
        duration_ms=0.0,
    )


def _sampled(index: int, call: GatewayCall) -> TurnRecord:
    g = call.generation
    tool_calls = tuple(
        ToolCallRecord(
            index=i,
            name=tc.name,
            arguments_json=tc.arguments_json,
            output=call.tool_outputs.get(call_id(call.index, i), ""),
            output_bytes_total=len(call.tool_outputs.get(call_id(call.index, i), "").encode()),
            exit_code=None,
            duration_ms=0.0,
            timed_out=False,
            error_kind=tc.error_kind if not tc.ok else ToolErrorKind.NONE,
        )
        for i, tc in enumerate(call.tool_calls)
    )
    return TurnRecord(
        index=index,
        role=Role.ASSISTANT,
        text=call.text,
        token_ids_T=np.asarray(g.token_ids_T, dtype=np.int32),
        logprobs_T=np.asarray(g.logprobs_T, dtype=np.float32),
        policy_versions_T=np.asarray(g.policy_versions_T, dtype=np.int32),
        trainable=True,
        started_at=call.started_at,
        duration_ms=call.duration_ms,
        tool_calls=tool_calls,
    )
