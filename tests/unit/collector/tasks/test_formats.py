"""Peers' task data written exactly as each peer writes it, imported and scored unchanged.

- open-instruct ``SWERLSandboxEnv`` folders (instruction.md, environment/seeds/,
  tests/test.sh writing /logs/verifier/reward.txt, setup.sh, image.txt);
- LLM-in-Sandbox-RL dataset rows and the rllm JSON array of its converter;
- TRL + Daytona code tasks; OpenAI-style rows whose prompt is a list of chat messages.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from sandpiper.collector.episode.loop import run_episode
from sandpiper.collector.episode.policy import TokenPolicy
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.tasks.importer import import_tasks
from sandpiper.collector.tasks.loading import load_task_folder, load_tasks
from sandpiper.config import SamplingLimits
from sandpiper.errors import TaskError
from sandpiper.store.records import StopReason
from sandpiper.testing import (
    FAKE_TOOL_SCHEMAS,
    FakeToolbox,
    ScriptedPolicy,
    scripted_sandbox,
)

OPEN_INSTRUCT_TEST_SH = """#!/bin/bash
set -e
mkdir -p /logs/verifier

cat << 'TEST_EOF' > /tmp/test_final_state.py
import sys
sys.path.insert(0, "/workspace")
from calc import add
assert add(2, 3) == 5
TEST_EOF

if python3 /tmp/test_final_state.py 2>&1; then
    echo "1" > /logs/verifier/reward.txt
else
    echo "0" > /logs/verifier/reward.txt
fi
"""
"""Shaped as open-instruct's SWERL converter writes test.sh (``set -e``, ``mkdir -p
/logs/verifier``, the test written to /tmp, exit 0 either way); python3 runs the test file
where the converter runs pytest, which the sandbox image does not ship."""


def open_instruct_task(root: Path, name: str = "fix-add", *, test_sh: bool = True) -> Path:
    folder = root / name
    (folder / "environment" / "seeds" / "pkg").mkdir(parents=True)
    (folder / "environment" / "seeds" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (folder / "environment" / "seeds" / "pkg" / "util.py").write_text("X = 1\n")
    (folder / "instruction.md").write_text("\nFix add() in /workspace/calc.py.\n\n")
    if test_sh:
        (folder / "tests").mkdir()
        (folder / "tests" / "test.sh").write_text(OPEN_INSTRUCT_TEST_SH)
    (folder / "setup.sh").write_text("echo ready > /workspace/.ready\n")
    (folder / "image.txt").write_text("localhost/sandpiper-task-py:1\n")
    return folder


def test_open_instruct_folder_as_open_instruct_writes_it(tmp_path):
    task = load_task_folder(open_instruct_task(tmp_path))
    assert task.format == "open_instruct" and task.instruction == "Fix add() in /workspace/calc.py."
    assert task.files_dir == tmp_path / "fix-add" / "environment" / "seeds"
    assert task.files_dest == "/workspace" and task.image == "localhost/sandpiper-task-py:1"
    assert task.setup_script == tmp_path / "fix-add" / "setup.sh"
    assert task.tests_dest == "/tests" and task.resolved_test_command == 'bash "$TESTS_DIR/test.sh"'
    assert task.reward_file == "/logs/verifier/reward.txt"
    assert task.reference == {"reward": "tests", "result_format": "reward_file"}
    task.check()
    out = tmp_path / "out"
    (reloaded,) = import_tasks(tmp_path / "fix-add", out)
    assert reloaded.format == "open_instruct" and reloaded.data_dir == (out / "fix-add").resolve()


def test_open_instruct_missing_test_script_is_one_invalid_episode(tiny_tokenizer, tmp_path):
    task = load_task_folder(open_instruct_task(tmp_path, test_sh=False))
    sandbox = scripted_sandbox()
    policy = ScriptedPolicy(tiny_tokenizer, ["never asked"])
    episode = asyncio.run(
        run_episode(
            episode_id="e", sample_index=0, task=task,
            policy=TokenPolicy(policy, ChatRenderer(tiny_tokenizer, FAKE_TOOL_SCHEMAS)),
            sandbox=sandbox, toolbox=FakeToolbox(sandbox), limits=SamplingLimits(),
        )
    )  # fmt: skip
    assert episode.stop_reason is StopReason.TASK_ERROR and not episode.valid
    assert episode.reward is None and "tests/test.sh" in episode.error
    assert policy.prompts == []  # no model tokens spent on a broken task


# ---- LLM-in-Sandbox-RL ---------------------------------------------------------------------

LIS_ROWS = [
    {
        "id": "lc-001",
        "problem_statement": "When was the budget approved?",
        "ground_truth": "The committee approved the budget in March.",
        "domain": "long_context",
        "input_files": json.dumps({"Q3 report (final).txt": "… approved in March …"}),
        "qa_type": "free-form",
    },
    {
        "id": "bio-7",
        "problem_statement": "Which option? A) x B) y",
        "ground_truth": "B",
        "domain": "biomed",
        "input_files": None,
        "docker_image": "localhost/lis:1",
    },
]


def rllm_record(row: dict) -> dict:
    """What the peer's convert_llm_sandbox_dataset.py writes for one dataset row."""
    extra = {k: row[k] for k in ("id", "domain", "problem_statement", "ground_truth")}
    if row.get("docker_image"):  # a key LLMinSandboxEnv.from_dict reads from extra_info
        extra["docker_image"] = row["docker_image"]
    if row.get("input_files"):
        extra["input_files"] = row["input_files"]
    if row.get("qa_type"):
        extra["qa_type"] = row["qa_type"]
    return {
        "prompt": [{"content": "placeholder", "role": "user"}],
        "reward_model": {"ground_truth": row["ground_truth"], "style": "llm_in_sandbox"},
        "data_source": row["domain"],
        "extra_info": extra,
    }


