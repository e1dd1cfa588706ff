"""The README's Benchmarks table is what ``bench/report.py`` renders from the committed
records, and ``make bench``'s append keeps every field a record needs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_report"] = module
    spec.loader.exec_module(module)
    return module


report = _report()
FIELDS = {"key", "args", "value", "goal", "commit", "date", "machine", "load", "source"}


def test_readme_table_is_rendered_from_the_committed_results() -> None:
    readme = (ROOT / "README.md").read_text()
    assert report.readme_table(readme) == report.markdown(), (
        "README's bench table is stale: run `python bench/report.py --write-readme README.md`"
    )


def test_every_committed_record_is_complete_and_declared() -> None:
    results = report.load()
    assert results, "bench/results/ holds no results"
    for name, data in results.items():
        declared = {(e["key"], e["args"]) for e in data["keys"]}
        for record in data["records"]:
            assert record.keys() >= FIELDS, (name, record)
            assert (record["key"], record["args"]) in declared, (name, record["key"])
            value = record["value"]
            assert isinstance(value, int | float) or (len(value) == 2 and value[0] <= value[1]), (
                name,
                record,
            )


def test_goals_are_judged_on_both_ends_of_a_range() -> None:
    at_most_2 = {"op": "<=", "target": 2}
    assert report.verdict(1.5, at_most_2) == "met"
    assert report.verdict([1.5, 2.5], at_most_2) == "partly met"
    assert report.verdict([2.1, 2.5], at_most_2) == "not met"
    assert report.verdict([0.9, 1.2], {"op": ">=", "target": 0.8}) == "met"
    assert report.verdict(3.0, None) is None


def _results(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    results.mkdir()
    goal = {"op": ">=", "target": 1.5}
    body = {
        "bench": "bench/x_bench.py",
        "keys": [
            {"key": "speedup", "args": "", "what": "w", "unit": "×", "goal": goal},
            {"key": "speedup", "args": "--big", "what": "w", "unit": "×", "goal": goal},
        ],
        "records": [],
    }
    (results / "x_bench.json").write_text(json.dumps(body))
    return results


def test_append_records_the_declared_figures_of_a_run(tmp_path: Path) -> None:
    results = _results(tmp_path)
    log = tmp_path / "x.log"
    log.write_text('progress line\n{"speedup": 2.0, "other": 7, "note": "x"}\n')
    assert report.append(Path("bench/x_bench.py"), log, 0.5, results) == 1
    data = json.loads((results / "x_bench.json").read_text())
    (record,) = data["records"]
    assert record.keys() >= FIELDS
    assert record["value"] == 2.0 and record["goal"] == {"op": ">=", "target": 1.5}
    assert record["load"][0] == 0.5 and record["source"] == "make bench"
    rows = report.rows({"x_bench": data})
    assert rows[0] == ("`x_bench.py`", "`speedup`", "≥ 1.5×", "2×: met")
    assert rows[1][3] == "not measured yet"


def test_append_with_args_records_the_keys_declared_for_them(tmp_path: Path) -> None:
    results = _results(tmp_path)
    log = tmp_path / "x.log"
    log.write_text('{"speedup": 3.0}\n')
    assert report.append(Path("bench/x_bench.py"), log, None, results, args="--big") == 1
    assert report.append(Path("bench/x_bench.py"), log, None, results, args="--none") == 0
    data = json.loads((results / "x_bench.json").read_text())
    (record,) = data["records"]
    assert record["args"] == "--big" and record["value"] == 3.0
    rows = report.rows({"x_bench": data})
    assert rows[0][3] == "not measured yet" and rows[1][3] == "3×: met"


def test_a_new_bench_records_every_numeric_figure(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    log = tmp_path / "y.log"
    log.write_text('{"a": 1.5, "b": true, "c": "text", "d": 3}\n')
    assert report.append(Path("bench/y_bench.py"), log, None, results) == 2
    data = json.loads((results / "y_bench.json").read_text())
    assert [r["key"] for r in data["records"]] == ["a", "d"]


def test_a_run_without_a_result_changes_nothing(tmp_path: Path) -> None:
    results = _results(tmp_path)
    before = (results / "x_bench.json").read_text()
    log = tmp_path / "x.log"
    log.write_text("Traceback (most recent call last):\n  ...\nRuntimeError: podman missing\n")
    with pytest.raises(report.ResultsError, match="no JSON result"):
        report.append(Path("bench/x_bench.py"), log, 0.5, results)
    assert (results / "x_bench.json").read_text() == before


def test_write_readme_refuses_a_readme_without_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# no table here\n")
    with pytest.raises(report.ResultsError, match="markers"):
        report.write_readme(readme)
    assert readme.read_text() == "# no table here\n"


def test_a_malformed_results_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "bad_bench.json").write_text('{"keys": []}')
    with pytest.raises(report.ResultsError, match=r"bad_bench\.json"):
        report.load(tmp_path)


def test_a_key_marked_history_leaves_the_table_and_keeps_its_records() -> None:
    results = {"x": {"bench": "bench/x_bench.py", "records": [
        {"key": "old", "args": "", "value": 1.0}, {"key": "new", "args": "", "value": 2.0}],
        "keys": [{"key": "old", "args": "", "unit": "", "goal": None, "history": "replaced"},
                 {"key": "new", "args": "", "unit": "", "goal": None}]}}  # fmt: skip
    table = report.markdown(results)
    assert "`new`" in table and "`old`" not in table
