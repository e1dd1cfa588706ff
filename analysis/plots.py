"""The report's figures: each function takes polars DataFrames from :mod:`sandpiper.analysis.api`
and returns a matplotlib Figure (Agg backend; nothing is shown on screen).

An empty input gives a figure that says "no data" rather than an error, so a report of a
run that has not trained yet still renders every section.

Read at a glance at any run length: integer axes get only as many ticks as fit
(``_integer_ticks``); uncertainty is a 95 % interval that stays inside the metric's range
(Wilson for pass rates, a t-interval clipped to [0, 1] for mean rewards), never ± std; series
that may coincide differ in colour, line style and marker.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from sandpiper.analysis.terminal import neutralize

if TYPE_CHECKING:
    import polars as pl
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FIG_SIZE = (7.0, 3.6)
ROLLING_EPISODES = 32
"""Window of the rolling mean in the reward-over-time plot."""


LABEL_CHARS = 40
"""Longest axis label drawn from the store (a task id, a tool name the policy made up)."""


def _label(text: str) -> str:
    """``text`` as one short, safe axis label: control characters shown as escapes, every
    whitespace run (newlines too) one space, cut at :data:`LABEL_CHARS` with an ellipsis.
    A label of thousands of characters left the plot no room: its axes collapsed."""
    one_line = " ".join(neutralize(text).split())
    return one_line if len(one_line) <= LABEL_CHARS else one_line[: LABEL_CHARS - 1] + "…"


def _labels(texts: Iterable[str]) -> list[str]:
    """:func:`_label` of each, numbered where two come out equal: a bar chart's categories
    are its labels, and two equal labels would draw two bars on one row."""
    seen: dict[str, int] = {}
    out = []
    for text in texts:
        label = _label(text)
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return out


def _figure() -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure

    # Figure() directly (not pyplot): no global state, no GUI backend, nothing to close.
    fig = Figure(figsize=FIG_SIZE, dpi=100, layout="constrained")
    return fig, fig.add_subplot()


def _no_data(ax: Axes, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


CONFIDENCE = 0.95
"""Level of every confidence interval drawn in the report."""
MARKERS_UP_TO = 40
"""Points per series up to which markers are drawn; past it they would merge into a band."""


def wilson_interval(passed: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval of a pass rate (``passed`` of ``n``), always inside [0, 1].

    Unlike mean ± std it does not collapse to a point at 0/n or n/n, so a version where
    every episode failed still shows how little a few episodes say. NaN where ``n`` is 0.
    """
    from scipy.stats import norm

    z = float(norm.ppf(0.5 + CONFIDENCE / 2))
    n = np.asarray(n, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.asarray(passed, dtype=float) / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return np.clip(centre - half, 0.0, 1.0), np.clip(centre + half, 0.0, 1.0)


def mean_interval(
    mean: np.ndarray, std: np.ndarray, n: np.ndarray, lo: float = 0.0, hi: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Student-t interval of a mean, clipped to the metric's range [``lo``, ``hi``].

    NaN where fewer than two samples leave the spread unknown (no band is drawn there).
    """
    from scipy.stats import t

    n = np.asarray(n, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = t.ppf(0.5 + CONFIDENCE / 2, np.where(n >= 2, n - 1, np.nan))
        half = q * np.asarray(std, dtype=float) / np.sqrt(n)
    return np.clip(mean - half, lo, hi), np.clip(mean + half, lo, hi)


def _integer_ticks(axis: Any) -> None:
    """At most as many integer ticks as the axis has room for, whatever the data's count
    (one tick per version ran the labels into each other from a few dozen versions on)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(nbins="auto", integer=True, min_n_ticks=1))


def reward_by_version(df: pl.DataFrame) -> Figure:
    """Mean reward and pass rate per version, each with its 95 % interval as a band.

    The two series are often equal (a 0/1 reward *is* the pass indicator), so they differ
    in colour, line style and marker, and pass rate is drawn a fifth of a version to the
    right: neither hides the other.
    """
    fig, ax = _figure()
    title = "Reward and pass rate by policy version"
    if df.is_empty():
        _no_data(ax, title)
        return fig
    df = df.sort("policy_version")
    versions = df["policy_version"].to_numpy().astype(float)
    n = df["n_valid"].fill_null(0).to_numpy()
    mean = df["reward_mean"].fill_null(float("nan")).to_numpy()
    std = df["reward_std"].fill_null(float("nan")).to_numpy()
    rate = df["pass_rate"].fill_null(float("nan")).to_numpy()
    markers = len(versions) <= MARKERS_UP_TO
    shift = 0.2 if markers else 0.0  # lines of different styles need no dodge; markers do
    pct = f"{CONFIDENCE:.0%}"
    series: list[tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray], dict[str, Any]]] = [
        (versions, mean, mean_interval(mean, std, n),
         {"color": "tab:blue", "ls": "-", "marker": "o" if markers else "",
          "label": f"mean reward ({pct} t-interval)"}),
        (versions + shift, rate, wilson_interval(np.rint(rate * n), n),
         {"color": "tab:orange", "ls": "--", "marker": "s" if markers else "", "mfc": "white",
          "label": f"pass rate ({pct} Wilson interval)"}),
    ]  # fmt: skip
    for x, y, (lo, hi), style in series:
        ax.fill_between(x, lo, hi, color=style["color"], alpha=0.18, lw=0)
        ax.plot(x, y, ms=4, lw=1.6, **style)
    ax.set(title=title, xlabel="policy version that started the episode", ylabel="reward / rate")
    ax.set_ylim(-0.02, 1.02)
    _integer_ticks(ax.xaxis)
    ax.legend(loc="best", fontsize=8)
    return fig