@pytest.mark.parametrize("shape", ["jsonl", "rllm_json"])
def test_llm_in_sandbox_rows_and_rllm_json(tmp_path, shape):
    src = tmp_path / "data"
    if shape == "jsonl":
        src.write_text("".join(json.dumps(r) + "\n" for r in LIS_ROWS))
    else:
        src.write_text(json.dumps([rllm_record(r) for r in LIS_ROWS], indent=2))
    lc, bio = import_tasks(src, tmp_path / "out")
    assert (lc.task_id, bio.task_id) == ("lc-001", "bio-7")
    document = tmp_path / "out" / "lc-001" / "files" / "documents" / "Q3 report (final).txt"
    assert document.read_text() == "… approved in March …"
    assert lc.reference == {
        "reward": "llm_in_sandbox", "answer": "The committee approved the budget in March.",
        "domain": "long_context", "answer_file": "/workspace/answer.txt", "qa_type": "free-form",
    }  # fmt: skip
    assert "/workspace/documents/" in lc.instruction and "/workspace/answer.txt" in lc.instruction
    assert bio.reference["domain"] == "biomed" and lc.format == "llm_in_sandbox"
    assert lc.image is None and bio.image == "localhost/lis:1"  # the record's docker_image


def test_llm_in_sandbox_answer_file_is_scored_by_domain(tiny_tokenizer, tmp_path):
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in LIS_ROWS))
    _, bio = import_tasks(src, tmp_path / "out")
    sandbox = scripted_sandbox()
    sandbox.files["/workspace/answer.txt"] = b"The answer is B\n"
    submit = '<tool_call>{"name": "submit", "arguments": {}}</tool_call>'
    episode = asyncio.run(
        run_episode(
            episode_id="e", sample_index=0, task=bio,
            policy=TokenPolicy(ScriptedPolicy(tiny_tokenizer, [submit]),
                               ChatRenderer(tiny_tokenizer, FAKE_TOOL_SCHEMAS)),
            sandbox=sandbox, toolbox=FakeToolbox(sandbox), limits=SamplingLimits(),
        )
    )  # fmt: skip
    assert sandbox.copied == [(tmp_path / "out" / "bio-7" / "files", "/workspace")]
    assert episode.reward == 1.0 and episode.reward_breakdown["kind"] == "llm_in_sandbox"


def test_llm_in_sandbox_instruction_following_is_refused_clearly(tmp_path):
    """The peer's instruct_follow rows: ground_truth is IFBench's instruction ids and kwargs
    as a JSON string. No maintained package reproduces the peer's checker (docs/tasks.md):
    with ``strict`` the import stops, says why and what to do, and writes nothing (by default
    the row is skipped: tests/unit/collector/tasks/test_importer.py)."""
    truth = {"instruction_id_list": ["count:word_count_range"], "kwargs": [{"min_words": 40, "max_words": 60}]}  # fmt: skip
    row = {
        "id": "if-1", "domain": "instruct_follow", "ground_truth": json.dumps(truth),
        "problem_statement": "Describe the Franks. The response must contain between 40 and 60 words.",
    }  # fmt: skip
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps(LIS_ROWS[0]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(TaskError) as refused:
        import_tasks(src, tmp_path / "out", strict=True)
    message = str(refused.value)
    assert message.startswith(f"{src}:2: domain 'instruct_follow' is not supported")
    assert "IFBench" in message and "Remove these rows" in message
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]  # nothing half-written


