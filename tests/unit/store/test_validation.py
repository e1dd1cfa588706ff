"""Ingest validation: an episode whose sampled tokens carry a non-finite logprob or version is
stored invalid (infra, ``bad_sampler_output``), loses nothing, never reaches the learner, and
packing refuses a NaN that slipped through instead of mapping it to a number."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sandpiper.errors import LearnerError
from sandpiper.store import Store
from sandpiper.store.records import INFRA_STOPS, GroupStatus, StopReason
from sandpiper.store.validation import check_episode, check_group
from sandpiper.testing import make_group
from sandpiper.trainer.packing import TrainSequence, pack


def _spoil(group, episode: int, turn: int, **arrays):
    """``group`` with sampled-turn arrays of one episode replaced."""
    ep = group.episodes[episode]
    turns = list(ep.turns)
    turns[turn] = dataclasses.replace(turns[turn], **arrays)
    episodes = list(group.episodes)
    episodes[episode] = dataclasses.replace(ep, turns=tuple(turns))
    return dataclasses.replace(group, episodes=tuple(episodes))


def _logprobs(n: int, *bad: tuple[int, float]) -> np.ndarray:
    lp = np.full(n, -0.5, np.float32)
    for i, v in bad:
        lp[i] = v
    return lp


def test_sound_groups_pass_unchanged() -> None:
    group = make_group("g", n_episodes=3, n_turns=5, tokens_per_turn=8)
    assert check_group(group) is group


@pytest.mark.parametrize(
    ("arrays", "says"),
    [
        ({"logprobs_T": _logprobs(8, (3, np.nan))}, "non-finite logprob (nan)"),
        ({"logprobs_T": _logprobs(8, (0, -np.inf), (7, np.inf))}, "(+inf, -inf)"),
        ({"policy_versions_T": np.array([0, 0, np.nan, 0, 0, 0, 0, 0])}, "no valid policy version"),
        ({"policy_versions_T": np.array([0, 1, 1, -1, 1, 1, 1, 1], np.int32)}, "no valid policy"),
        ({"policy_versions_T": np.array([0.0, 0.5, 0, 0, 0, 0, 0, 0])}, "no valid policy"),
    ],
)
def test_bad_sampler_output_makes_the_episode_invalid_and_keeps_the_data(arrays, says) -> None:
    group = _spoil(make_group("g", n_episodes=3, n_turns=3, tokens_per_turn=8), 1, 1, **arrays)
    checked = check_group(group)
    bad, good = checked.episodes[1], checked.episodes[0]
    assert good is group.episodes[0]
    assert bad.stop_reason is StopReason.BAD_SAMPLER_OUTPUT and bad.stop_reason in INFRA_STOPS
    assert not bad.valid and bad.reward is None and says in bad.error
    was = group.episodes[1]
    assert bad.reward_breakdown["invalidated"] == {
        "stop_reason": str(was.stop_reason), "valid": was.valid, "reward": was.reward,
    }  # fmt: skip
    turn = bad.turns[1]
    if "logprobs_T" in arrays:  # the non-finite logprobs are stored as they came
        np.testing.assert_array_equal(turn.logprobs_T, arrays["logprobs_T"])
    else:  # versions must fit INTEGER: unusable entries become -1 (unknown)
        assert turn.policy_versions_T.dtype == np.int32 and (turn.policy_versions_T == -1).any()
        assert bad.policy_version_range == (0, 1) or bad.policy_version_range == (0, 0)
    assert check_episode(bad) is bad  # idempotent


def test_non_sampled_turns_are_not_checked() -> None:
    group = make_group("g", n_episodes=2, n_turns=3, tokens_per_turn=8)
    turn = dataclasses.replace(group.episodes[0].turns[0], logprobs_T=_logprobs(8, (1, np.nan)))
    ep = dataclasses.replace(group.episodes[0], turns=(turn, *group.episodes[0].turns[1:]))
    group = dataclasses.replace(group, episodes=(ep, *group.episodes[1:]))
    assert check_group(group) is group


def test_store_counts_them_invalid_and_the_learner_never_sees_them(tmp_path) -> None:
    """Real DuckDB file: the invalid episode is stored with its cause, the group whose valid
    episodes fall below two is ``invalid``, and a claimed batch carries it as invalid."""
    store = Store(f"duckdb:///{tmp_path / 's.duckdb'}")
    store.init()
    nan = {"logprobs_T": _logprobs(8, (2, np.nan))}
    kept = _spoil(make_group("kept", run_id="r", n_episodes=3, tokens_per_turn=8), 0, 1, **nan)
    lost = make_group("lost", run_id="r", n_episodes=2, tokens_per_turn=8)
    lost = _spoil(lost, 1, 1, policy_versions_T=np.full(8, np.nan))
    mixed = np.array([0, np.nan, 0, 1, 1, 1, 2.5, 1])  # change points made of bad values
    lost = _spoil(lost, 0, 1, policy_versions_T=mixed)
    assert store.write_groups([kept, lost]) == 2
    with store.connect_readonly() as conn:
        import sqlalchemy as sa

        rows = conn.execute(
            sa.text("SELECT group_id, stop_reason, valid, error FROM episodes WHERE NOT valid")
        ).all()
    assert sorted(r.group_id for r in rows) == ["kept", "lost", "lost"]
    assert all(r.stop_reason == "bad_sampler_output" and "bad sampler output" in r.error
               for r in rows)  # fmt: skip
    assert store.claims.group_ids("r", GroupStatus.INVALID) == ["lost"]
    batch = store.claims.claim(run_id="r", learner_id="l", n_groups=1, max_lag=10)
    assert batch is not None and batch.group_ids == ("kept",)
    spoiled = batch.groups[0].episodes[0]
    assert not spoiled.valid and np.isnan(spoiled.behaviour_logprobs_T).any()
    assert all(e.valid for e in batch.groups[0].episodes[1:])


@pytest.mark.parametrize(
    ("arrays", "sound"),
    [
        ({}, True),
        ({"logprobs_T": _logprobs(8, (3, np.inf))}, False),
        ({"policy_versions_T": np.full(8, -1, np.int32)}, False),
        ({"policy_versions_T": np.full(8, 0.0)}, False),  # floats: check_group decides
        ({"policy_versions_T": np.full(8, np.nan)}, False),
        ({"policy_versions_T": np.array([0, np.nan, 0, 1, 1, 1, 2.5, 1])}, False),
    ],
)
def test_the_conversion_flags_what_validation_must_look_at(arrays, sound) -> None:
    """Ingest checks the buffers ``convert_groups`` concatenates anyway; only a batch it
    flags goes through ``check_group``. A flagged batch still converts (NaN versions too)."""
    from datetime import UTC, datetime

    from sandpiper.store import to_arrow

    group = _spoil(make_group("g", n_episodes=2, tokens_per_turn=8), 1, 1, **arrays)
    tables, ok = to_arrow.convert_groups([make_group("h", tokens_per_turn=8), group],
                                         datetime.now(UTC))  # fmt: skip
    assert ok is sound
    assert tables["turns"].num_rows == (4 + 2) * 3  # episodes × turns


def test_a_flagged_batch_whose_groups_are_sound_is_stored_as_converted(tmp_path) -> None:
    """A NaN logprob on a turn that is not trainable flags the batch, but check_group finds
    nothing wrong: every episode is stored valid, the NaN kept."""
    store = Store(f"duckdb:///{tmp_path / 's.duckdb'}")
    store.init()
    group = make_group("g", run_id="r", n_episodes=2, tokens_per_turn=8)
    group = _spoil(group, 0, 0, logprobs_T=_logprobs(8, (1, np.nan)))  # turn 0: a prompt
    assert store.write_groups([group]) == 1
    with store.connect_readonly() as conn:
        valid = conn.exec_driver_sql("SELECT count(*) FROM episodes WHERE valid").scalar()
    assert valid == 2


def test_packing_refuses_a_non_finite_logprob_on_a_loss_token() -> None:
    ids = np.arange(1, 7, dtype=np.int32)
    mask = np.array([False, False, True, True, True, True])
    ok = TrainSequence("ok", ids, mask, np.where(mask, -1.0, np.nan).astype(np.float32), 1.0)
    pack([ok], [1.0])  # NaN outside the loss is fine: it never enters the arithmetic
    bad_lp = ok.behaviour_logprobs_T.copy()
    bad_lp[4] = np.nan
    bad = dataclasses.replace(ok, episode_id="ep-nan", behaviour_logprobs_T=bad_lp)
    with pytest.raises(LearnerError, match=r"non-finite sampling logprob.*ep-nan"):
        pack([ok, bad], [1.0, 1.0])


def test_the_report_counts_bad_sampler_output_episodes() -> None:
    import polars as pl

    from sandpiper.analysis.report import _cards
    from sandpiper.analysis.views import BAD_SAMPLER_OUTPUT

    assert StopReason.BAD_SAMPLER_OUTPUT.value == BAD_SAMPLER_OUTPUT
    eps = pl.DataFrame(
        {
            "valid": [True, False, False, True],
            "stop_reason": ["submitted", BAD_SAMPLER_OUTPUT, "sandbox_died", "max_turns"],
            "reward": [1.0, None, None, 0.0],
            "passed": [True, False, False, False],
        }
    )
    frames = {
        "episode_summary": eps,
        "zero_variance_share": pl.DataFrame({"n_groups": [1], "n_zero_variance": [0]}),
        "importance_weights": pl.DataFrame({"step": [1]}),
    }
    cards = dict(_cards(frames))
    assert cards["invalid (infra)"] == "2" and cards["bad sampler output"] == "1"


def test_sampling_params_have_one_shape_and_earlier_shapes_read_back():
    from sandpiper.store.records import GroupSampling

    sampling = GroupSampling(temperature=0.7, max_tokens_per_turn=64, tool_format="hermes")
    assert sampling.to_json() == {
        "temperature": 0.7, "top_p": 1.0, "max_tokens_per_turn": 64, "tool_format": "hermes"
    }  # fmt: skip
    assert GroupSampling.from_json(sampling.to_json()) == sampling
    # the collector's shape before: per-episode limits nested under "limits"
    old = {"temperature": 1.0, "top_p": 0.9, "max_tokens_per_turn": 32,
           "limits": {"max_turns": 4, "context_limit": 2048, "system_prompt": "…"}}  # fmt: skip
    assert GroupSampling.from_json(old) == GroupSampling(
        top_p=0.9, max_tokens_per_turn=32, max_turns=4, context_limit=2048
    )
    # tests' and synthetic runs' shape before: max_tokens
    assert GroupSampling.from_json({"max_tokens": 256}).max_tokens_per_turn == 256
    assert GroupSampling.from_json({"endpoint": "http://x/v1", "model": "m"}).model == "m"
