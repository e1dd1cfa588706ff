"""Arrow → the learner's arrays: per-episode token ids, loss mask, sampling logprobs and
policy versions from fetched turn rows (and the turns as list columns for analysis tools).
"""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sandpiper.store import packed, text
from sandpiper.store.records import TrainEpisode

TRAIN_TURN_COLUMNS = (
    "episode_id",
    "turn_index",
    "token_ids",
    "logprobs",
    "policy_version",
    "policy_version_changes",
    "trainable",
    "role",
)
"""Columns of ``turns`` that :func:`train_episodes` needs (rows in any order)."""


def sort_turns(turns: pa.Table) -> pa.Table:
    """``turns`` ordered by (episode_id, turn_index), copying token lists only as a last resort.

    Not ``ORDER BY`` in SQL: the database would sort the wide token-list payload (~40 ms of a
    64-group claim). DuckDB returns a filtered scan as record batches that are each in
    insertion order (= episode/turn order: groups are inserted whole, turns in order) but
    may come in a rotated order (parallel scan); reordering whole batches is zero-copy.
    """
    batches = [b for b in turns.to_batches() if b.num_rows]
    batches.sort(key=lambda b: (b["episode_id"][0].as_py(), b["turn_index"][0].as_py()))
    turns = pa.Table.from_batches(batches, schema=turns.schema)
    # Arrow's sort, not numpy: numpy would turn the ids into Python objects (and import pandas).
    order = pc.sort_indices(
        turns.select(["episode_id", "turn_index"]),
        sort_keys=[("episode_id", "ascending"), ("turn_index", "ascending")],
    ).to_numpy()
    if np.array_equal(order, np.arange(len(order))):
        return turns
    return turns.take(pa.array(order))


def _token_logprobs(turns: pa.Table, trainable: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per-token logprobs: the trainable rows' values, NaN elsewhere (arrays on other rows
    are left out)."""
    out = np.full(len(mask), np.nan, np.float32)
    present = pc.is_valid(turns["logprobs"]).to_numpy(zero_copy_only=False)
    if np.array_equal(present, trainable):
        out[mask] = packed.packed_values(turns["logprobs"], "<f4")
    else:
        out[mask] = packed.unpack(turns.filter(pa.array(trainable))["logprobs"], "<f4")
    return out


def _token_versions(turns: pa.Table, trainable: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per-token versions: each trainable row's version repeated over its tokens (then the
    rare change points applied), -1 elsewhere; one array, no scatter through a mask."""
    first = pc.fill_null(turns["policy_version"], -1).to_numpy(zero_copy_only=False)
    out = np.repeat(np.where(trainable, first, -1).astype(np.int32), lengths)
    changes = turns["policy_version_changes"]
    if changes.null_count == len(changes):
        return out
    starts = np.r_[0, np.cumsum(lengths)]
    for row in np.flatnonzero(trainable).tolist():  # only turns sampled across an update
        ch = changes[row].as_py()
        if ch:
            out[starts[row] : starts[row + 1]] = packed.expand_versions(
                int(first[row]), ch, lengths[row]
            )
    return out


def _segment_starts(
    is_user: np.ndarray, starts: np.ndarray, token_starts: np.ndarray
) -> dict[int, list[int]]:
    """Episode index → token offsets of its ``user`` turns after its first row: rare (a
    gateway episode whose agent rewrote its history), so found in one pass, not per row."""
    out: dict[int, list[int]] = {}
    rows = np.flatnonzero(is_user)
    rows = rows[~np.isin(rows, starts)]
    episode = np.searchsorted(starts, rows, side="right") - 1
    for e, r in zip(episode.tolist(), rows.tolist(), strict=True):
        out.setdefault(e, []).append(int(token_starts[r] - token_starts[starts[e]]))
    return out


