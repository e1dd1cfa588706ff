"""The scripted teacher's warm start shared by the learns bench and the race
(bench/warm_start.py): the products teacher, and what the warm start asks of the collector
and the SFT learner (both faked here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import race_setup
import race_suites as suites
import warm_start

from sandpiper.errors import SandpiperError


def test_products_teacher_computes_the_question() -> None:
    rg = pytest.importorskip("reasoning_gym")
    item = rg.create_dataset("products", size=3, seed=0)[1]
    command = warm_start.products_command(
        item["question"] + "\n\nWhen you are done, call `submit`."
    )
    expression = command.split("print(", 1)[1].split(")", 1)[0]
    assert str(eval(expression)) == item["answer"]  # the regex admits digits, spaces and * only
    assert command.endswith("> answer.txt")
    with pytest.raises(SandpiperError):
        warm_start.products_command("What is the sum of the numbers in numbers.txt?")


def test_one_teacher_episode_per_task_then_sft(tmp_path: Path, monkeypatch) -> None:
    """Every training task gets one episode (group of 1), the SFT learner's settings are
    the ones given, and the family reaches the teacher; a half-made run folder is emptied."""
    from sandpiper.demo import run as demo

    settings = race_setup.RaceSettings(train_tasks=5, heldout_tasks=2)
    train, _ = suites.prepare_suite(settings, tmp_path / "tasks")
    model = tmp_path / "model"
    cfg = race_setup.sandpiper_config(settings, start=model, tasks=train, runs_dir=tmp_path,
                                      name="warmstart")  # fmt: skip
    stale = cfg.run_dir / "stale"
    stale.mkdir(parents=True)
    seen: dict = {}
    monkeypatch.setattr(demo, "collect_demonstrations",
                        lambda c, **kw: seen.update(collect=kw, stale=stale.exists()))  # fmt: skip
    monkeypatch.setattr(demo, "run_sft", lambda c, log: seen.update(sft=c, log=log) or "ckpt")
    out = warm_start.sft_warm_start(
        cfg, sft_learner={"lr": 3e-5, "epochs": 3}, log_path=tmp_path / "w.log",
        **{"instruction": "Solve", "compute_command": warm_start.products_command},
    )  # fmt: skip
    assert out == "ckpt" and seen["log"] == tmp_path / "w.log" and not seen["stale"]
    c = seen["sft"]
    assert (c.collector.group_size, c.collector.max_groups) == (1, 5)
    assert c.learner.algo == "sft" and (c.learner.lr, c.learner.epochs) == (3e-5, 3)
    assert seen["collect"]["instruction"] == "Solve"
    assert seen["collect"]["compute_command"] is warm_start.products_command
    seen.clear()
    warm_start.sft_warm_start(cfg, sft_learner={}, log_path=tmp_path / "w.log")
    assert seen["collect"].keys() == {"compute_fraction"}  # the demo's own sum
