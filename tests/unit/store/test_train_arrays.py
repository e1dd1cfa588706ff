"""Gateway episodes whose agent rewrote its history are stored as segments: a ``user`` turn
after the first starts a new training sequence with the episode's advantage."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import numpy as np

from sandpiper.store import to_arrow, train_arrays
from sandpiper.store.records import Role
from sandpiper.testing import make_group


def _as_segments(group):
    """Make the third turn of every episode a ``user`` turn (a restarted prompt)."""
    episodes = []
    for e in group.episodes:
        turns = list(e.turns)
        turns[2] = dataclasses.replace(turns[2], role=Role.USER)
        episodes.append(dataclasses.replace(e, turns=tuple(turns)))
    return dataclasses.replace(group, episodes=tuple(episodes))


def _train(group):
    turns = to_arrow.groups_to_arrow([group], datetime.now(UTC))["turns"]
    meta = {e.episode_id: (e.reward, e.valid) for e in group.episodes}
    return train_arrays.train_episodes(turns.select(list(train_arrays.TRAIN_TURN_COLUMNS)), meta)


def test_a_native_episode_is_one_segment():
    episode = _train(make_group("g", n_turns=3, tokens_per_turn=4))[0]
    assert episode.segment_starts == (0,)
    assert episode.segments() == [(0, 12)]


def test_a_user_turn_after_the_first_starts_a_segment():
    group = _as_segments(make_group("g", n_turns=4, tokens_per_turn=4))
    episode = _train(group)[0]
    assert episode.segment_starts == (0, 8)
    assert episode.segments() == [(0, 8), (8, 16)]
    # the second segment starts with the restarted prompt: never in the loss
    lo, hi = episode.segments()[1]
    assert not episode.loss_mask_T[lo : lo + 4].any() and episode.loss_mask_T[lo + 4 : hi].all()
    np.testing.assert_array_equal(
        np.concatenate([episode.token_ids_T[a:b] for a, b in episode.segments()]),
        episode.token_ids_T,
    )


def test_segments_belong_to_their_own_episode():
    """Restarts are found for the whole batch at once and handed back per episode."""
    groups = [_as_segments(make_group("g1", n_turns=5, tokens_per_turn=3)),
              make_group("g2", n_turns=5, tokens_per_turn=3)]  # fmt: skip
    turns = to_arrow.groups_to_arrow(groups, datetime.now(UTC))["turns"]
    meta = {e.episode_id: (e.reward, e.valid) for g in groups for e in g.episodes}
    episodes = train_arrays.train_episodes(
        turns.select(list(train_arrays.TRAIN_TURN_COLUMNS)), meta
    )
    starts = {e.episode_id: e.segment_starts for e in episodes}
    assert starts == {e.episode_id: (0, 6) for e in groups[0].episodes} | {
        e.episode_id: (0,) for e in groups[1].episodes
    }


def test_parse_body_replaces_only_lone_surrogates():
    from sandpiper.collector.gateway.openai_api import parse_body

    assert parse_body(b'{"a": "\\ud800x", "b": "\\uDFFF"}') == {"a": "\ufffdx", "b": "\ufffd"}
    assert parse_body(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}  # a pair is a character
    assert parse_body('{"a": "é 😀"}'.encode()) == {"a": "é 😀"}


def test_parse_body_accepts_what_the_json_module_accepts():
    """orjson parses most bodies; what it refuses takes the json module's path, unchanged."""
    import math

    import pytest

    from sandpiper.collector.gateway.openai_api import APIError, parse_body

    assert math.isnan(parse_body(b'{"t": NaN}')["t"])
    assert parse_body(b'{"n": 123456789012345678901234567890}') == {
        "n": 123456789012345678901234567890
    }
    assert parse_body('{"a": 1}'.encode("utf-16")) == {"a": 1}
    assert parse_body(b'{"a": 1, "a": 2}') == {"a": 2}
    with pytest.raises(APIError, match="not valid JSON: Expecting property name"):
        parse_body(b"{bad")
    with pytest.raises(APIError, match="must be a JSON object"):
        parse_body(b"[1]")


def test_response_bytes_are_starlettes():
    from starlette.responses import JSONResponse

    from sandpiper.collector.gateway.openai_api import encode_json

    payload = {"content": 'é 😀 "q" \\ \n\u2028', "n": [1, None, True], "o": {"k": ""}}
    assert encode_json(payload) == JSONResponse(payload).body
