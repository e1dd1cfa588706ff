"""Reward parsing of test-script output: JSON line, pytest summary, fraction, exit status."""

from __future__ import annotations

import pytest

from collector.tools.reward import parse_reward


@pytest.mark.parametrize(
    ("stdout", "exit_code", "reward", "fmt"),
    [
        ('noise\n{"reward": 0.25, "note": "x"}\n', 1, 0.25, "json"),
        ('{"reward": 1}\n{"reward": 0.5}\n', 0, 0.5, "json"),
        ("==== 3 passed, 1 failed in 0.12s ====", 1, 0.75, "pytest"),
        ("== 2 passed, 1 failed, 1 error in 1s ==", 1, 0.5, "pytest"),
        ("==== 4 failed in 0.12s ====", 1, 0.0, "pytest"),
        ("passed 3/4", 1, 0.75, "fraction"),
        ("1 / 4 tests passed", 1, 0.25, "fraction"),
        ("all good", 0, 1.0, "exit_status"),
        ("bad", 2, 0.0, "exit_status"),
        ("", None, 0.0, "exit_status"),
        ('{"reward": true}\n', 3, 0.0, "exit_status"),
        ('{"reward": NaN}\n', 0, 1.0, "exit_status"),
    ],
)
def test_formats(stdout, exit_code, reward, fmt):
    got, details = parse_reward(stdout, exit_code)
    assert got == pytest.approx(reward)
    assert details["format"] == fmt


def test_json_fields_are_kept():
    _, details = parse_reward('{"reward": 1.0, "passed": 2, "total": 2}', 0)
    assert details == {"format": "json", "passed": 2, "total": 2}