def reward_over_time(by_minute: pl.DataFrame, episodes: pl.DataFrame | None = None) -> Figure:
    """Per-minute means (dots) and, given ``episodes``, a rolling mean over valid episodes
    in start order (the per-minute means of a small run are mostly noise)."""
    fig, ax = _figure()
    title = "Reward over time"
    if by_minute.is_empty():
        _no_data(ax, title)
        return fig
    ax.plot(by_minute["minute"].to_list(), by_minute["reward_mean"].to_list(), ".", alpha=0.5,
            label="per-minute mean")  # fmt: skip
    if episodes is not None and episodes.height:
        valid = episodes.filter(episodes["valid"]).sort("started_at")
        window = max(1, min(ROLLING_EPISODES, valid.height))
        rolling = valid["reward"].rolling_mean(window_size=window, min_samples=1)
        ax.plot(valid["started_at"].to_list(), rolling.to_list(), lw=2,
                label=f"rolling mean ({window} episodes)")  # fmt: skip
    ax.set(title=title, xlabel="episode start (UTC)", ylabel="reward (valid episodes)")
    ax.legend(loc="best")
    fig.autofmt_xdate()
    return fig


def pass_rate_by_task(df: pl.DataFrame, max_tasks: int = 30) -> Figure:
    fig, ax = _figure()
    title = "Pass rate per task"
    df = df.filter(df["n_valid"] > 0).sort("pass_rate").head(max_tasks)
    if df.is_empty():
        _no_data(ax, title)
        return fig
    rate = df["pass_rate"].to_numpy()
    n = df["n_valid"].to_numpy()
    lo, hi = wilson_interval(np.rint(rate * n), n)
    ax.barh(_labels(df["task_id"]), rate, color="tab:green",
            xerr=np.clip(np.vstack([rate - lo, hi - rate]), 0.0, None), error_kw={"lw": 1, "capsize": 2})  # fmt: skip
    ax.set(title=f"{title} (lowest {df.height}; {CONFIDENCE:.0%} Wilson intervals)",
           xlabel="pass rate", xlim=(0, 1))  # fmt: skip
    return fig


def staleness(df: pl.DataFrame) -> Figure:
    fig, ax = _figure()
    title = "Staleness of consumed groups"
    consumed = df.filter(df["status"] == "consumed")
    dropped = int(df.filter(df["status"] == "dropped_stale")["n_groups"].sum() or 0)
    if consumed.is_empty() and not dropped:
        _no_data(ax, title)
        return fig
    ax.bar(consumed["staleness"].to_list(), consumed["n_groups"].to_list(), label="consumed")
    ax.set(
        title=f"{title} ({dropped} dropped as stale)",
        xlabel="versions behind the learner",
        ylabel="groups",
    )
    _integer_ticks(ax.xaxis)
    return fig


def importance_weights(df: pl.DataFrame) -> Figure:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIG_SIZE[0], FIG_SIZE[1] * 1.4), dpi=100, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    # SFT steps have no importance weights; other metrics may be absent on old runs (NaN)
    if "is_weight_mean" in df.columns:
        df = df.drop_nulls("is_weight_mean").fill_null(float("nan"))
    if df.is_empty():
        _no_data(top, "Importance weights per learner step")
        bottom.set_axis_off()
        return fig
    steps = df["step"].to_list()
    top.fill_between(
        steps,
        df["is_weight_min"].to_list(),
        df["is_weight_max"].to_list(),
        alpha=0.25,
        label="min … max",
    )
    few = len(steps) <= MARKERS_UP_TO
    top.plot(steps, df["is_weight_mean"].to_list(), marker="o" if few else "", label="mean")
    top.axhline(1.0, color="grey", lw=0.8, ls="--")
    top.set(title="Importance weights per learner step", ylabel="w = π_prox / π_behav")
    top.legend(loc="best")
    for name in ("ess", "clipped_frac", "masked_frac"):
        bottom.plot(steps, df[name].to_list(), marker="." if few else "", label=name)
    kl = bottom.twinx()
    kl.plot(steps, df["kl_sampler_learner"].to_list(), color="black", ls=":", label="KL (right)")
    kl.set_ylabel("KL sampler→learner")
    bottom.set(xlabel="learner step", ylabel="fraction")
    _integer_ticks(bottom.xaxis)
    lines = bottom.get_lines() + kl.get_lines()
    bottom.legend(lines, [line.get_label() for line in lines], loc="center left", fontsize=8)
    return fig


