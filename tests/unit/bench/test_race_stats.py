"""The race's arithmetic (bench/race_stats.py): each eval point's 95 % interval, the pooled
curve over seeds, and the time-to-match ratio's median and range over seeds."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from race_stats import mean_curve, point_interval, ratio_summary, time_to_match, wilson


def test_a_binary_point_gets_wilsons_interval() -> None:
    """0/1 rewards: Wilson's score interval (Newcombe 1998, Table I: 81 of 263)."""
    rewards = [1.0] * 81 + [0.0] * (263 - 81)
    p = point_interval(rewards)
    assert p["interval"] == "wilson" and p["n"] == 263
    assert p["mean"] == pytest.approx(81 / 263)
    assert (p["lo"], p["hi"]) == (pytest.approx(0.2553, abs=5e-5), pytest.approx(0.3662, abs=5e-5))
    none = point_interval([0.0] * 48)  # never solved: the interval still has width
    assert none["lo"] == pytest.approx(0.0, abs=1e-12) and 0.0 < none["hi"] < 0.1


def test_partial_credit_gets_a_t_interval() -> None:
    """Any reward other than 0 or 1: the Student-t interval of the mean (scipy's)."""
    from scipy import stats

    rewards = [0.0, 0.5, 1.0, 1.0, 0.25, 0.75]
    p = point_interval(rewards)
    lo, hi = stats.t.interval(0.95, len(rewards) - 1, loc=sum(rewards) / 6,
                              scale=stats.sem(rewards))  # fmt: skip
    assert p["interval"] == "t" and p["n"] == 6
    assert (p["lo"], p["hi"]) == (pytest.approx(lo), pytest.approx(hi))
    assert p["lo"] < p["mean"] < p["hi"]


def test_a_point_with_too_few_episodes_says_so() -> None:
    empty = point_interval([])
    assert empty["n"] == 0 and math.isnan(empty["mean"]) and empty["interval"] == "none"
    one = point_interval([0.5])
    assert one["mean"] == 0.5 and math.isnan(one["lo"]) and math.isnan(one["hi"])
    assert point_interval([1.0])["interval"] == "wilson"  # one binary episode: Wilson's


def test_the_mean_curve_pools_every_seeds_episodes() -> None:
    seed0 = [{"t_s": 0.0, "rewards": [0.0, 1.0]}, {"t_s": 60.0, "rewards": [1.0, 1.0]}]
    seed1 = [{"t_s": 0.0, "rewards": [0.0, 1.0]}, {"t_s": 60.0, "rewards": [0.0, 1.0]}]
    curve = mean_curve([seed0, seed1])
    assert [p["t_s"] for p in curve] == [0.0, 60.0]
    assert [p["n"] for p in curve] == [4, 4] and curve[1]["mean"] == 0.75
    assert (curve[1]["lo"], curve[1]["hi"]) == wilson(3, 4)
    assert curve[0]["seeds"] == 2 and mean_curve([]) == []


def _curve(*points: tuple[float, float]) -> list[dict]:
    return [{"t_s": t, "reward": r} for t, r in points]


def test_ratio_summary_is_the_median_of_the_seeds_with_its_range() -> None:
    trl = _curve((0, 0.2), (60, 0.4), (120, 0.5))
    by_seed = {
        "0": time_to_match({"trl": trl, "sandpiper": _curve((0, 0.2), (30, 0.6))}, 120),
        "1": time_to_match({"trl": trl, "sandpiper": _curve((0, 0.2), (60, 0.5))}, 120),
        "2": time_to_match({"trl": trl, "sandpiper": _curve((0, 0.2), (120, 0.3))}, 120),
    }
    assert [r["time_to_match_ratio"] for r in by_seed.values()] == [4.0, 2.0, 1.0]
    summary = ratio_summary(by_seed)
    assert summary["time_to_match_ratio_median"] == 2.0
    assert summary["time_to_match_ratio_range"] == [1.0, 4.0]
    assert summary["seeds_upper_bound"] == 1 and summary["seeds_with_ratio"] == 3


def test_a_seed_without_a_ratio_is_left_out_and_counted() -> None:
    flat = time_to_match({"trl": _curve((0, 0.3), (60, 0.1)), "sandpiper": _curve((0, 0.3))}, 60)
    assert flat["time_to_match_ratio"] is None and "start" in flat["note"]
    fast = {"time_to_match_ratio": 3.0, "ratio_is_upper_bound": False}
    summary = ratio_summary({"0": flat, "1": fast})
    assert summary["time_to_match_ratio_median"] == 3.0
    assert summary["time_to_match_ratio_range"] == [3.0, 3.0]
    assert summary["seeds_without_ratio"] == 1
    nothing = ratio_summary({"0": flat})
    assert nothing["time_to_match_ratio_median"] is None and nothing["seeds_without_ratio"] == 1


def test_time_to_match_ratio() -> None:
    trl = _curve((0, 0.2), (60, 0.4), (120, 0.5), (180, 0.5))
    fast = time_to_match({"trl": trl, "sandpiper": _curve((0, 0.2), (30, 0.6))}, 180)
    assert fast["time_to_match_ratio"] == pytest.approx(120 / 30)
    assert fast["ratio_is_upper_bound"] is False
    never = time_to_match({"trl": trl, "sandpiper": _curve((0, 0.2), (180, 0.45))}, 180)
    assert never["ratio_is_upper_bound"] is True
    assert never["time_to_match_ratio"] == pytest.approx(120 / 180) and "never" in never["note"]
    flat = time_to_match({"trl": _curve((0, 0.3), (60, 0.1)), "sandpiper": trl}, 180)
    assert flat["time_to_match_ratio"] is None and "start" in flat["note"]
