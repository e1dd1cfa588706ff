"""Synthetic groups for tests and benchmarks (deterministic, no model needed).

``make_group("g1", n_episodes=4, n_turns=3, tokens_per_turn=50, policy_version=0)`` builds
a GroupRecord whose odd turns are sampled assistant turns (with logprobs and versions) and
whose even turns are prompt / tool-output turns; every token id is derived from the group,
episode and turn, so a test can check that what comes back is exactly what went in.
"""

from __future__ import annotations

import zlib
from datetime import UTC, datetime

import numpy as np

from sandpiper.store.records import (
    EpisodeRecord,
    GroupRecord,
    GroupSampling,
    Role,
    Split,
    StopReason,
    ToolCallRecord,
    TurnRecord,
)


def expected_tokens(group_id: str, sample_index: int, turn: int, n: int) -> np.ndarray:
    """The token ids ``make_group`` puts in that turn (int32)."""
    seed = zlib.crc32(f"{group_id}/{sample_index}/{turn}".encode())
    return ((np.arange(n, dtype=np.int64) * 7919 + seed) % 50_000).astype(np.int32)


def make_turn(group_id: str, sample_index: int, turn: int, n: int, version: int) -> TurnRecord:
    sampled = turn % 2 == 1
    return TurnRecord(
        index=turn,
        role=Role.ASSISTANT if sampled else (Role.USER if turn == 0 else Role.TOOL),
        text=f"turn {turn} of {group_id}/{sample_index}",
        token_ids_T=expected_tokens(group_id, sample_index, turn, n),
        logprobs_T=np.linspace(-3.0, -0.1, n, dtype=np.float32) if sampled else None,
        policy_versions_T=np.full(n, version, np.int32) if sampled else None,
        trainable=sampled,
        started_at=datetime.now(UTC),
        duration_ms=1.5,
        tool_calls=(
            (ToolCallRecord(0, "execute_bash", '{"command": "ls"}', "a\nb\n", 4, 0, 2.0, False),)
            if sampled
            else ()
        ),
    )


def make_group(
    group_id: str,
    *,
    run_id: str = "run",
    task_id: str = "task",
    n_episodes: int = 4,
    n_turns: int = 3,
    tokens_per_turn: int = 50,
    policy_version: int = 0,
    n_invalid: int = 0,
    split: Split = Split.TRAIN,
) -> GroupRecord:
    episodes = []
    for i in range(n_episodes):
        valid = i >= n_invalid
        turns = tuple(
            make_turn(group_id, i, t, tokens_per_turn, policy_version) for t in range(n_turns)
        )
        episodes.append(
            EpisodeRecord(
                episode_id=f"{group_id}#{i}",
                sample_index=i,
                stop_reason=StopReason.SUBMITTED if valid else StopReason.SANDBOX_LOST,
                valid=valid,
                trainable=True,
                reward=float(i % 2) if valid else None,
                reward_breakdown={"tests_passed": i % 2},
                turns=turns,
                started_at=datetime.now(UTC),
                duration_ms=10.0,
                sandbox_id=None,
                error=None if valid else "container vanished",
            )
        )
    return GroupRecord(
        group_id=group_id,
        run_id=run_id,
        task_id=task_id,
        split=split,
        sampling_params=GroupSampling(max_tokens_per_turn=tokens_per_turn),
        episodes=tuple(episodes),
    )
