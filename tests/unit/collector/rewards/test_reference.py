"""The task's reward reference is a tagged union on ``reward`` (issue 18)."""

from __future__ import annotations

import json

import pytest

from sandpiper.collector.rewards import (
    reference,  # TestsReference by attribute: pytest collects Test* names
)
from sandpiper.collector.rewards.compute import compute_reward
from sandpiper.collector.rewards.reference import (
    REFERENCE_KEYS,
    REWARD_KINDS,
    BrokenReference,
    LlmInSandboxReference,
    MathReference,
    RougeReference,
    parse_reference,
    task_reference,
)
from sandpiper.collector.tasks.loading import load_tasks
from sandpiper.errors import TaskError


def test_the_kind_picks_the_class_and_its_fields():
    ref = parse_reference({"reward": "rouge", "answer": "a b", "rouge_type": "rouge1"})
    assert isinstance(ref, RougeReference) and ref.rouge_type == "rouge1"
    ref = parse_reference({"reward": "llm_in_sandbox", "answer": 3, "domain": "math"})
    assert isinstance(ref, LlmInSandboxReference) and ref.answer == "3"  # numbers read as text
    assert isinstance(parse_reference({"answer": "1"}, default_kind="math"), MathReference)
    assert isinstance(parse_reference({}, default_kind="tests"), reference.TestsReference)
    # A row's keys that its kind does not read are not part of its reference.
    ref = parse_reference({"reward": "math", "answer": "1", "domain": "algebra"})
    assert ref.as_dict() == {"reward": "math", "answer": "1"}
    assert set(REWARD_KINDS) == {
        "math", "exact", "strict", "choice", "rouge", "llm_in_sandbox", "reasoning_gym", "python",
        "tests", "none",
    }  # fmt: skip
    assert REFERENCE_KEYS[0] == "reward" and "answer_file" in REFERENCE_KEYS


def test_wrong_types_and_unknown_kinds_are_task_errors_that_name_the_field():
    with pytest.raises(TaskError, match="banned_patterns"):
        parse_reference({"reward": "exact", "answer": "x", "banned_patterns": "rm"})
    with pytest.raises(TaskError, match="agent_timeout_s"):
        parse_reference({"reward": "tests", "agent_timeout_s": -1})
    with pytest.raises(TaskError, match="agent_command"):
        parse_reference({"reward": "tests", "agent_command": "  "})
    with pytest.raises(TaskError, match="unknown reward kind 'f1'"):
        parse_reference({"reward": "f1", "answer": "x"})
    broken = task_reference({"reward": "f1", "answer": "x"}, where="row 3")
    assert isinstance(broken, BrokenReference) and "row 3" in broken.error
    assert broken.as_dict() == {"reward": "f1", "answer": "x"}  # kept as the file said
    with pytest.raises(TaskError, match="unknown reward kind"):
        compute_reward(broken, answer="x")


def test_round_trip_through_the_store_json_and_the_old_dict_reads():
    given = {"reward": "exact", "answer": "42", "banned_patterns": ["sorted("],
             "agent_command": ["mini", "-y"], "agent_env": {"A": "1"}}  # fmt: skip
    ref = parse_reference(given)
    assert ref.as_dict() == given
    assert parse_reference(json.loads(json.dumps(ref.as_dict()))) == ref
    # Read access as the dict earlier releases held (for code outside this package).
    assert ref == given and ref["answer"] == "42" and ref.get("rouge_type") is None
    assert compute_reward(ref, answer="42").reward == 1.0
    assert compute_reward(given, answer="42").reward == 1.0  # a plain dict is parsed
    assert compute_reward(ref, answer="x sorted(", model_text="sorted(").reward == -1.0


def test_loaders_build_typed_references(tmp_path):
    src = tmp_path / "t.jsonl"
    rows = [
        {"id": "a", "prompt": "2+2?", "answer": 4},
        {"id": "b", "prompt": "say hi", "answer": "hi", "reward": "rouge"},
        {"id": "c", "prompt": "x", "answer": "y", "reward": "nope"},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b, c = sorted(load_tasks(src), key=lambda t: t.task_id)
    assert isinstance(a.reference, MathReference) and a.reference.answer == "4"
    assert isinstance(b.reference, RougeReference)
    # A bad reference does not abort the file: the task's episodes are invalid with it.
    assert isinstance(c.reference, BrokenReference)
    with pytest.raises(TaskError, match="unknown reward kind 'nope'"):
        c.check()
    assert c.to_record().reference == {"reward": "nope", "answer": "y"}
