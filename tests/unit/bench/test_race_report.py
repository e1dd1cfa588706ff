"""The race's report (bench/race_report.py): every seed's checkpoints through one harness,
curves with intervals per point per seed, the summary over seeds, the figure."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import race_eval
import race_report
from race_setup import RaceSettings

SETTINGS = RaceSettings(minutes=2.0, eval_marks=2, heldout_tasks=2, eval_samples_per_task=2)


def _side(side: str, seed: int) -> dict[str, Any]:
    """What one side's run returns (the fields the report reads)."""
    common = {"samples": 64, "learner_tokens": 1000.0, "learner_train_s": 10.0, "steps": 2,
              "cpu_profile": {"share": {"generation": 0.5, "training": 0.25, "tools": 0.05,
                                        "other": 0.1, "idle": 0.1}, "cores": 2,
                              "wall_s": 120.0}}  # fmt: skip
    if side == "sandpiper":
        return {**common, "versions": [
            {"version": 1, "t_s": 50.0, "checkpoint": f"/s{seed}/v1"},
            {"version": 2, "t_s": 100.0, "checkpoint": f"/s{seed}/v2"}]}  # fmt: skip
    return {**common, "generation_path": "transformers", "steps_log": [
        {"step": 1, "checkpoint": f"/t{seed}/1", "checkpoint_t_s": 70.0}, {"step": 2}]}  # fmt: skip


class _Harness:
    """Scores a checkpoint from its path: the start 0.25, Sandpiper's 1.0 from v2, TRL's 0.5;
    once per path, as the real harness."""

    evaluated: ClassVar[list[str]] = []
    cache: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def evaluate(self, ckpt: Any) -> dict[str, Any]:
        if ckpt.label in self.evaluated:
            return self.cache[ckpt.label]
        self.evaluated.append(ckpt.label)
        rewards = {"start": [0.0, 0.0, 0.0, 1.0]}.get(ckpt.label)
        if rewards is None:
            rewards = [1.0] * 4 if ckpt.path.endswith("v2") else [0.0, 1.0, 0.0, 1.0]
        result = {"checkpoint": ckpt.path, "reward": sum(rewards) / 4, "rewards": rewards}
        self.cache[ckpt.label] = result
        return result


@pytest.fixture
def raced(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(race_eval, "Harness", _Harness)
    monkeypatch.setattr(race_report, "model_hash", lambda path: "abcd")
    _Harness.evaluated, _Harness.cache = [], {}
    seeds = {str(k): {"sides": {s: _side(s, k) for s in race_report.SIDES}} for k in (0, 1)}
    marks = [60.0, 120.0]
    curves = race_report.evaluate(SETTINGS, seeds, None, tmp_path, tmp_path, tmp_path, marks)
    result = race_report.report(SETTINGS, seeds, curves, tmp_path, tmp_path,
                                ["learner.max_lag=3"])  # fmt: skip
    return seeds, curves, result


def test_every_seed_gets_its_curves_with_intervals(raced) -> None:
    _, curves, _ = raced
    assert set(curves) == {"trl", "sandpiper"} and set(curves["trl"]) == {"0", "1"}
    sp = curves["sandpiper"]["1"]
    assert [p["t_s"] for p in sp] == [0.0, 60.0, 120.0]
    assert [p["checkpoint"] for p in sp][1:] == ["/s1/v1", "/s1/v2"]
    for point in sp:
        assert {"mean", "lo", "hi", "n"} <= set(point) and point["n"] == 4
        assert point["lo"] <= point["mean"] <= point["hi"] and point["interval"] == "wilson"
    assert sp[-1]["mean"] == sp[-1]["reward"] == 1.0
    # the start is one point shared by every seed and side (TRL's 60 s mark reads it too);
    # each seed's checkpoints go under their own labels
    assert _Harness.evaluated.count("start") == 1 and curves["trl"]["0"][1]["mean"] == 0.25
    assert "s0-sandpiper-v1" in _Harness.evaluated and "s1-trl-step1" in _Harness.evaluated


def test_the_summary_gives_the_ratio_per_seed_and_its_median(raced) -> None:
    _, _, result = raced
    summary = result["summary"]
    assert summary["seeds"] == [0, 1] and summary["sandpiper_overrides"] == ["learner.max_lag=3"]
    by_seed = summary["by_seed"]
    # TRL's best (0.5) at 120 s (its checkpoint of 70 s); Sandpiper had it at 60 s: 2
    assert [by_seed[s]["time_to_match_ratio"] for s in ("0", "1")] == [2.0, 2.0]
    assert summary["time_to_match_ratio"] == 2.0
    assert summary["time_to_match_ratio_range"] == [2.0, 2.0]
    assert summary["sandpiper"]["final_eval_reward"] == 1.0
    assert summary["trl"]["cpu_share"]["generation"] == 0.5
    assert summary["sandpiper"]["samples_per_hour"] == pytest.approx(64 / 120 * 3600)
    flat = race_report.flat_summary(summary)
    assert flat["sandpiper_final_eval_reward"] == 1.0 and "by_seed" not in flat
    assert "sandpiper_cpu_share" not in flat


def test_the_figure_draws_the_mean_with_its_band(raced) -> None:
    _, _, result = raced
    assert Path(result["figure"]).is_file() and Path(result["figure"]).stat().st_size > 0
    mean = result["mean_curves"]["sandpiper"]
    assert [p["n"] for p in mean] == [8, 8, 8]  # both seeds' episodes pooled
    assert mean[-1]["mean"] == 1.0 and mean[-1]["lo"] < 1.0
