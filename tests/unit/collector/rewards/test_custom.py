"""Your own reward function (collector/rewards/custom.py): TRL's and verl's signatures, called
as those libraries call them; failures are invalid episodes with the error's last line."""

from __future__ import annotations

import asyncio
import json

import pytest

from sandpiper.collector.rewards import worker as scoring
from sandpiper.collector.rewards.compute import compute_reward
from sandpiper.collector.rewards.custom import RewardFunctionError, is_verl, load_function
from sandpiper.collector.rewards.reference import PythonReference, parse_reference
from sandpiper.collector.tasks.loading import load_tasks, task_from_row
from sandpiper.errors import TaskError

F = "python:tests.fixtures.reward_functions:"


def _ref(row: dict) -> PythonReference:
    task = task_from_row(row, source="t.jsonl", where="t.jsonl:1")
    assert isinstance(task.reference, PythonReference)
    return task.reference


def test_the_reward_names_a_function_and_round_trips():
    ref = _ref({"prompt": "2+2?", "answer": "4", "reward": F + "trl_exact", "level": 3})
    assert ref.function == "tests.fixtures.reward_functions:trl_exact"
    assert ref.prompt == "2+2?" and ref.row == {
        "answer": "4",
        "reward": F + "trl_exact",
        "level": 3,
    }
    assert ref.as_dict()["reward"] == F + "trl_exact"
    assert parse_reference(json.loads(json.dumps(ref.as_dict()))) == ref
    with pytest.raises(TaskError, match="unknown reward kind"):
        parse_reference({"reward": "python"})
    with pytest.raises(TaskError, match="function"):
        parse_reference({"reward": "python:no function"})


def test_trl_functions_get_text_or_chat_completions_and_row_fields_as_lists():
    text = _ref({"prompt": "2+2?", "answer": "4", "reward": F + "trl_exact"})
    assert compute_reward(text, answer=" 4 ").reward == 1.0
    assert compute_reward(text, answer="5").reward == 0.0
    chat = _ref({"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4",
                 "reward": F + "trl_exact"})  # fmt: skip
    assert compute_reward(chat, answer="4").reward == 1.0
    seen = _ref({"prompt": "p", "answer": "4", "extra": {"a": 1}, "reward": F + "trl_seen"})
    assert compute_reward(seen, answer="x").reward == 1.0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("trl_none", "returned None: no reward"),
        ("trl_nan", "not a finite number"),
        ("trl_raises", "raised ValueError: the last line says why"),
        ("trl_two", "list of one reward"),
        ("verl_no_score", "without 'score'"),
        ("missing_function", "has no function missing_function"),
    ],
)
def test_a_failing_function_is_a_task_error_never_a_0(name, message):
    ref = _ref({"prompt": "p", "answer": "4", "reward": F + name,
                "data_source": "d", "reward_model": {"ground_truth": "4"}})  # fmt: skip
    with pytest.raises(RewardFunctionError, match=message):
        compute_reward(ref, answer="4")


def test_verl_rows_and_compute_score_float_or_dict():
    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "2+2?"}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": "4"},
           "extra_info": {"split": "train", "index": 0}}  # fmt: skip
    plain = task_from_row(row, source="v", where="v:1")  # no function: math on ground_truth
    assert plain.reference.reward == "math" and plain.reference.answer == "4"
    ref = _ref({**row, "reward": F + "compute_score"})
    assert is_verl(load_function(ref.function))
    assert compute_reward(ref, answer="so it is 4").reward == 1.0
    assert compute_reward(ref, answer="5").reward == 0.0
    as_dict = _ref({**row, "extra_info": {"as_dict": True}, "reward": F + "compute_score"})
    outcome = compute_reward(as_dict, answer="4")
    assert outcome.reward == 1.0
    assert outcome.breakdown["reward_extra_info"] == {"source": "openai/gsm8k"}


def test_the_runs_reward_function_replaces_every_tasks_reward(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "2+2?", "answer": "4"}) + "\n")
    folder = tmp_path / "folder"
    (folder / "f1").mkdir(parents=True)
    (folder / "f1" / "instruction.md").write_text("say 4")
    (folder / "f1" / "task.toml").write_text('answer = "4"\nlevel = 2\n')
    for source in (rows, folder):
        [task] = load_tasks(source, reward_function=F + "trl_exact")
        assert isinstance(task.reference, PythonReference)
        assert compute_reward(task.reference, answer="4").reward == 1.0
    [again] = load_tasks(rows)  # the override does not outlive its call
    assert again.reference.reward == "math"
    (folder / "f1" / "task.toml").write_text(f'reward = "{F}trl_exact"\nanswer = "4"\n')
    [own] = load_tasks(folder)
    assert own.reference.row["answer"] == "4" and own.reference.prompt == "say 4"


def test_through_the_real_worker_an_exception_is_an_invalid_episode():
    worker = scoring.ScoringWorker()
    try:
        ref = _ref({"prompt": "p", "answer": "4", "reward": F + "verl_partial",
                    "data_source": "d", "reward_model": {"ground_truth": "4"}})  # fmt: skip
        got = worker.score({"reference": ref.as_dict(), "answer": "it is 4"})
        assert got.reward == 0.25 and got.breakdown["kind"] == "python"
        bad = _ref({"prompt": "p", "answer": "4", "reward": F + "trl_raises"})
        with pytest.raises(TaskError, match="the last line says why"):
            worker.score({"reference": bad.as_dict(), "answer": "4"})
        assert worker._proc is not None and worker._proc.poll() is None  # it stays up
    finally:
        worker.close()


def test_score_answer_sends_the_function_to_the_worker(monkeypatch):
    worker = scoring.ScoringWorker()
    monkeypatch.setattr(scoring, "_WORKER", worker)
    try:
        ref = _ref({"prompt": "p", "answer": "4", "reward": F + "trl_exact"})
        outcome = asyncio.run(scoring.score_answer(ref, answer="4"))
        assert outcome.reward == 1.0 and worker._proc is not None
    finally:
        worker.close()


def test_an_imported_row_keeps_the_fields_its_function_reads(tmp_path):
    from sandpiper.collector.tasks.importer import import_tasks

    row = {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "2+2?"}],
           "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"index": 0},
           "reward": F + "compute_score"}  # fmt: skip
    source = tmp_path / "verl.jsonl"
    source.write_text(json.dumps(row) + "\n")
    [task] = import_tasks(source, tmp_path / "out")
    [again] = load_tasks(tmp_path / "out")
    assert again.reference == task.reference
    assert again.reference.row["reward_model"]["ground_truth"] == "4"
    assert compute_reward(again.reference, answer="it is 4").reward == 1.0