def test_bad_document_file_name_says_file_name_with_a_1_based_record(tmp_path):
    records = [rllm_record(LIS_ROWS[1]), rllm_record(LIS_ROWS[0])]
    records[1]["extra_info"]["input_files"] = {"../escape.txt": "x"}
    src = tmp_path / "train_verl.json"
    src.write_text(json.dumps(records))
    with pytest.raises(TaskError, match=r"record 2: input file name '../escape.txt' must be a"):
        import_tasks(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- chat-message prompts and import errors -------------------------------------------------


def test_chat_message_prompts(tmp_path):
    row = {
        "prompt": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        "answer": "4",
    }
    src = tmp_path / "aviato.jsonl"
    src.write_text(json.dumps(row) + "\n")
    (task,) = load_tasks(src)
    assert task.instruction == "What is 2+2?" and task.system_prompt == "Answer with a number."
    (reloaded,) = import_tasks(src, tmp_path / "out")
    assert reloaded.system_prompt == "Answer with a number."
    bad = {"prompt": [{"role": "assistant", "content": "4"}], "answer": "4"}
    src.write_text(json.dumps(row) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TaskError, match=r"aviato.jsonl:2: prompt message 1 has role 'assistant'"):
        load_tasks(src)


def test_missing_field_names_the_nearest_supported_one(tmp_path):
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps({"prompt": "ok", "answer": 1}) + "\n" + json.dumps({"promt": "x"}))
    with pytest.raises(TaskError, match=r"t.jsonl:2: no prompt .*'promt': did you mean 'prompt'"):
        import_tasks(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(TaskError, match="not empty"):
        import_tasks(tmp_path / "t.jsonl", tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


# ---- open-instruct dataset rows (env_config) ------------------------------------------------

OI_SYSTEM = "You are a helpful coding assistant. You have access to a bash terminal."
OI_TEST_SH = """#!/bin/bash
set -e
mkdir -p /logs/verifier

cat << 'TEST_EOF' > /tmp/test_final_state.py
def test_done():
    assert open('/workspace/out.txt').read().strip() == 'ok'
TEST_EOF

if python3 -m pytest /tmp/test_final_state.py -x --tb=short 2>&1; then
    echo "1" > /logs/verifier/reward.txt
else
    echo "0" > /logs/verifier/reward.txt
fi
"""


def open_instruct_rows(root: Path) -> Path:
    """What open-instruct's SWERL converter writes: task data (instruction.md, tests/test.sh,
    setup.sh from the container's %post, no image.txt) and dataset rows whose env_config
    names the task and its image, in the flat and the nested shape."""
    data = root / "task-data.tar.gz.extracted"
    for task_id in ("tmax-001", "tmax-002"):
        (data / task_id / "tests").mkdir(parents=True)
        (data / task_id / "instruction.md").write_text(
            f"Write ok to /workspace/out.txt ({task_id})"
        )
        (data / task_id / "tests" / "test.sh").write_text(OI_TEST_SH)
        (data / task_id / "setup.sh").write_text("#!/bin/bash\nset -e\npip install pytest\n")
    (data / "tmax-002" / "image.txt").write_text("localhost/from-image-txt:1\n")

    def row(task_id, env_config):
        return {
            "messages": [
                {"role": "system", "content": OI_SYSTEM},
                {"role": "user", "content": f"Write ok to /workspace/out.txt please ({task_id})"},
            ],
            "ground_truth": task_id, "dataset": "passthrough", "env_config": env_config,
            "source": "tmax_skill_taxonomy",
        }  # fmt: skip

    rows = [
        row("tmax-001", {"env_name": "swerl_sandbox", "task_id": "tmax-001", "image": "py:3.12"}),
        row(
            "tmax-002",
            {
                "env_configs": [
                    {"env_name": "guess_number", "image": "", "task_id": "", "number": "3"},
                    {
                        "env_name": "swerl_sandbox",
                        "image": "localhost/per-row:2",
                        "task_id": "tmax-002",
                    },
                ],
                "max_steps": 50,
            },
        ),
    ]
    src = root / "swerl.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src


def test_open_instruct_rows_use_their_prompt_and_per_row_image(tmp_path):
    src = open_instruct_rows(tmp_path)
    data = tmp_path / "task-data.tar.gz.extracted"
    one, two = import_tasks(src, tmp_path / "out", task_data_dir=data)
    assert (one.task_id, two.task_id) == ("tmax-001", "tmax-002")
    # the per-sample image wins over image.txt, as SWERLSandboxEnv._do_reset resolves it
    assert (one.image, two.image) == ("py:3.12", "localhost/per-row:2")
    # the prompt is the row's messages (open-instruct discards the reset observation)
    assert one.instruction == "Write ok to /workspace/out.txt please (tmax-001)"
    assert one.system_prompt == OI_SYSTEM and one.format == "open_instruct"
    assert one.reward_file == "/logs/verifier/reward.txt" and one.tests_dest == "/tests"
    assert one.setup_script == tmp_path / "out" / "tmax-001" / "setup.sh"
    assert one.resolved_test_command == 'bash "$TESTS_DIR/test.sh"'
    one.check()
    # read directly by the collector, the rows name folders next to the rows file
    (data / "swerl.jsonl").write_text(src.read_text())
    direct, _ = load_tasks(data / "swerl.jsonl")
    assert direct.image == "py:3.12" and direct.system_prompt == OI_SYSTEM


def test_open_instruct_row_errors_are_clear_and_leave_nothing(tmp_path):
    src = open_instruct_rows(tmp_path)
    with pytest.raises(TaskError, match=r"swerl.jsonl:1: no task folder .*--task-data-dir"):
        import_tasks(src, tmp_path / "out")  # the task data is not next to the rows
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "swerl.jsonl",
        "task-data.tar.gz.extracted",
    ]
    bad = {"messages": "x", "env_config": {"env_name": "wordle_text_env", "word": "crane"}}
    src.write_text(src.read_text() + json.dumps(bad) + "\n")
    data = tmp_path / "task-data.tar.gz.extracted"
    with pytest.raises(TaskError, match=r"swerl.jsonl:3: env_config has no 'swerl_sandbox'"):
        import_tasks(src, tmp_path / "out", task_data_dir=data)


@pytest.mark.parametrize(
    ("text", "reward"),
    [("1\n", 1.0), (" 0.5 \n", 0.5), ("2", 1.0), ("-3", 0.0), ("1 passed", 0.0), ("", 0.0)],
)
def test_reward_txt_is_read_as_open_instruct_reads_it(text, reward):
    """``float(stdout.strip())`` clamped to [0, 1]; anything that is not one number → 0."""
    from sandpiper.collector.rewards.result_formats import reward_from_result

    got, _ = reward_from_result("reward_file", result_text=text, stdout="", exit_code=0, secret="s")
    assert got == reward


def test_a_bad_banned_pattern_is_one_invalid_episode(tiny_tokenizer, tmp_path):
    """A row whose banned_patterns is not a list of strings: the episode is invalid with its
    error (task_error), never a valid 0 and never an abort."""
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps({"prompt": "2+2?", "answer": "4", "banned_patterns": "rm"}) + "\n")
    (task,) = load_tasks(src)
    sandbox = scripted_sandbox()
    submit = '<tool_call>{"name": "submit", "arguments": {"answer": "4"}}</tool_call>'
    episode = asyncio.run(
        run_episode(
            episode_id="e", sample_index=0, task=task,
            policy=TokenPolicy(ScriptedPolicy(tiny_tokenizer, [submit]),
                               ChatRenderer(tiny_tokenizer, FAKE_TOOL_SCHEMAS)),
            sandbox=sandbox, toolbox=FakeToolbox(sandbox), limits=SamplingLimits(),
        )
    )  # fmt: skip
    assert episode.stop_reason is StopReason.TASK_ERROR and not episode.valid
    assert episode.reward is None and "banned_patterns" in episode.error


