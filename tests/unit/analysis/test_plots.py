"""The report's plots read at a glance: ticks that never collide, intervals inside the
metric's range, series that stay apart when equal (matplotlib only, no store)."""

from __future__ import annotations

import itertools

import numpy as np
import polars as pl
import pytest

from sandpiper.analysis import plots


def _by_version(n_versions: int, seed: int = 0) -> pl.DataFrame:
    """A ``reward_by_version`` frame of a 0/1 reward: mean reward equals pass rate."""
    rng = np.random.default_rng(seed)
    n = rng.integers(1, 40, n_versions)
    passed = rng.binomial(n, np.linspace(0.05, 0.95, n_versions))
    mean = passed / n
    std = np.sqrt(mean * (1 - mean) * n / np.maximum(n - 1, 1))
    return pl.DataFrame(
        {
            "policy_version": np.arange(n_versions),
            "n_episodes": n,
            "n_valid": n,
            "n_invalid": np.zeros(n_versions, dtype=int),
            "reward_mean": mean,
            "reward_std": np.where(n > 1, std, np.nan),
            "pass_rate": mean,
        }
    ).with_columns(pl.col("reward_std").fill_nan(None))


def _steps(n_steps: int) -> pl.DataFrame:
    ones = np.ones(n_steps)
    return pl.DataFrame(
        {
            "step": np.arange(1, n_steps + 1),
            "is_weight_mean": ones,
            "is_weight_min": ones * 0.8,
            "is_weight_max": ones * 1.3,
            "ess": ones * 0.9,
            "clipped_frac": ones * 0.01,
            "masked_frac": ones * 0.02,
            "kl_sampler_learner": ones * 1e-4,
        }
    )


def _overlaps(axis) -> list[tuple[str, str]]:
    """Pairs of visible tick labels of ``axis`` whose drawn boxes intersect."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(axis.figure)  # what savefig to PNG draws with
    canvas.draw()
    renderer = canvas.get_renderer()
    lo, hi = sorted(axis.get_view_interval())
    boxes = [
        (label.get_text(), label.get_window_extent(renderer))
        for tick, label in zip(axis.get_major_ticks(), axis.get_ticklabels(), strict=True)
        if label.get_visible() and label.get_text() and lo <= tick.get_loc() <= hi
    ]
    assert len(boxes) >= 2, "expected at least two tick labels"
    return [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2) if ba.overlaps(bb)]


@pytest.mark.parametrize("n_versions", [10, 60, 200])
def test_version_ticks_never_collide(n_versions: int) -> None:
    fig = plots.reward_by_version(_by_version(n_versions))
    ax = fig.axes[0]
    assert _overlaps(ax.xaxis) == []
    ticks = [t for t in ax.get_xticks() if 0 <= t <= n_versions - 1]
    assert all(float(t).is_integer() for t in ticks), ticks  # versions are whole numbers


@pytest.mark.parametrize("n_steps", [10, 60, 200])
def test_learner_step_ticks_never_collide(n_steps: int) -> None:
    fig = plots.importance_weights(_steps(n_steps))
    bottom = fig.axes[1]
    assert _overlaps(bottom.xaxis) == []


def test_the_overlap_check_can_fail() -> None:
    """One tick per version (what the plot used to do) collides at 200 versions."""
    fig = plots.reward_by_version(_by_version(200))
    ax = fig.axes[0]
    ax.set_xticks(range(200))
    assert _overlaps(ax.xaxis)


def test_wilson_interval_values_and_range() -> None:
    lo, hi = plots.wilson_interval(np.array([0, 10, 5, 0]), np.array([10, 10, 10, 0]))
    # reference values of the Wilson score interval at 95 % (z = 1.95996)
    assert (lo[0], hi[0]) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert (lo[1], hi[1]) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert np.nanmin(lo) >= 0.0 and np.nanmax(hi) <= 1.0
    assert (lo[2], hi[2]) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert np.isnan(lo[3]) and np.isnan(hi[3])  # no episodes: no interval


def test_mean_interval_is_clipped_and_needs_two_samples() -> None:
    mean = np.array([0.1, 0.5, 0.9])
    lo, hi = plots.mean_interval(mean, np.array([0.5, 0.0, 0.3]), np.array([3, 5, 1]))
    assert lo[0] == 0.0 and 0.1 < hi[0] <= 1.0  # t(2) * 0.5 / sqrt(3) reaches below 0
    assert lo[1] == hi[1] == 0.5
    assert np.isnan(lo[2]) and np.isnan(hi[2])


def _band_ys(ax) -> np.ndarray:
    ys = [c.get_paths()[0].vertices[:, 1] for c in ax.collections if c.get_paths()]
    return np.concatenate(ys)


@pytest.mark.parametrize("n_versions", [10, 200])
def test_bands_stay_inside_zero_one(n_versions: int) -> None:
    ax = plots.reward_by_version(_by_version(n_versions)).axes[0]
    ys = _band_ys(ax)
    ys = ys[np.isfinite(ys)]
    assert ys.size and ys.min() >= 0.0 and ys.max() <= 1.0
    assert ax.get_ylim()[0] > -0.05 and ax.get_ylim()[1] < 1.05


def test_equal_series_stay_distinguishable() -> None:
    """Mean reward equals pass rate for a 0/1 reward: the lines must still differ."""
    ax = plots.reward_by_version(_by_version(10)).axes[0]
    reward, rate = ax.get_lines()[:2]
    assert reward.get_linestyle() != rate.get_linestyle()
    assert reward.get_marker() != rate.get_marker()
    assert reward.get_color() != rate.get_color()
    assert not np.array_equal(reward.get_xdata(), rate.get_xdata())  # dodged sideways
    ax200 = plots.reward_by_version(_by_version(200)).axes[0]
    a, b = ax200.get_lines()[:2]
    assert a.get_linestyle() != b.get_linestyle() and a.get_color() != b.get_color()


def test_labels_the_policy_made_up_stay_short_and_apart(recwarn):
    """A tool name of thousands of characters (with newlines and escapes) collapsed the tool
    plot's axes (matplotlib warned, the PNG had no room left for bars); labels are one
    line of at most ``LABEL_CHARS`` now, and two names cut to the same label stay two bars."""
    long = "PWNED\n" + "x" * 5000
    df = pl.DataFrame(
        {
            "tool": [long, long + "y", "execute_bash", "\x1b]0;title\x07"],
            "n_calls": [3, 2, 10, 1],
            "n_errors": [1, 0, 2, 1],
            "n_timeouts": [0, 0, 1, 0],
            "duration_ms_p95": [5.0, 6.0, 40.0, 1.0],
        }
    )
    fig = plots.tool_usage(df)
    fig.canvas.draw()
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert len(ticks) == len(set(ticks)) == 4, ticks
    assert all(len(t) <= plots.LABEL_CHARS + 4 and "\n" not in t for t in ticks), ticks
    assert "\\x1b]0;title\\x07" in ticks
    assert fig.axes[0].get_position().height > 0.3  # the bars keep most of the figure
    assert not [w for w in recwarn if "constrained_layout" in str(w.message)]
