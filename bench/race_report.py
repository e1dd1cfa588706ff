"""The race's evaluation and report (bench/race_bench.py): every seed's checkpoints through
one harness, the curves with their intervals, the summary over seeds, the figure.

``race.json``:

- ``summary``: the figures over seeds (``time_to_match_ratio`` is their median, with
  ``time_to_match_ratio_range`` [min, max]; each side's throughput and CPU shares are means
  over seeds), and ``by_seed``: each seed's ``time_to_match`` (with its upper-bound / null
  note);
- ``curves``: ``{side: {seed: [point, ...]}}``, each point the eval of the checkpoint of one
  wall-clock mark: ``mean`` (= ``reward``), ``lo``, ``hi`` (its 95 % interval over the held-out
  episodes, bench/race_stats.py), ``n``, the episodes' ``rewards``;
- ``mean_curves``: ``{side: [point, ...]}``, the seeds' episodes pooled at each mark;
- ``seeds``: ``{seed: {"sides": {side: what it ran}}}``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from race_profile import summary_line
from race_setup import RaceSettings, model_hash
from race_stats import mean_curve, point_interval, ratio_summary, time_to_match

SIDES = ("trl", "sandpiper")
COLOURS = {"trl": "tab:orange", "sandpiper": "tab:blue"}


def checkpoints_of(side: str, seed: int, result: dict[str, Any]) -> list[Any]:
    """The checkpoints one side wrote in one seed's run, with the time each existed."""
    from race_eval import Checkpoint

    if side == "sandpiper":
        return [Checkpoint(side, v["checkpoint"], v["t_s"], f"s{seed}-sandpiper-v{v['version']}")
                for v in result["versions"]]  # fmt: skip
    return [Checkpoint(side, r["checkpoint"], r["checkpoint_t_s"], f"s{seed}-trl-step{r['step']}")
            for r in result["steps_log"] if "checkpoint" in r]  # fmt: skip


def point(evaluated: dict[str, Any], t_s: float, **extra: Any) -> dict[str, Any]:
    """One curve point: the evaluation with its interval (``reward`` is the mean)."""
    return {"t_s": t_s, **extra, **evaluated, **point_interval(evaluated.get("rewards", []))}