def train_episodes(
    turns: pa.Table, episode_meta: dict[str, tuple[float | None, bool]]
) -> list[TrainEpisode]:
    """Per-episode token arrays from turn rows (any order; sorted by episode_id, turn_index).

    ``episode_meta`` maps episode_id → (reward, valid); episodes come out in episode_id order.
    Every per-token array is built whole for the batch and sliced per episode; fresh memory
    is the cost that counts here (a 64-group claim is ~5 M tokens: page faults, not
    arithmetic, made this step's CPU time swing from 20 to 150 ms), so no temporary
    copies: logprobs are read from a view of the Arrow buffer, versions are one
    ``np.repeat``.
    """
    if turns.num_rows == 0:
        return []
    turns = sort_turns(turns)
    lengths = packed.packed_lengths(turns["token_ids"], "<i4")
    tokens = packed.unpack(turns["token_ids"], "<i4")
    trainable = turns["trainable"].to_numpy(zero_copy_only=False).astype(bool)
    mask = np.repeat(trainable, lengths)  # per token: its turn's flag (no index array)
    logprobs = _token_logprobs(turns, trainable, mask)
    versions = _token_versions(turns, trainable, lengths)

    episode_col, n_rows = turns["episode_id"], turns.num_rows
    changed = pc.not_equal(episode_col.slice(1), episode_col.slice(0, n_rows - 1))
    starts = np.flatnonzero(np.r_[True, changed.to_numpy(zero_copy_only=False)])
    episode_ids = text.decode_column(episode_col.take(pa.array(starts)))
    token_starts = np.r_[0, np.cumsum(lengths)]
    bounds = token_starts[np.r_[starts, n_rows]].tolist()
    # a user turn after an episode's first turn starts a new training sequence (segment)
    is_user = pc.equal(turns["role"], "user").to_numpy(zero_copy_only=False).astype(bool)
    restarts = _segment_starts(is_user, starts, token_starts)
    out = []
    for i, (episode_id, (lo, hi)) in enumerate(
        zip(episode_ids, itertools.pairwise(bounds), strict=True)
    ):
        reward, valid = episode_meta[episode_id]
        out.append(
            TrainEpisode(
                episode_id=episode_id,
                reward=reward,
                valid=valid,
                token_ids_T=tokens[lo:hi],
                loss_mask_T=mask[lo:hi],
                behaviour_logprobs_T=logprobs[lo:hi],
                policy_versions_T=versions[lo:hi],
                segment_starts=(0, *restarts.get(i, ())),
            )
        )
    return out


def turns_as_lists(turns: pa.Table) -> pa.Table:
    """``turns`` rows with list columns instead of the packed layout: ``token_ids`` (int32),
    ``logprobs`` (float32) and per-token ``policy_versions`` (null where nothing was
    sampled), for Parquet export and analysis tools."""
    n = turns.num_rows
    lengths = packed.packed_lengths(turns["token_ids"], "<i4")
    offsets = pa.array(np.r_[0, np.cumsum(lengths)].astype(np.int32))
    tokens = pa.ListArray.from_arrays(offsets, pa.array(packed.unpack(turns["token_ids"], "<i4")))
    sampled = pc.is_valid(turns["logprobs"]).to_numpy(zero_copy_only=False)
    mask = pa.array(~sampled)
    lp_len = np.where(sampled, lengths, 0)
    lp_offsets = pa.array(np.r_[0, np.cumsum(lp_len)].astype(np.int32))
    logprobs = pa.ListArray.from_arrays(
        lp_offsets, pa.array(packed.unpack(turns["logprobs"], "<f4")), mask=mask
    )
    first = turns["policy_version"].to_pylist()
    changes = turns["policy_version_changes"].to_pylist()
    versions = packed.pack(
        [packed.expand_versions(first[i], changes[i], lengths[i]) if sampled[i] else None
         for i in range(n)], "<i4",
    )  # fmt: skip
    versions_list = pa.ListArray.from_arrays(
        lp_offsets, pa.array(packed.unpack(versions, "<i4")), mask=mask
    )
    out = turns.drop_columns(["token_ids", "logprobs", "policy_version", "policy_version_changes"])
    return (
        out.append_column("token_ids", tokens)
        .append_column("logprobs", logprobs)
        .append_column("policy_versions", versions_list)
    )
