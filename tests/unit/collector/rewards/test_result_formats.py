"""The reward is read in the task's declared format only; printed look-alikes never count."""

from __future__ import annotations

import pytest

from sandpiper.collector.rewards.result_formats import reward_from_result

SECRET = "s3cr3t"


def _get(fmt, *, text=None, stdout="", exit_code=0):
    return reward_from_result(fmt, result_text=text, stdout=stdout, exit_code=exit_code,
                              secret=SECRET)  # fmt: skip


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ('{"reward": 0.25, "note": "x"}', 0.25),
        ('{"passed": 3, "total": 4}', 0.75),
        ('{"passed": 0, "total": 0}', 0.0),
        ('{"reward": true}', 0.0),
        ('{"reward": NaN}', 0.0),
        ("[1]", 0.0),
        ("not json", 0.0),
        (None, 0.0),
    ],
)
def test_result_file(text, reward):
    got, details = _get("result_file", text=text, stdout='{"reward": 1}\n99 passed')
    assert got == pytest.approx(reward) and details["format"] == "result_file"


def test_result_file_keeps_fields():
    _, details = _get("result_file", text='{"reward": 1.0, "passed": 2, "total": 2}')
    assert details == {"format": "result_file", "passed": 2, "total": 2}


def test_tagged_line_needs_the_secret_and_the_last_one_counts():
    stdout = (
        f"SANDPIPER_RESULT {SECRET} " + '{"reward": 0.5}\n'
        'SANDPIPER_RESULT guess {"reward": 1}\n{"reward": 1}\n=== 99 passed in 0.1s ===\n'
    )
    assert _get("tagged_line", stdout=stdout)[0] == 0.5
    assert _get("tagged_line", stdout='SANDPIPER_RESULT guess {"reward": 1}')[0] == 0.0
    empty = reward_from_result("tagged_line", result_text=None, stdout="SANDPIPER_RESULT  {}",
                               exit_code=0, secret="")  # fmt: skip
    assert empty[0] == 0.0


def test_exit_status_only_when_declared():
    assert _get("exit_status", exit_code=0)[0] == 1.0
    assert _get("exit_status", exit_code=1)[0] == 0.0
    assert _get("result_file", exit_code=0)[0] == 0.0
    with pytest.raises(ValueError, match="unknown result format"):
        _get("pytest")


def test_a_result_nested_past_the_stack_scores_zero_instead_of_crashing():
    deep = "[" * 100_000 + "]" * 100_000
    reward, details = reward_from_result(
        "result_file", result_text=deep, stdout="", exit_code=0, secret="s"
    )
    assert reward == 0.0 and details["error"] == "the result is not JSON"
