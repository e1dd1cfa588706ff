"""Task sources: JSONL, task folders, LLM-in-Sandbox conversion, import and splits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandpiper.collector.tasks.importer import convert_llm_in_sandbox, import_tasks
from sandpiper.collector.tasks.loading import load_task_folder, load_tasks
from sandpiper.collector.tasks.model import split_of
from sandpiper.errors import TaskError
from sandpiper.store.records import Split


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _folder(root: Path, name: str, *, tests: bool = True, toml: str = "") -> Path:
    folder = root / name
    (folder / "files").mkdir(parents=True)
    (folder / "files" / "main.py").write_text("print(1)\n")
    (folder / "instruction.md").write_text(f"Fix {name}.")
    if tests:
        (folder / "tests").mkdir()
        (folder / "tests" / "test.sh").write_text("exit 0\n")
    if toml:
        (folder / "task.toml").write_text(toml)
    return folder


def test_jsonl_prompt_tasks_with_aliases(tmp_path):
    path = _jsonl(
        tmp_path / "t.jsonl",
        [
            {"id": "a", "question": "1+1?", "answer": 2},
            {"problem": "2+2?", "ground_truth": "4", "reward": "exact", "split": "validation"},
        ],
    )
    a, b = load_tasks(path)
    assert (a.task_id, a.instruction, a.reference) == (
        "a",
        "1+1?",
        {"reward": "math", "answer": "2"},
    )
    assert a.format == "jsonl_math" and a.data_dir is None and a.split is Split.TRAIN
    assert b.task_id.startswith("t-") and b.reference["reward"] == "exact"
    assert b.split is Split.VALIDATION
    assert load_tasks(path)[1].task_id == b.task_id  # content ids are stable


@pytest.mark.parametrize(
    ("row", "msg"),
    [
        ({"answer": "1"}, "no prompt"),
        ({"prompt": "q"}, "no reference answer"),
        ({"id": "a/b", "prompt": "q", "answer": "1"}, "must match"),
        ({"prompt": "q", "answer": "1", "split": "test"}, "split must be"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, row, msg):
    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": "ok", "answer": "1"}, row])
    with pytest.raises(TaskError, match=msg) as info:
        load_tasks(path)
    assert "t.jsonl:2" in str(info.value)


def test_duplicate_ids_are_refused(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"id": "a", "prompt": "q", "answer": "1"}] * 2)
    with pytest.raises(TaskError, match="duplicate"):
        load_tasks(path)


def test_task_folder_layout(tmp_path):
    folder = _folder(
        tmp_path, "fix-bug", toml='image = "localhost/x:1"\nbanned_patterns = ["tests"]\n'
    )
    (folder / "setup.sh").write_text("pip install nothing\n")
    task = load_task_folder(folder)
    assert task.task_id == "fix-bug" and task.instruction == "Fix fix-bug."
    assert task.reference == {"reward": "tests", "banned_patterns": ["tests"]}
    assert task.files_dir == folder / "files" and task.tests_dir == folder / "tests"
    assert task.setup_script == folder / "setup.sh" and task.image == "localhost/x:1"
    assert task.to_record().data_uri == str(folder)


def test_folder_of_folders_and_missing_tests(tmp_path):
    _folder(tmp_path, "b")
    _folder(tmp_path, "a")
    assert [t.task_id for t in load_tasks(tmp_path)] == ["a", "b"]
    bad = _folder(tmp_path / "x", "c", tests=False, toml='reward = "tests"\n')
    with pytest.raises(TaskError, match="tests/"):
        load_task_folder(bad)


def test_hash_split_is_deterministic_and_roughly_proportional():
    ids = [f"task-{i}" for i in range(2000)]
    splits = [split_of(i, 0.1, seed=3) for i in ids]
    assert splits == [split_of(i, 0.1, seed=3) for i in ids]
    fraction = splits.count(Split.VALIDATION) / len(ids)
    assert 0.07 < fraction < 0.13
    assert splits != [split_of(i, 0.1, seed=4) for i in ids]
    assert all(split_of(i, 0.0) is Split.TRAIN for i in ids[:50])


def test_explicit_split_wins_over_hash(tmp_path):
    rows = [{"id": f"t{i}", "prompt": "q", "answer": "1", "split": "train"} for i in range(50)]
    tasks = load_tasks(_jsonl(tmp_path / "t.jsonl", rows), validation_fraction=0.9)
    assert all(t.split is Split.TRAIN for t in tasks)


def test_llm_in_sandbox_conversion(tmp_path):
    rows = [
        {"id": "q1", "prompt": "What year?", "answer": "1969", "context": "Apollo 11 in 1969."},
        {"id": "q2", "question": "Sum?", "ground_truth": "7", "documents": ["a", "b"]},
    ]
    q1, q2 = convert_llm_in_sandbox(rows, tmp_path)
    assert q1.format == "llm_in_sandbox" and "/workspace/input/" in q1.instruction
    assert q2.reference == {"reward": "math", "answer": "7", "answer_file": "/workspace/answer.txt"}
    assert (tmp_path / "q1" / "files" / "input" / "context.txt").read_text() == "Apollo 11 in 1969."
    assert q1.reference["answer"] == "1969"
    assert q1.reference["answer_file"] == "/workspace/answer.txt"
    assert sorted(p.name for p in (tmp_path / "q2" / "files" / "input").iterdir()) == [
        "document_0.txt",
        "document_1.txt",
    ]
    # the ground truth is never a file the agent can read
    assert "1969" not in "".join(
        p.read_text() for p in (tmp_path / "q1" / "files").rglob("*") if p.is_file()
    ).replace("Apollo 11 in 1969.", "")


def test_import_writes_an_index_that_reloads_with_the_same_split(tmp_path):
    src = _jsonl(
        tmp_path / "src.jsonl",
        [{"id": f"t{i}", "prompt": f"q{i}", "answer": str(i)} for i in range(40)],
    )
    out = tmp_path / "out"
    imported = import_tasks(src, out, validation_fraction=0.25, split_seed=1)
    reloaded = load_tasks(out)
    assert [(t.task_id, t.split) for t in reloaded] == [(t.task_id, t.split) for t in imported]
    assert {t.split for t in reloaded} == {Split.TRAIN, Split.VALIDATION}


def test_import_llm_in_sandbox_and_folders(tmp_path):
    src = _jsonl(tmp_path / "lis.jsonl", [{"id": "q1", "prompt": "p", "answer": "a"}])
    tasks = import_tasks(src, tmp_path / "out", fmt="llm_in_sandbox")
    assert [t.task_id for t in load_tasks(tmp_path / "out")] == [t.task_id for t in tasks]
    _folder(tmp_path / "folders", "f1")
    import_tasks(tmp_path / "folders", tmp_path / "out2")
    (loaded,) = load_tasks(tmp_path / "out2")
    assert loaded.task_id == "f1" and loaded.tests_dir == (tmp_path / "out2" / "f1" / "tests")
