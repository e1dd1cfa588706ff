"""The race's start checkpoint (bench/race_start.py): SmolLM2's warm start, made once.

The teacher's episodes and the SFT run are faked (``sft_warm_start`` returns its base model
as the "checkpoint"); what is real: the start folder and its record, the tool template the
base gets, the race's config the warm start is made with, and the check that the warm
start's prompt is the prompt both sides of the race render."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import race_setup as setup
import race_start
import race_suites as suites

PRODUCTS = "reasoning-gym:products"


@pytest.fixture
def smollm2(tmp_path: Path, learner_tiny_model: Path, monkeypatch) -> Path:
    """A stand-in for runs/smollm2-135m: the tiny model with a chat template without tools."""
    model = tmp_path / "smollm2-135m"
    shutil.copytree(learner_tiny_model, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    monkeypatch.setitem(setup.MODELS, "smollm2", model)
    return model


@pytest.fixture
def faked(monkeypatch) -> list[dict]:
    """Calls of the faked warm start: its config and keyword arguments."""
    calls: list[dict] = []

    def fake_sft(cfg, **kwargs):
        calls.append({"cfg": cfg, **kwargs})
        out = Path(cfg.run_dir) / "checkpoints" / "v1"
        shutil.copytree(cfg.learner.model, out)
        return str(out)

    monkeypatch.setattr(race_start, "sft_warm_start", fake_sft)
    monkeypatch.setattr(race_start, "teacher_record",
                        lambda url, run: {"teacher_episodes": 6, "teacher_passes": 2})  # fmt: skip
    return calls


def _settings(suite: str = "sum") -> setup.RaceSettings:
    return setup.RaceSettings(model="smollm2", suite=suite, train_tasks=6, heldout_tasks=3)


def test_smollm2_starts_from_the_warm_start_made_once_on_the_race_prompt(
    tmp_path: Path, smollm2: Path, faked: list[dict]
) -> None:
    settings = _settings()
    train, _ = suites.prepare_suite(settings, tmp_path / "tasks")
    original = (smollm2 / "chat_template.jinja").read_text()
    start = race_start.start_checkpoint(settings, tmp_path, train)
    (call,) = faked
    cfg = call["cfg"]
    from sandpiper.demo.run import DEMO_MODELS

    # the race's own Sandpiper config on the training tasks, SmolLM2's SFT settings
    race_cfg = setup.sandpiper_config(settings, start=start, tasks=train, runs_dir=tmp_path,
                                      name="x")  # fmt: skip
    assert cfg.collector.tool_parser == race_cfg.collector.tool_parser == "hermes"
    assert cfg.collector.system_prompt == race_cfg.collector.system_prompt
    assert cfg.collector.tasks == str(train)
    assert call["sft_learner"] == DEMO_MODELS["smollm2"].sft_learner
    # the base it warm-starts is SmolLM2 with the canonical tool template, the model untouched
    base = Path(cfg.learner.model)
    assert base == tmp_path / "base"
    assert setup.CANONICAL_TOOL_LINE in (base / "chat_template.jinja").read_text()
    assert (smollm2 / "chat_template.jinja").read_text() == original
    assert (base / "model.safetensors").read_bytes() == (smollm2 / "model.safetensors").read_bytes()
    template = (start / "chat_template.jinja").read_text()
    assert setup.CANONICAL_TOOL_LINE in template
    record = json.loads((start / race_start.START_RECORD).read_text())
    assert record["made_by"] == "sft-warm-start" and record["teacher_passes"] == 2
    assert record["prompt_tokens"] > 0
    # cached: a second race (another seed) reuses it
    assert race_start.start_checkpoint(dataclasses.replace(settings, seed=1), tmp_path,
                                       train) == start  # fmt: skip
    assert len(faked) == 1


def test_products_gets_the_products_teacher(tmp_path: Path, smollm2: Path, faked, monkeypatch):
    settings = _settings(PRODUCTS)
    train, _ = suites.prepare_suite(_settings(), tmp_path / "tasks")  # any tasks: faked SFT
    race_start.start_checkpoint(settings, tmp_path, train)
    (call,) = faked
    from warm_start import TEACHERS, products_command

    assert call["instruction"] == TEACHERS[PRODUCTS].instruction
    assert call["compute_command"] is products_command


def test_an_older_raw_smollm2_start_is_made_again(tmp_path: Path, smollm2: Path, faked) -> None:
    settings = _settings()
    train, _ = suites.prepare_suite(settings, tmp_path / "tasks")
    shutil.copytree(smollm2, tmp_path / "start")  # what the harness before this one left
    race_start.start_checkpoint(settings, tmp_path, train)
    assert len(faked) == 1
    assert (tmp_path / "start" / race_start.START_RECORD).is_file()


def test_a_warm_start_on_another_prompt_is_refused(tmp_path: Path, smollm2: Path, faked) -> None:
    settings = _settings()
    train, _ = suites.prepare_suite(settings, tmp_path / "tasks")
    base = race_start.tool_template_model(smollm2, tmp_path / "base")
    warm = setup.sandpiper_config(settings, start=base, tasks=train, runs_dir=tmp_path,
                                  name="warmstart")  # fmt: skip
    race_cfg = setup.sandpiper_config(settings, start=base, tasks=train, runs_dir=tmp_path,
                                      name="race")  # fmt: skip
    assert race_start.check_same_prompt(warm, race_cfg, train) > 0
    warm.collector.system_prompt = "Another system prompt."
    with pytest.raises(setup.UnfairRace, match="warm start's prompt differs"):
        race_start.check_same_prompt(warm, race_cfg, train)
    race_cfg.learner.model = str(smollm2)  # its own template: no tools offered
    with pytest.raises(setup.UnfairRace, match="no tools"):
        race_start.check_same_prompt(warm, race_cfg, train)


def test_a_family_without_a_teacher(tmp_path: Path, smollm2: Path, faked) -> None:
    """SmolLM2 starts raw (with the tool template); the tiny model is refused."""
    settings = _settings("reasoning-gym:leg_counting")
    train, _ = suites.prepare_suite(_settings(), tmp_path / "tasks")
    start = race_start.start_checkpoint(settings, tmp_path, train)
    assert not faked
    assert setup.CANONICAL_TOOL_LINE in (start / "chat_template.jinja").read_text()
    assert json.loads((start / race_start.START_RECORD).read_text())["made_by"].startswith("base")
    with pytest.raises(ValueError, match="no scripted teacher"):
        race_start.teacher("reasoning-gym:leg_counting")
    assert race_start.teacher("sum") == {}
