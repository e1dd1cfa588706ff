"""reasoning-gym by name (collector/tasks/formats/reasoning_gym.py) scored by the dataset's own
``score_answer`` (collector/rewards/reasoning_gym_scores.py) in the guarded reward worker."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import reasoning_gym

from sandpiper.collector.rewards import worker as scoring
from sandpiper.collector.rewards.reference import ReasoningGymReference
from sandpiper.collector.tasks.formats.reasoning_gym import ReasoningGymSpec
from sandpiper.collector.tasks.importer import import_tasks
from sandpiper.errors import TaskError
from sandpiper.store.records import Split


def _spec(names="countdown", size=4, seed=3, validation_size=3, config=()):
    return ReasoningGymSpec.parse(f"reasoning-gym:{names}", size=size, seed=seed,
                                  validation_size=validation_size, config=config)  # fmt: skip


def test_import_writes_rows_that_regenerate_the_librarys_items(tmp_path):
    tasks = import_tasks(_spec("countdown,spiral_matrix", config=["spiral_matrix.max_n=4"]),
                         tmp_path / "out")  # fmt: skip
    assert len(tasks) == 14
    for task in tasks:
        ref = task.reference
        assert isinstance(ref, ReasoningGymReference)
        item = reasoning_gym.create_dataset(ref.dataset, **ref.config)[ref.index]
        assert item["question"] in task.instruction and ref.answer == str(item["answer"])
        assert ref.answer_file == "/workspace/answer.txt"
    spiral = next(t for t in tasks if t.reference.dataset == "spiral_matrix")
    assert spiral.reference.config["max_n"] == 4
    countdown = next(t for t in tasks if t.reference.dataset == "countdown")
    assert "max_n" not in countdown.reference.config


def test_held_out_items_share_no_item_with_training(tmp_path):
    # seeds 0..49 train; a held-out set seeded 1 would repeat 49 of them: ours starts at 50
    tasks = import_tasks(_spec("basic_arithmetic", size=50, seed=0, validation_size=50),
                         tmp_path / "out")  # fmt: skip
    train = {t.instruction for t in tasks if t.split is Split.TRAIN}
    held_out = {t.instruction for t in tasks if t.split is Split.VALIDATION}
    assert len(train) == 50 and held_out and not train & held_out
    seeds = {t.split: set() for t in tasks}
    for t in tasks:
        seeds[t.split].add(range(t.reference.config["seed"], t.reference.config["seed"] + t.reference.config["size"]))  # fmt: skip
    [train_range], [val_range] = seeds[Split.TRAIN], seeds[Split.VALIDATION]
    assert not set(train_range) & set(val_range)
    # what the naive choice would have done: the next seed repeats items
    ds0 = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=50)
    ds1 = reasoning_gym.create_dataset("basic_arithmetic", seed=1, size=50)
    assert ds0[1]["question"] == ds1[0]["question"]


def test_unknown_names_and_refused_configs_are_task_errors(tmp_path):
    with pytest.raises(TaskError, match=r"no dataset .nope..*countdown"):
        import_tasks(_spec("nope"), tmp_path / "a")
    with pytest.raises(TaskError, match="refused config"):
        import_tasks(_spec(config=["no_such_key=1"]), tmp_path / "b")
    with pytest.raises(TaskError, match="KEY=VALUE"):
        _spec(config=["oops"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.fixture(scope="module")
def worker():
    w = scoring.ScoringWorker()
    yield w
    w.close()


def _score(worker, ref: dict, answer):
    worker.score({"warm": ref}, scoring.STARTUP_TIMEOUT_S)
    return worker.score({"reference": ref, "answer": answer}).reward


@pytest.mark.parametrize("name", ["countdown", "spiral_matrix", "basic_arithmetic", "word_ladder"])
def test_the_reward_is_the_librarys_score_byte_for_byte(worker, name):
    ds = reasoning_gym.create_dataset(name, seed=11, size=2)
    item = ds[1]
    ref = {
        "reward": "reasoning_gym",
        "dataset": name,
        "config": {"seed": 11, "size": 2},
        "index": 1,
    }
    gold = str(item["answer"])
    for answer in (gold, f"The answer is {gold}.", gold.lower() + " ", "0", "", None):
        assert _score(worker, ref, answer) == ds.score_answer(answer, item), answer


def test_an_answer_that_is_code_cannot_open_files_or_start_processes(worker, tmp_path):
    # spiral_matrix's score_answer runs eval() on any answer that is not exactly right
    ref = {"reward": "reasoning_gym", "dataset": "spiral_matrix", "config": {"seed": 1, "size": 1}, "index": 0}  # fmt: skip
    marker = tmp_path / "pwned"
    attacks = [
        f"exec(\"open({str(marker)!r}, 'w').write('x')\")",
        f"__import__('os').system('touch {marker}')",
        f"exec(\"import subprocess; subprocess.run(['touch', {str(marker)!r}])\")",
        "[open('/etc/hostname').read()]",
    ]
    for answer in attacks:
        assert _score(worker, ref, answer) == 0.0
    assert not marker.exists()
    ds = reasoning_gym.create_dataset("spiral_matrix", seed=1, size=1)
    assert _score(worker, ref, ds[0]["answer"]) == 1.0  # the guard is off again


def test_a_scorer_error_is_an_invalid_episode_with_its_reason(worker):
    ref = {"reward": "reasoning_gym", "dataset": "countdown", "config": {"seed": 1, "size": 1,
           "min_numbers": "three"}, "index": 0}  # fmt: skip
    with pytest.raises(TaskError, match="cannot build item 0"):
        worker.score({"warm": ref}, scoring.STARTUP_TIMEOUT_S)
    with pytest.raises(TaskError, match="score_answer raised"):  # the scorer's own error
        worker.score({"reference": {**ref, "config": {"seed": 1, "size": 1}}, "answer": 42})


def test_the_worker_address_space_is_capped(worker):
    worker.score({"warm": {"reward": "exact"}}, scoring.STARTUP_TIMEOUT_S)
    assert worker._proc is not None
    limits = Path(f"/proc/{worker._proc.pid}/limits").read_text()
    line = next(x for x in limits.splitlines() if x.startswith("Max address space"))
    assert str(scoring.SCORING_MEMORY_MB * 1024 * 1024) in line


def test_tasks_list_shows_family_and_config(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "rg"
    cli = [sys.executable, "-m", "sandpiper.cli", "tasks"]
    env = {**os.environ}
    done = subprocess.run([*cli, "import", "reasoning-gym:countdown", "--size", "2", "--seed", "7",
                           "--config", "min_numbers=3", "--out", str(out)],
                          capture_output=True, text=True, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    listed = subprocess.run([*cli, "list", str(out)], capture_output=True, text=True, env=env)
    lines = listed.stdout.splitlines()
    assert lines[0].split("\t")[3:] == ["reasoning_gym:countdown", "min_numbers=3 seed=7 size=2"]
    rows = [json.loads(x) for x in (out / "tasks.jsonl").read_text().splitlines()]
    assert rows[0]["config"] == {"min_numbers": 3, "seed": 7, "size": 2}


def test_fractional_rewards_give_graded_advantages():
    from sandpiper.trainer.advantages import group_advantages

    rewards_G = [1.0, 0.05, 0.01, 0.1]  # countdown's and spiral_matrix's partial credit
    advantages_G = group_advantages(rewards_G, [True] * 4)
    assert advantages_G is not None
    assert list(advantages_G.argsort()) == [2, 1, 3, 0]  # ordered as the scores, not binarised


_ATTACKS = [
    "__import__('os').system('touch {marker}')",
    "[open('{marker}', 'w').write('x')]",
    "[open('/etc/shadow').read()]",
    "__import__('sys').modules['reasoning_gym'].games.countdown.np.__setattr__('isclose', lambda *a, **k: True)",
    "[__import__('subprocess').Popen(['touch', '{marker}'])]",
    "[x for x in iter(int, 1)]",
    "[0] * 10**12",
    "9**9**9**9",
    "1+1 if exec(\"open('{marker}','w')\") else 1",
    "factorial(__import__('os').system('touch {marker}'))!",
]


@pytest.mark.parametrize("name", ["countdown", "spiral_matrix", "puzzle24", "binary_matrix",
                                  "n_queens", "string_insertion", "polynomial_multiplication",
                                  "simple_integration", "intermediate_integration"])  # fmt: skip
def test_attack_answers_are_refused_before_the_scorer_evaluates_them(name, tmp_path):
    from sandpiper.collector.rewards import answer_gate, reasoning_gym_scores

    ref = ReasoningGymReference(dataset=name, config={"seed": 1, "size": 2}, index=0,
                                answer="", answer_file="/workspace/answer.txt")  # fmt: skip
    ds = reasoning_gym_scores.dataset(ref.dataset, ref.config)
    item = ds[0]
    wrong = ds.score_answer(None, item)
    marker = tmp_path / "pwned"
    for attack in _ATTACKS:
        text = attack.format(marker=marker)
        if not text.endswith("!"):  # Python cannot parse that one, so eval cannot run it
            assert not answer_gate.admitted(name, text, item)
        assert reasoning_gym_scores.score(ref, text) <= max(
            wrong, 0.05 if name == "countdown" else wrong
        )
    assert not marker.exists()
    gold = str(item["answer"])
    assert answer_gate.admitted(name, gold, item)
    assert reasoning_gym_scores.score(ref, gold) == ds.score_answer(gold, item)


def test_list_answers_still_earn_the_librarys_partial_credit():
    from sandpiper.collector.rewards import reasoning_gym_scores

    ref = ReasoningGymReference(dataset="spiral_matrix", config={"seed": 1, "size": 2}, index=0,
                                answer="", answer_file="/workspace/answer.txt")  # fmt: skip
    item = reasoning_gym_scores.dataset(ref.dataset, ref.config)[0]
    as_list = "[" + ", ".join(item["answer"].split()) + "]"
    assert reasoning_gym_scores.score(ref, as_list) == 0.1


def test_a_family_that_evaluates_strings_without_a_gate_is_refused():
    from sandpiper.collector.rewards import answer_gate

    class Fake:
        pass

    answer_gate.check_family("spiral_matrix", Fake)  # gated
    import reasoning_gym.composite as composite

    with pytest.raises(answer_gate.UnsafeFamily):
        answer_gate.check_family("composite", composite.CompositeDataset)