def test_openai_content_parts_and_developer_role(tmp_path):
    """OpenAI-style messages: content as a list of text parts, ``developer`` as the system
    role; a part that is not text is refused with its row and message number."""
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]
    row = {
        "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}],
        "answer": "4",
    }  # fmt: skip
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    bad = {"messages": [{"role": "user", "content": [image]}], "answer": "4"}
    src = tmp_path / "openai.jsonl"
    src.write_text(json.dumps(row) + "\n")
    (task,) = load_tasks(src)
    assert task.instruction == "What is\n2+2?" and task.system_prompt == "Be brief."
    src.write_text(json.dumps(row) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(
        TaskError, match=r"openai.jsonl:2: prompt message 1: content part 1 is 'image_url'"
    ):
        load_tasks(src)


def test_llm_in_sandbox_record_missing_a_field_names_the_nearest_one(tmp_path):
    record = rllm_record(LIS_ROWS[1])
    record["extra_info"]["domian"] = record["extra_info"].pop("domain")
    src = tmp_path / "train_verl.json"
    src.write_text(json.dumps([rllm_record(LIS_ROWS[0]), record]))
    with pytest.raises(TaskError, match=r"record 2: no field 'domain' .*'domian': did you mean"):
        import_tasks(src, tmp_path / "out")
