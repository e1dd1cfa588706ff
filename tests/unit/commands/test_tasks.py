"""``sandpiper tasks import|list`` and ``sandpiper collect --help`` through the real CLI app."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from sandpiper.cli import app
from tests.conftest import REPO

runner = CliRunner()


def test_tasks_import_llm_in_sandbox_and_list(tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "tasks", "import", str(REPO / "tasks/llm_in_sandbox_sample.jsonl"), "--out", str(out),
            "--format", "llm_in_sandbox", "--validation-fraction", "0.5", "--split-seed", "1",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "imported 2 tasks" in result.output
    index = [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()]
    assert {row["data_dir"] for row in index} == {"apollo-year", "sum-numbers"}
    listed = runner.invoke(app, ["tasks", "list", str(out)])
    assert listed.exit_code == 0
    lines = sorted(listed.output.strip().splitlines())
    splits = {row["data_dir"]: row["split"] for row in index}
    assert lines == sorted(
        f"{t}\t{splits[t]}\tllm_in_sandbox\t{r}"
        for t, r in [("apollo-year", "exact"), ("sum-numbers", "math")]
    )


def test_tasks_import_reports_bad_sources_without_traceback(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q"}\n')
    result = runner.invoke(app, ["tasks", "import", str(bad), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert "no reference answer" in result.output and "Traceback" not in result.output


def test_shipped_example_tasks_load():
    from sandpiper.collector.tasks.loading import load_tasks

    demo = load_tasks(REPO / "tasks/demo.jsonl")
    assert len(demo) >= 5 and any(t.split.value == "validation" for t in demo)
    folders = load_tasks(REPO / "tasks/folders")
    assert {t.task_id for t in folders} == {"fix-add", "write-hello"}
    assert all(t.tests_dir and (t.tests_dir / "run.sh").is_file() for t in folders)


def test_collect_help_mentions_eval():
    result = runner.invoke(app, ["collect", "--help"])
    assert result.exit_code == 0 and "--eval" in result.output and "--endpoint" in result.output


def test_shipped_peer_samples_import_unchanged(tmp_path):
    """Each peer sample in tasks/peers/ imports through the CLI with its own format."""
    expected = {
        "open_instruct": {"fix-add": ("open_instruct", "tests")},
        "llm_in_sandbox_rl.jsonl": {
            "lc-apollo": ("llm_in_sandbox", "llm_in_sandbox"),
            "math-sum": ("llm_in_sandbox", "llm_in_sandbox"),
            "bio-mc": ("llm_in_sandbox", "llm_in_sandbox"),
        },
        "trl_daytona.jsonl": {
            "sorting": ("trl_daytona", "tests"),
            "max-subarray": ("trl_daytona", "tests"),
        },
        "chat_prompts.jsonl": {"chat-add": ("jsonl_math", "math")},
        "open_instruct/swerl_rows.jsonl": {"fix-add": ("open_instruct", "tests")},
        "aviato_trl_grpo.jsonl": {
            "t-231358ee446c": ("aviato", "tests"),
            "t-c92a3c729377": ("aviato", "tests"),
        },
    }
    for name, tasks in expected.items():
        out = tmp_path / name.replace(".", "_").replace("/", "_")
        result = runner.invoke(
            app, ["tasks", "import", str(REPO / "tasks/peers" / name), "-o", str(out)]
        )
        assert result.exit_code == 0, result.output
        listed = runner.invoke(app, ["tasks", "list", str(out)])
        rows = {
            line.split("\t")[0]: tuple(line.split("\t")[2:]) for line in listed.output.splitlines()
        }
        assert rows == tasks, name


def test_tasks_import_open_instruct_rows_with_task_data_dir(tmp_path):
    from tests.unit.collector.tasks.test_formats import open_instruct_rows

    src = open_instruct_rows(tmp_path)
    out = tmp_path / "out"
    data = tmp_path / "task-data.tar.gz.extracted"
    args = ["tasks", "import", str(src), "--out", str(out), "--task-data-dir", str(data)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    index = [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()]
    assert [(row["data_dir"], row["image"]) for row in index] == [
        ("tmax-001", "py:3.12"), ("tmax-002", "localhost/per-row:2"),
    ]  # fmt: skip
    listed = runner.invoke(app, ["tasks", "list", str(out)])
    assert listed.output.splitlines()[0] == "tmax-001\ttrain\topen_instruct\ttests"
