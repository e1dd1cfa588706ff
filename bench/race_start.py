"""The race's start checkpoint (bench/race_bench.py): made once per suite, shared by both sides.

``--model tiny`` and ``--model smollm2`` start from the scripted teacher's SFT warm start
(bench/warm_start.py) on the race's own training tasks, rendered with the race's own config
and chat template; SmolLM2 first gets the Hermes tool template (its own has none). Every
start gets :data:`race_setup.CANONICAL_TOOL_LINE`, so that both sides' tool schemas render
to the same prompt, and :func:`check_same_prompt` refuses a warm start whose SFT data was
rendered otherwise than either side renders. ``--start CHECKPOINT`` replaces the warm start.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from race_setup import (
    CANONICAL_TOOL_LINE,
    REPO,
    RaceSettings,
    UnfairRace,
    canonical_tool_template,
    sandpiper_config,
)
from race_suites import RG_PREFIX, task_ids
from warm_start import TEACHERS, sft_warm_start, teacher_record

START_RECORD = "race_start.json"
"""How the start folder was made (written beside its weights): a SmolLM2 start without one is
the raw model an older harness left there, and is made again."""


def start_checkpoint(
    settings: RaceSettings, root: Path, train: Path, given: Path | None = None
) -> Path:
    """The checkpoint both sides start from, made once and kept in ``root/start``, with the
    chat template that renders both sides' tool schemas to the same prompt
    (:data:`race_setup.CANONICAL_TOOL_LINE`)."""
    start = root / "start"
    if given is not None and not is_made(start, settings):
        shutil.rmtree(start, ignore_errors=True)
        shutil.copytree(given, start, ignore=shutil.ignore_patterns("train_state"))
        (start / START_RECORD).write_text(json.dumps({"made_by": "--start", "from": str(given)}))
    if not is_made(start, settings):
        shutil.rmtree(start, ignore_errors=True)
        record = make_start(settings, root, train, start)
        (start / START_RECORD).write_text(json.dumps(record, indent=1))
    canonicalise(start)
    return start


def canonicalise(model_dir: Path) -> None:
    """Give ``model_dir``'s chat template :data:`race_setup.CANONICAL_TOOL_LINE`."""
    template = model_dir / "chat_template.jinja"
    text = template.read_text()
    if CANONICAL_TOOL_LINE not in text:
        template.write_text(canonical_tool_template(text))


def is_made(start: Path, settings: RaceSettings) -> bool:
    """A finished start folder (for SmolLM2, one this harness recorded making)."""
    if not (start / "config.json").is_file():
        return False
    return settings.model != "smollm2" or (start / START_RECORD).is_file()


def make_start(settings: RaceSettings, root: Path, train: Path, start: Path) -> dict[str, Any]:
    """The scripted teacher's SFT warm start (bench/warm_start.py) on the race's training
    tasks, rendered with the race's own config and chat template; returns how it was made.
    A SmolLM2 suite without a scripted teacher starts from the model with the tool template."""
    from sandpiper.demo.run import DEMO_MODELS

    base = settings.model_dir
    if settings.model == "smollm2":
        from sandpiper.demo.run import ensure_model

        ensure_model(str(settings.model_dir))
        base = tool_template_model(settings.model_dir, root / "base")
    family = teacher(settings.suite, required=settings.model != "smollm2")
    if family is None:
        print(f"no scripted teacher for {settings.suite}: SmolLM2 starts raw", flush=True)
        shutil.copytree(base, start)
        return {"made_by": "base model with the tool template", "base": str(base)}
    warm = sandpiper_config(settings, start=base, tasks=train, runs_dir=root, name="warmstart")
    sft_learner = DEMO_MODELS[settings.model].sft_learner
    print(f"warm start: the scripted teacher on {len(task_ids(train))} training tasks, then "
          f"SFT {sft_learner} (log {root / 'warmstart.log'})", flush=True)  # fmt: skip
    t0 = time.time()
    checkpoint = sft_warm_start(warm, sft_learner=sft_learner, log_path=root / "warmstart.log",
                                **family)  # fmt: skip
    shutil.copytree(checkpoint, start, ignore=shutil.ignore_patterns("train_state"))
    canonicalise(start)
    race_cfg = sandpiper_config(settings, start=start, tasks=train, runs_dir=root, name="check")
    prompt_tokens = check_same_prompt(warm, race_cfg, train)
    return {"made_by": "sft-warm-start", "base": str(base), "suite": settings.suite,
            "sft_learner": sft_learner, "wall_s": time.time() - t0,
            "prompt_tokens": prompt_tokens,
            **teacher_record(warm.store.url, warm.name)}  # fmt: skip


