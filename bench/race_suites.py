"""The race's task suites (bench/race_bench.py): the tasks both sides train on and the held-out
tasks both are evaluated on.

``sum`` is the demo's task (add up the numbers in ``numbers.txt``); ``peer`` the same family
written as LLM-in-Sandbox-RL rows, the peer's own schema, imported unchanged with
``sandpiper tasks import``; ``reasoning-gym:FAMILY`` a reasoning-gym dataset imported by name
(``sandpiper tasks import reasoning-gym:FAMILY``), scored by the family's own scorer.
Held-out tasks come from another seed and other ids; no side ever trains on them.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from race_setup import RaceSettings

REPO = Path(__file__).resolve().parent.parent

SUITES = ("sum", "peer")
RG_PREFIX = "reasoning-gym:"
"""``--suite reasoning-gym:FAMILY``: the family imported by name (as bench/learns_bench.py)."""
DEFAULT_RG_FAMILY = "products"
"""Multiplying two numbers of up to five digits: a 135 M model cannot do it in its head,
``python3 -c 'print(A * B)'`` in the sandbox can (headroom only for an agent that computes;
bench/learns_bench.py measured SmolLM2 at 0.27 before and 0.77 after 30 minutes of GRPO)."""
HELDOUT_SEED_OFFSET = 1_000_003
"""Held-out tasks are drawn with ``seed + this``: other numbers, other ids."""


def _numbers(rng: random.Random) -> list[int]:
    return [rng.randint(100_000, 999_999) for _ in range(7)]


def write_sum_tasks(out_dir: Path, prefix: str, n_tasks: int, seed: int) -> list[str]:
    """Demo task folders (:mod:`sandpiper.demo.tasks`: same instruction, files and reward)
    with ids ``<prefix>-NNNN``; returns the ids."""
    from sandpiper.demo.tasks import ANSWER_FILE, INSTRUCTION

    rng = random.Random(seed)
    ids = []
    for i in range(n_tasks):
        numbers = _numbers(rng)
        task_id = f"{prefix}-{i:04d}"
        folder = out_dir / task_id
        (folder / "files").mkdir(parents=True, exist_ok=True)
        (folder / "instruction.md").write_text(INSTRUCTION + "\n")
        (folder / "files" / "numbers.txt").write_text("\n".join(map(str, numbers)) + "\n")
        (folder / "task.toml").write_text(
            f'reward = "exact"\nanswer = {json.dumps(str(sum(numbers)))}\n'
            f'answer_file = "{ANSWER_FILE}"\nsplit = "train"\n'
        )
        ids.append(task_id)
    return ids


PEER_PROBLEM = "What is the sum of the numbers in numbers.txt? Compute it in the sandbox."
"""The ``problem_statement`` of every peer row."""

PEER_COMPUTE_COMMAND = (
    "python3 -c 'import sys; print(sum(map(int, sys.stdin)))' < documents/numbers.txt > answer.txt"
)
"""What solves a peer row in the sandbox: the imported file lands in /workspace/documents/
(the working directory is /workspace), the answer goes to /workspace/answer.txt."""


def peer_rows(prefix: str, n_tasks: int, seed: int) -> list[dict[str, Any]]:
    """LLM-in-Sandbox-RL rows (the peer's schema: ``id``, ``problem_statement``,
    ``ground_truth``, ``domain``, ``input_files`` as a JSON string) of the sum family."""
    rng = random.Random(seed)
    rows = []
    for i in range(n_tasks):
        numbers = _numbers(rng)
        rows.append(
            {
                "id": f"{prefix}-{i:04d}",
                "problem_statement": PEER_PROBLEM,
                "ground_truth": str(sum(numbers)),
                "domain": "math",
                "input_files": json.dumps({"numbers.txt": "\n".join(map(str, numbers)) + "\n"}),
            }
        )
    return rows


def import_peer_rows(rows: list[dict[str, Any]], out_dir: Path) -> None:
    """``sandpiper tasks import`` on the rows, as a user runs it (the real CLI)."""
    source = out_dir.with_suffix(".jsonl")
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "sandpiper.cli", "tasks", "import", str(source),
           "--out", str(out_dir), "--validation-fraction", "0"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"sandpiper tasks import failed: {done.stderr[-2000:]}")


def prepare_suite(settings: RaceSettings, root: Path) -> tuple[Path, Path]:
    """Write (train tasks, held-out tasks) for the suite under ``root`` (idempotent)."""
    if settings.suite.startswith(RG_PREFIX):
        return import_reasoning_gym(settings.suite.removeprefix(RG_PREFIX), settings, root)
    train, heldout = root / "train", root / "heldout"
    if (train.is_dir() and any(train.iterdir())) and (heldout.is_dir() and any(heldout.iterdir())):
        return train, heldout
    seed_h = settings.task_seed + HELDOUT_SEED_OFFSET
    if settings.suite == "sum":
        write_sum_tasks(train, "sum-train", settings.train_tasks, settings.task_seed)
        write_sum_tasks(heldout, "sum-heldout", settings.heldout_tasks, seed_h)
    else:
        root.mkdir(parents=True, exist_ok=True)
        import_peer_rows(peer_rows("peer-train", settings.train_tasks, settings.task_seed), train)
        import_peer_rows(peer_rows("peer-heldout", settings.heldout_tasks, seed_h), heldout)
    return train, heldout


def import_reasoning_gym(family: str, settings: RaceSettings, root: Path) -> tuple[Path, Path]:
    """``sandpiper tasks import reasoning-gym:FAMILY --size N --seed S --validation-size M``
    (the real CLI), split into ``root/train/tasks.jsonl`` and ``root/heldout/tasks.jsonl``
    (idempotent). The importer builds the held-out items from seeds after the training ones
    and drops any whose question is also a training question; the ids differ."""
    train, heldout = root / "train" / "tasks.jsonl", root / "heldout" / "tasks.jsonl"
    if train.is_file() and heldout.is_file():
        return train, heldout
    imported = root / "imported"
    cmd = [sys.executable, "-m", "sandpiper.cli", "tasks", "import", f"{RG_PREFIX}{family}",
           "--size", str(settings.train_tasks), "--seed", str(settings.task_seed),
           "--validation-size", str(settings.heldout_tasks), "--out", str(imported)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"sandpiper tasks import failed: {done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (imported / "tasks.jsonl").read_text().splitlines()]
    for path, split in ((train, "train"), (heldout, "validation")):
        path.parent.mkdir(parents=True, exist_ok=True)
        chosen = [row for row in rows if row["split"] == split]
        path.write_text("".join(json.dumps(row) + "\n" for row in chosen))
    return train, heldout


def task_ids(source: Path) -> list[str]:
    """The ids of the tasks at ``source``, as the collector loads them."""
    from sandpiper.collector.tasks.loading import load_tasks

    return sorted(t.task_id for t in load_tasks(source))
