"""The race's arithmetic (bench/race_bench.py): intervals on eval points, time to match, and
the summary over seeds. Pure functions, no I/O.

- :func:`point_interval`: the 95 % interval of one eval point over its held-out episodes,
  Wilson's score interval when every reward is 0 or 1, else the Student-t interval of the
  mean (partial credit, as reasoning-gym's scorers give).
- :func:`time_to_match`: TRL's time to its best eval reward / Sandpiper's time to reach it.
- :func:`ratio_summary`: the median of the per-seed ratios with their range.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

Z95 = 1.959963984540054
"""The standard normal quantile of 0.975: two-sided 95 % intervals."""


def wilson(passes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for ``passes`` of ``n`` (Newcombe 1998, method 3)."""
    if n <= 0 or not 0 <= passes <= n:
        raise ValueError(f"need 0 <= passes <= n and n > 0, got {passes}/{n}")
    p = passes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, lower, upper): the 95 % Student-t interval of the mean of ``values``."""
    from scipy import stats

    n = len(values)
    if n < 2:
        raise ValueError(f"need at least two values for an interval, got {n}")
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def point_interval(rewards: list[float]) -> dict[str, Any]:
    """``mean``, ``lo``, ``hi``, ``n`` and the ``interval`` method of one eval point's
    rewards (its valid episodes). No episodes: mean and bounds are NaN; one non-binary
    reward: the bounds are NaN (a t interval needs two)."""
    n = len(rewards)
    if n == 0:
        nan = float("nan")
        return {"mean": nan, "lo": nan, "hi": nan, "n": 0, "interval": "none"}
    mean = sum(rewards) / n
    if all(r in (0.0, 1.0) for r in rewards):
        lo, hi = wilson(sum(r == 1.0 for r in rewards), n)
        return {"mean": mean, "lo": lo, "hi": hi, "n": n, "interval": "wilson"}
    if n < 2:
        return {"mean": mean, "lo": float("nan"), "hi": float("nan"), "n": n, "interval": "t"}
    _, lo, hi = t_interval(rewards)
    return {"mean": mean, "lo": lo, "hi": hi, "n": n, "interval": "t"}


def time_to_match(curves: dict[str, list[dict[str, Any]]], budget_s: float) -> dict[str, Any]:
    """TRL's time to its best eval reward / Sandpiper's time to reach the same reward (one
    seed's two curves; each point's ``reward`` is its mean)."""
    trl, sp = curves["trl"], curves["sandpiper"]
    best = max(p["reward"] for p in trl)
    t_trl = min(p["t_s"] for p in trl if p["reward"] >= best)
    if t_trl == 0:
        return {"time_to_match_ratio": None, "trl_best_reward": best,
                "note": "TRL never beat the start checkpoint's eval reward: nothing to match"}  # fmt: skip
    reached = [p["t_s"] for p in sp if p["reward"] >= best]
    if not reached:
        return {"time_to_match_ratio": t_trl / budget_s, "ratio_is_upper_bound": True,
                "trl_best_reward": best, "trl_time_s": t_trl,
                "note": "Sandpiper never reached TRL's best eval reward within the budget: "
                        "the ratio is below this bound (< 1)"}  # fmt: skip
    t_sp = min(reached)
    return {"time_to_match_ratio": t_trl / max(t_sp, 1e-9), "ratio_is_upper_bound": False,
            "trl_best_reward": best, "trl_time_s": t_trl, "sandpiper_time_s": t_sp}  # fmt: skip


def ratio_summary(by_seed: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The median of the seeds' ``time_to_match_ratio`` with its range (min, max), over the
    seeds that have one (a ``null`` ratio, TRL never beating the start, is left out and
    counted); how many of the ratios are upper bounds."""
    ratios = [r["time_to_match_ratio"] for r in by_seed.values()
              if r.get("time_to_match_ratio") is not None]  # fmt: skip
    bounds = sum(bool(r.get("ratio_is_upper_bound")) for r in by_seed.values())
    if not ratios:
        return {"time_to_match_ratio_median": None, "time_to_match_ratio_range": None,
                "seeds_with_ratio": 0, "seeds_without_ratio": len(by_seed),
                "seeds_upper_bound": bounds}  # fmt: skip
    return {"time_to_match_ratio_median": statistics.median(ratios),
            "time_to_match_ratio_range": [min(ratios), max(ratios)],
            "seeds_with_ratio": len(ratios), "seeds_without_ratio": len(by_seed) - len(ratios),
            "seeds_upper_bound": bounds}  # fmt: skip


def mean_curve(per_seed: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One side's curve over seeds: at each mark the pooled episodes of every seed (their
    mean and 95 % interval, :func:`point_interval`). The band is the episodes' sampling
    noise; it leaves out the spread between seeds, which the per-seed points show."""
    if not per_seed:
        return []
    marks = [p["t_s"] for p in per_seed[0]]
    out = []
    for i, t_s in enumerate(marks):
        pooled = [r for curve in per_seed for r in curve[i].get("rewards", [])]
        out.append({"t_s": t_s, **point_interval(pooled), "seeds": len(per_seed)})
    return out