def tool_template_model(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with the race's tool template (SmolLM2's own has no tools, and TRL's
    environment_factory refuses it): the Hermes template the tiny model ships
    (sandpiper/models/data) with :data:`race_setup.CANONICAL_TOOL_LINE`. The weights are
    hard links where the file system allows (never written through: the template is a new
    file)."""
    if (out / "config.json").is_file():
        return out

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("chat_template.jinja"),
                    copy_function=link)  # fmt: skip
    hermes = (REPO / "sandpiper" / "models" / "data" / "chat_template.jinja").read_text()
    (out / "chat_template.jinja").write_text(canonical_tool_template(hermes))
    return out


def check_same_prompt(warm: Any, race_cfg: Any, train: Path) -> int:
    """Refuse a warm start whose SFT data was rendered otherwise than the race renders:
    the first training task's prompt token ids under the warm start's config and model
    folder, under Sandpiper's race config on the start, and as TRL builds it (the same
    messages, the tools TRL derives from race_trl.SandboxEnv's methods, the start's
    template) must be equal. Returns the prompt's length in tokens."""
    from race_trl import SandboxEnv, dataset_rows
    from transformers import AutoTokenizer

    from sandpiper.collector.episode.render import renderer_for
    from sandpiper.collector.tasks.loading import load_tasks

    task = load_tasks(train)[:1]

    def messages(cfg: Any) -> list[dict[str, Any]]:
        return dataset_rows(cfg, task, seed=0)[0]["prompt"]

    def ids(cfg: Any) -> list[int]:
        tokenizer = AutoTokenizer.from_pretrained(cfg.learner.model)
        text = renderer_for(tokenizer, cfg).render(messages(cfg), add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))

    tokenizer = AutoTokenizer.from_pretrained(race_cfg.learner.model)
    ours = ids(race_cfg)
    if "execute_bash" not in tokenizer.decode(ours):
        raise UnfairRace("the race's prompt offers no tools: the start has no tool template")
    env = SandboxEnv()  # TRL's side: its tools from the environment's methods
    trl_text = tokenizer.apply_chat_template(messages(race_cfg), tools=[env.execute_bash,
                                             env.submit], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    sides = {"warm start": ids(warm), "trl": tokenizer.encode(trl_text, add_special_tokens=False)}
    for name, other in sides.items():
        if list(other) != ours:
            raise UnfairRace(f"the {name}'s prompt differs from the race's ({len(other)} vs "
                             f"{len(ours)} tokens): both sides and the warm start must see one prompt")  # fmt: skip
    return len(ours)


def teacher(suite: str, *, required: bool = True) -> dict[str, Any] | None:
    """The warm start's teacher for the suite (``instruction``, ``compute_command``; none
    for the demo's sum: the teacher's default). A family without one is refused, or None
    when not ``required``."""
    if suite == "peer" or suite in TEACHERS:
        family = TEACHERS[suite]
        return {"instruction": family.instruction, "compute_command": family.compute_command}
    if suite.startswith(RG_PREFIX):
        if not required:
            return None
        raise ValueError(f"no scripted teacher for {suite}: give --start CHECKPOINT (or "
                         f"--model smollm2), or use {RG_PREFIX}products")  # fmt: skip
    return {}