def evaluate(
    settings: RaceSettings,
    seeds: dict[str, dict[str, Any]],
    sp_cfg: Any,
    start: Path,
    heldout: Path,
    root: Path,
    marks: list[float],
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """``{side: {seed: curve}}``: the start, then each mark's checkpoint, one harness."""
    from race_eval import Checkpoint, Harness, at_marks

    start_ckpt = Checkpoint("start", str(start), 0.0, "start")
    curves: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with Harness(sp_cfg, start=start, heldout=heldout, out=root / "eval",
                 samples=settings.eval_samples_per_task) as harness:  # fmt: skip
        start_point = point(harness.evaluate(start_ckpt), 0.0)
        for seed, run in seeds.items():
            for side, result in run["sides"].items():
                chosen = at_marks(checkpoints_of(side, int(seed), result), marks, start_ckpt)
                curve = [start_point]
                curve += [point(harness.evaluate(c), m, checkpoint_t_s=c.t_s)
                          for m, c in zip(marks, chosen, strict=True)]  # fmt: skip
                curves.setdefault(side, {})[seed] = curve
    return curves


def throughput(result: dict[str, Any], budget_s: float) -> dict[str, float]:
    return {
        "samples_per_hour": result["samples"] / budget_s * 3600,
        "learner_tokens_per_s": result["learner_tokens"] / max(result["learner_train_s"], 1e-9),
        "steps": result["steps"],
    }


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def side_summary(
    results: list[dict[str, Any]], curves: list[list[dict[str, Any]]], budget_s: float
) -> dict[str, Any]:
    """One side's figures, each the mean over its seeds; CPU shares likewise."""
    rows = [throughput(r, budget_s) for r in results]
    out: dict[str, Any] = {k: _mean([row[k] for row in rows]) for k in rows[0]} if rows else {}
    out["final_eval_reward"] = _mean([c[-1]["reward"] for c in curves])
    out["best_eval_reward"] = _mean([max(p["reward"] for p in c) for c in curves])
    profiles = [r["cpu_profile"] for r in results if r.get("cpu_profile")]
    if profiles:
        out["cpu_share"] = {
            k: _mean([p["share"][k] for p in profiles]) for k in profiles[0]["share"]
        }
    return out


def summarise(
    settings: RaceSettings,
    seeds: dict[str, dict[str, Any]],
    curves: dict[str, dict[str, list[dict[str, Any]]]],
    start: Path,
    overrides: list[str],
) -> dict[str, Any]:
    budget_s = settings.minutes * 60
    any_curve = next((c for by_seed in curves.values() for c in by_seed.values()), None)
    first_trl: dict[str, Any] = next(
        (r["sides"]["trl"] for r in seeds.values() if "trl" in r["sides"]), {}
    )
    summary: dict[str, Any] = {
        "model": settings.model, "suite": settings.suite, "minutes_per_side": settings.minutes,
        "seeds": sorted(int(s) for s in seeds), "eval_marks": settings.eval_marks,
        "start_sha256": model_hash(start), "start_made": start_record(start),
        "heldout_tasks": settings.heldout_tasks,
        "eval_samples_per_checkpoint": settings.heldout_tasks * settings.eval_samples_per_task,
        "eval_reward_start": any_curve[0]["reward"] if any_curve else None,
        "trl_generation_path": first_trl.get("generation_path"),
        "sandpiper_overrides": overrides,
    }  # fmt: skip
    for side, by_seed in curves.items():
        results = [seeds[s]["sides"][side] for s in by_seed]
        summary[side] = side_summary(results, list(by_seed.values()), budget_s)
    if set(curves) == set(SIDES):
        by_seed_ratio = {s: time_to_match({side: curves[side][s] for side in SIDES}, budget_s)
                         for s in curves["trl"] if s in curves["sandpiper"]}  # fmt: skip
        stats = ratio_summary(by_seed_ratio)
        summary["time_to_match_ratio"] = stats.pop("time_to_match_ratio_median")
        summary.update(stats)
        summary["by_seed"] = by_seed_ratio
    return summary


def start_record(start: Path) -> dict[str, Any] | None:
    """How the start was made (bench/race_start.py's record; None for an older start)."""
    from race_start import START_RECORD

    path = start / START_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def report(
    settings: RaceSettings,
    seeds: dict[str, dict[str, Any]],
    curves: dict[str, dict[str, list[dict[str, Any]]]],
    start: Path,
    root: Path,
    overrides: list[str],
) -> dict[str, Any]:
    """``race.json``'s content; writes ``race.png`` and prints each side's CPU profile."""
    means = {side: mean_curve(list(by_seed.values())) for side, by_seed in curves.items()}
    png = root / "race.png"
    n = len(seeds)
    title = (f"{settings.model} / {settings.suite}: {settings.minutes:g} min per side, "
             f"{n} seed{'s' if n != 1 else ''}, one host")  # fmt: skip
    if curves:
        plot(curves, means, png, title)
    for seed, run in seeds.items():
        for side, result in run["sides"].items():
            if result.get("cpu_profile"):
                print(f"seed {seed} " + summary_line(side, result["cpu_profile"]), flush=True)
    return {"summary": summarise(settings, seeds, curves, start, overrides), "curves": curves,
            "mean_curves": means, "settings": settings.as_dict(), "seeds": seeds,
            "figure": str(png)}  # fmt: skip


def plot(
    curves: dict[str, dict[str, list[dict[str, Any]]]],
    means: dict[str, list[dict[str, Any]]],
    path: Path,
    title: str,
) -> None:
    """Each side's mean curve (the seeds' episodes pooled) with its 95 % band, and each
    seed's points faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for side, by_seed in curves.items():
        colour = COLOURS.get(side)
        for curve in by_seed.values():
            ax.scatter([p["t_s"] / 60 for p in curve], [p["reward"] for p in curve],
                       color=colour, alpha=0.25, s=12)  # fmt: skip
        mean = means[side]
        minutes = [p["t_s"] / 60 for p in mean]
        ax.plot(minutes, [p["mean"] for p in mean], marker="o", color=colour,
                label=f"{side} (mean of {len(by_seed)} seeds, 95 % band)")  # fmt: skip
        ax.fill_between(minutes, [p["lo"] for p in mean], [p["hi"] for p in mean],
                        color=colour, alpha=0.2)  # fmt: skip
    ax.set_xlabel("wall-clock minutes of training")
    ax.set_ylabel("held-out eval reward")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def flat_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with each side's figures as top-level ``<side>_<figure>`` keys (what
    ``bench/report.py --append`` records); nested figures (CPU shares, per-seed) left out."""
    flat = {k: v for k, v in summary.items() if not isinstance(v, dict)}
    for side in SIDES:
        for key, value in summary.get(side, {}).items():
            if not isinstance(value, dict):
                flat[f"{side}_{key}"] = value
    return flat