def tool_usage(df: pl.DataFrame) -> Figure:
    fig, ax = _figure()
    title = "Tool calls (errors and time-outs)"
    if df.is_empty():
        _no_data(ax, title)
        return fig
    tools = _labels(df["tool"])  # names the policy made up
    ok = (df["n_calls"] - df["n_errors"]).to_list()
    ax.barh(tools, ok, label="ran", color="tab:blue")
    timeouts = df["n_timeouts"].to_list()
    other = (df["n_errors"] - df["n_timeouts"]).to_list()
    ax.barh(tools, other, left=ok, label="error", color="tab:red")
    left = [a + b for a, b in zip(ok, other, strict=True)]
    ax.barh(tools, timeouts, left=left, label="timed out", color="tab:orange")
    for y, (n, p95) in enumerate(zip(df["n_calls"], df["duration_ms_p95"], strict=True)):
        ax.text(n, y, f"  p95 {p95:.0f} ms", va="center", fontsize=8)
    ax.set(title=title, xlabel="calls")
    ax.set_xlim(0, max(df["n_calls"].to_list()) * 1.3)  # room for the p95 labels
    ax.legend(loc="upper right", fontsize=8)
    return fig


def failure_breakdown(df: pl.DataFrame) -> Figure:
    fig, ax = _figure()
    title = "Failures: episode outcomes and tool-call errors"
    if df.is_empty():
        _no_data(ax, title)
        return fig
    labels = _labels(
        f"{lvl}: {kind}{' (infra)' if infra else ''}"
        for lvl, kind, infra in zip(df["level"], df["kind"], df["infra"], strict=True)
    )
    colors = ["tab:red" if infra else "tab:gray" for infra in df["infra"]]
    ax.barh(labels, df["n"].to_list(), color=colors)
    ax.invert_yaxis()
    ax.set(title=title, xlabel="count")
    return fig


def episode_lengths(episodes: pl.DataFrame) -> Figure:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIG_SIZE[0], FIG_SIZE[1]), dpi=100, layout="constrained")
    axes = fig.subplots(1, 3)
    if episodes.is_empty():
        _no_data(axes[0], "Episode lengths")
        for ax in axes[1:]:
            ax.set_axis_off()
        return fig
    for ax, (col, label) in zip(
        axes,
        [("n_turns", "turns"), ("completion_tokens", "sampled tokens"), ("duration_ms", "seconds")],
        strict=True,
    ):
        values = episodes[col].to_numpy()
        if col == "duration_ms":
            values = values / 1000.0
        ax.hist(values, bins=20, color="tab:purple")
        ax.set(xlabel=label)
    axes[0].set_ylabel("episodes")
    fig.suptitle("Episode length distributions")
    return fig


REPLAY_PANELS = (
    ("ess", "effective sample size", (0.0, 1.05)),
    ("masked_frac", "tokens without gradient", None),
    ("grad_rel_var", "gradient variance / |G|²", None),
    ("cos_ref", "cosine to unbiased gradient", None),
)


def replay(summary: pl.DataFrame) -> Figure:
    """``sandpiper replay``'s per-variant means (one bar each) in four panels; the
    reference (untruncated IS) is the grey bar."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIG_SIZE[0] * 1.4, FIG_SIZE[1] * 1.3), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(REPLAY_PANELS), sharey=True)
    if summary.is_empty():
        _no_data(axes[0], "Estimator replay")
        for ax in axes[1:]:
            ax.set_axis_off()
        return fig
    names = summary["variant"].to_list()
    colors = ["tab:gray" if n == "reference" else "tab:blue" for n in names]
    for ax, (col, label, xlim) in zip(axes, REPLAY_PANELS, strict=True):
        values = [float("nan") if v is None else v for v in summary[col].to_list()]
        ax.barh(names, values, color=colors)
        ax.set(title=label, xlim=xlim)
        ax.tick_params(axis="x", labelsize=8)
    axes[0].invert_yaxis()
    steps = str(summary["steps"].max())
    fig.suptitle(f"Estimators on the stored batches (mean over {steps} learner steps)")
    return fig
