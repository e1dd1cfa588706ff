"""The intervals bench/learns_bench.py reports, against published values.

Wilson score intervals: Newcombe (1998), "Two-sided confidence intervals for the single
proportion", Statistics in Medicine 17:857-872, Table I (method 3). Differences: Newcombe
(1998), "Interval estimation for the difference between independent proportions",
Statistics in Medicine 17:873-890, Table II (method 10, the hybrid score interval). Both
tables give four decimals.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from learns_bench import (
    check_disjoint,
    compare,
    mcnemar_exact_p,
    newcombe_difference,
    t_interval,
    wilson,
)

from sandpiper.errors import SandpiperError


@pytest.mark.parametrize(
    ("passes", "n", "lower", "upper"),
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611),
     (1, 29, 0.0061, 0.1718)],
)  # fmt: skip
def test_wilson_matches_newcombe_table(passes: int, n: int, lower: float, upper: float) -> None:
    lo, hi = wilson(passes, n)
    assert lo == pytest.approx(lower, abs=5e-5)
    assert hi == pytest.approx(upper, abs=5e-5)


def test_wilson_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for passes, n in ((0, 128), (7, 128), (64, 128), (128, 128)):
        expected = stats.binomtest(passes, n).proportion_ci(method="wilson")
        assert wilson(passes, n) == pytest.approx((expected.low, expected.high), abs=1e-12)


@pytest.mark.parametrize(
    ("a", "n_a", "b", "n_b", "lower", "upper"),
    [(56, 70, 48, 80, 0.0524, 0.3339), (9, 10, 3, 10, 0.1705, 0.8090),
     (5, 56, 0, 29, -0.0381, 0.1926), (0, 10, 0, 20, -0.1611, 0.2775)],
)  # fmt: skip
def test_newcombe_difference_matches_table(
    a: int, n_a: int, b: int, n_b: int, lower: float, upper: float
) -> None:
    diff, lo, hi = newcombe_difference(a, n_a, b, n_b)
    assert diff == pytest.approx(a / n_a - b / n_b)
    assert lo == pytest.approx(lower, abs=5e-5)
    assert hi == pytest.approx(upper, abs=5e-5)


def test_wilson_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError):
        wilson(5, 4)
    with pytest.raises(ValueError):
        wilson(0, 0)


@pytest.mark.parametrize(
    ("only_a", "only_b", "p"),
    [(0, 0, 1.0), (0, 5, 2 / 32), (1, 6, 2 * 8 / 128), (6, 1, 2 * 8 / 128), (3, 3, 1.0)],
)
def test_mcnemar_exact(only_a: int, only_b: int, p: float) -> None:
    assert mcnemar_exact_p(only_a, only_b) == pytest.approx(p)


def test_compare_counts_paired_tasks() -> None:
    before = {"a": False, "b": True, "c": False, "d": True}
    after = {"a": True, "b": True, "c": True, "d": False}
    result = compare(before, after)
    assert result["before"]["passes"] == 2 and result["after"]["passes"] == 3
    assert result["difference"]["after_minus_before"] == pytest.approx(0.25)
    assert result["mcnemar"]["pass_after_only"] == 2
    assert result["mcnemar"]["pass_before_only"] == 1
    lo, hi = result["difference"]["newcombe95"]
    assert lo < 0.25 < hi


def test_t_interval_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    values = [0.0, 1.0, 0.25, 0.5, 1.0, 0.0, 0.125]
    mean, lo, hi = t_interval(values)
    expected = stats.ttest_1samp(values, 0.0).confidence_interval(0.95)
    assert mean == pytest.approx(sum(values) / len(values))
    assert (lo, hi) == pytest.approx((expected.low, expected.high), abs=1e-12)
    with pytest.raises(ValueError):
        t_interval([1.0])


def test_compare_keeps_partial_credit() -> None:
    before = {"a": 0.0, "b": 0.5, "c": 1.0}
    after = {"a": 1.0, "b": 0.75, "c": 1.0}
    result = compare(before, after)
    assert result["before"]["passes"] == 1 and result["after"]["passes"] == 2
    assert result["before"]["mean_score"] == pytest.approx(0.5)
    assert result["score_difference"]["mean_after_minus_before"] == pytest.approx(1.25 / 3)
    assert result["mcnemar"]["pass_after_only"] == 1


def test_disjoint_by_prompt_refuses_a_shared_question(tmp_path: Path) -> None:
    def rows(path: Path, items: list[tuple[str, str, str]]) -> Path:
        lines = [json.dumps({"id": i, "prompt": q, "answer": a}) for i, q, a in items]
        path.write_text("\n".join(lines) + "\n")
        return path

    train = rows(tmp_path / "train.jsonl", [("t0", "2 * 6", "12"), ("t1", "1 * 5", "5")])
    held = rows(tmp_path / "held.jsonl", [("h0", "3 * 4", "12")])
    check_disjoint(train, held, "prompt")  # a shared answer is fine for products
    with pytest.raises(SandpiperError, match="answers"):
        check_disjoint(train, held, "answer")
    clash = rows(tmp_path / "clash.jsonl", [("h1", "1 * 5", "5")])
    with pytest.raises(SandpiperError, match="prompts"):
        check_disjoint(train, clash, "prompt")
