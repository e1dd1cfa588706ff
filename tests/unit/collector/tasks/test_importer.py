"""LLM-in-Sandbox imports: a row of a domain that cannot be scored is skipped and reported,
not a refusal of the whole file (``--strict`` refuses); and a row whose peer fields were
renamed to ours (``prompt``/``answer``) keeps its ``input_files``."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sandpiper.cli import app
from sandpiper.collector.tasks.importer import SKIPPED_FILE, import_tasks, skipped_rows
from sandpiper.collector.tasks.loading import load_tasks
from sandpiper.errors import TaskError
from tests.unit.collector.tasks.test_formats import LIS_ROWS

FOLLOW = {
    "id": "if-1", "domain": "instruct_follow", "ground_truth": "{}",
    "problem_statement": "Describe the Franks in 40 to 60 words.",
}  # fmt: skip
ODD = {"id": "x-1", "domain": "poetry", "ground_truth": "a", "problem_statement": "Rhyme."}


def _rows(tmp_path, *rows) -> str:
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(src)


def test_unsupported_domains_are_skipped_and_kept_whole(tmp_path):
    src = _rows(tmp_path, LIS_ROWS[0], FOLLOW, LIS_ROWS[1], ODD)
    tasks = import_tasks(src, tmp_path / "out")
    assert sorted(t.task_id for t in tasks) == ["bio-7", "lc-001"]
    skipped = skipped_rows(tmp_path / "out")
    assert [s["where"] for s in skipped] == [f"{src}:2", f"{src}:4"]
    assert [s["row"] for s in skipped] == [FOLLOW, ODD]  # nothing lost
    assert "instruct_follow" in skipped[0]["reason"] and "IFBench" in skipped[0]["reason"]
    assert "unknown domain 'poetry'" in skipped[1]["reason"]
    # the output folder is still a task source the collector reads (skipped.jsonl aside)
    assert sorted(t.task_id for t in load_tasks(tmp_path / "out")) == ["bio-7", "lc-001"]


def test_strict_refuses_the_file_and_writes_nothing(tmp_path):
    src = _rows(tmp_path, LIS_ROWS[0], ODD)
    with pytest.raises(TaskError, match=r":2: unknown domain 'poetry'"):
        import_tasks(src, tmp_path / "out", strict=True)
    assert not (tmp_path / "out").exists()


def test_only_unsupported_rows_is_an_error_that_says_why(tmp_path):
    with pytest.raises(TaskError, match=r"no tasks found.*1 rows skipped.*instruct_follow"):
        import_tasks(_rows(tmp_path, FOLLOW), tmp_path / "out")


def test_a_malformed_row_still_refuses_the_file(tmp_path):
    broken = {**LIS_ROWS[0], "id": "b", "domain": ""}  # not a domain we cannot score: broken
    with pytest.raises(TaskError, match="field 'domain' is missing"):
        import_tasks(_rows(tmp_path, LIS_ROWS[1], broken), tmp_path / "out")


def test_the_cli_reports_skipped_rows_and_strict_fails(tmp_path):
    runner = CliRunner()
    src = _rows(tmp_path, LIS_ROWS[0], FOLLOW)
    result = runner.invoke(app, ["tasks", "import", src, "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert "imported 1 tasks" in result.output
    assert f"skipped 1 rows (kept in {tmp_path / 'a' / SKIPPED_FILE}" in result.output
    assert "domain 'instruct_follow' is not supported" in result.output
    strict = runner.invoke(app, ["tasks", "import", src, "--out", str(tmp_path / "b"), "--strict"])
    assert strict.exit_code != 0 and "instruct_follow" in strict.output
    assert not (tmp_path / "b").exists()


RENAMED = {
    # an LLM-in-Sandbox row whose problem_statement / ground_truth were renamed to ours
    "id": "renamed-1", "prompt": "When was the budget approved?", "answer": "March",
    "reward": "exact",
    "input_files": json.dumps({"report.txt": "approved in March", "notes/b.txt": "x"}),
}  # fmt: skip


@pytest.mark.parametrize("fmt", ["auto", "llm_in_sandbox"])
def test_renamed_rows_keep_their_input_files(tmp_path, fmt):
    (task,) = import_tasks(_rows(tmp_path, RENAMED), tmp_path / "out", fmt=fmt)
    assert task.data_dir is not None
    inputs = task.data_dir / "files" / "input"
    assert (inputs / "report.txt").read_text() == "approved in March"
    assert (inputs / "notes" / "b.txt").read_text() == "x"
    assert "/workspace/input/" in task.instruction


def test_input_files_beside_context_must_not_collide(tmp_path):
    row = {**RENAMED, "context": {"report.txt": "other"}}
    with pytest.raises(TaskError, match=r"'report\.txt' is given twice"):
        import_tasks(_rows(tmp_path, row), tmp_path / "out", fmt="llm_in_sandbox")


def test_the_collector_refuses_input_files_it_would_drop(tmp_path):
    """Read directly (no import), the row's files would never reach the sandbox."""
    with pytest.raises(TaskError, match="needs files in the sandbox; convert the file first"):
        load_tasks(_rows(tmp_path, RENAMED))


def test_input_file_names_stay_inside(tmp_path):
    row = {**RENAMED, "input_files": {"../../etc/x": "y"}}
    with pytest.raises(TaskError, match="must be a relative file name"):
        import_tasks(_rows(tmp_path, row), tmp_path / "out")
