"""The benchmark records in ``bench/results/*.json``: append a run, render the README table.

Each bench has one results file: its declared ``keys`` (what each figure measures, its unit
and goal, and the arguments it is run with) and its ``records``, oldest first. A record is one
measured figure: ``value`` (a number, or ``[low, high]`` over several runs), optional
``median`` and ``runs``, the ``goal`` it was judged against, the ``commit`` and ``date`` it
was measured at, the ``machine``, its ``load`` (1-minute load average, start and end of the
run) and its ``source`` (``make bench``, or the document it was imported from).

Run::

    python bench/report.py --markdown               # the README's Benchmarks table
    python bench/report.py --write-readme README.md # put it between the README's markers
    python bench/report.py --append bench/store_bench.py runs/bench/store_bench.log \\
        --load-start 1.3                            # what `make bench` does after each bench

``--append`` reads the last JSON object of the log (every bench prints one with ``--json``)
and records each declared key of the default invocation it finds (every numeric figure when
the bench declares none), then the table shows the newest value of each declared key.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
BEGIN = "<!-- bench-table:begin (python bench/report.py --write-readme README.md) -->"
END = "<!-- bench-table:end -->"
ORDER = ["sandbox_bench", "store_bench", "collector_bench", "learner_bench", "gateway_bench",
         "client_bench", "scaleout_bench", "e2e_bench", "spool_bench"]  # fmt: skip
"""Table order; benches not listed follow by name."""
OPS = {">=": "≥", "<=": "≤"}


class ResultsError(ValueError):
    """A results file that does not have the declared shape."""


def load(results: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """Every results file by bench name, checked for the fields the table needs."""
    out = {}
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            for entry in data["keys"]:
                _ = entry["key"], entry["args"], entry["unit"], entry["goal"]
            for record in data["records"]:
                _ = record["key"], record["value"], record["commit"], record["date"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ResultsError(f"{path}: not a results file ({type(e).__name__}: {e})") from None
        out[path.stem] = data
    rank = {name: i for i, name in enumerate(ORDER)}
    return dict(sorted(out.items(), key=lambda kv: (rank.get(kv[0], len(ORDER)), kv[0])))


def _num(x: float) -> str:
    text = f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return text.replace("-", "−")


def _with_unit(text: str, unit: str) -> str:
    return f"{text}{unit}" if unit in ("×", "") else f"{text} {unit}"


def goal_text(goal: dict[str, Any] | None, unit: str) -> str:
    if goal is None:
        return "—"
    return goal.get("text") or _with_unit(f"{OPS[goal['op']]} {_num(goal['target'])}", unit)


def verdict(value: float | list[float], goal: dict[str, Any] | None) -> str | None:
    """``met`` / ``not met`` / ``partly met`` (a range on both sides of the goal)."""
    if goal is None:
        return None
    lo, hi = (value, value) if isinstance(value, int | float) else value
    ok = [v >= goal["target"] if goal["op"] == ">=" else v <= goal["target"] for v in (lo, hi)]
    return "met" if all(ok) else "not met" if not any(ok) else "partly met"


def value_text(record: dict[str, Any], unit: str) -> str:
    value = record["value"]
    if isinstance(value, int | float):
        shown = _num(value)
    else:  # a range; "to" where a dash could read as a minus sign
        shown = (" to " if min(value) < 0 else "–").join(map(_num, value))
    text = _with_unit(shown, unit)
    extra = [f"median {_num(record['median'])}"] if "median" in record else []
    if record.get("runs", 1) > 1:
        extra.append(f"{record['runs']} runs")
    if extra:
        text += f" ({', '.join(extra)})"
    judged = verdict(value, record.get("goal"))
    return f"{text}: {judged}" if judged else text


def rows(results: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """(bench, key, goal, last value) per declared key, in table order; a key marked
    ``history`` (a measurement since replaced, its records kept) is left out."""
    out = []
    for data in results.values():
        name = Path(data["bench"]).name
        for entry in data["keys"]:
            if entry.get("history"):
                continue
            matching = [
                r for r in data["records"]
                if r["key"] == entry["key"] and r.get("args", "") == entry["args"]
            ]  # fmt: skip
            last = value_text(matching[-1], entry["unit"]) if matching else "not measured yet"
            bench = f"`{name} {entry['args']}`" if entry["args"] else f"`{name}`"
            out.append((bench, f"`{entry['key']}`", goal_text(entry["goal"], entry["unit"]), last))
    return out


def markdown(results: dict[str, dict[str, Any]] | None = None) -> str:
    lines = ["| bench | key | goal | last value |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in rows(load() if results is None else results)]
    return "\n".join(lines) + "\n"


def readme_table(text: str) -> str:
    """The table between the README's markers (ResultsError when they are missing)."""
    if BEGIN not in text or END not in text:
        raise ResultsError(f"README has no bench table markers ({BEGIN} … {END})")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write_readme(path: Path, results: dict[str, dict[str, Any]] | None = None) -> None:
    text = path.read_text()
    readme_table(text)  # refuses a README without markers before writing anything
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{BEGIN}\n{markdown(results)}{END}{tail}")


def last_json(log: Path) -> dict[str, Any]:
    """The last line of ``log`` that is a JSON object (a bench's ``--json`` output)."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if isinstance(data, dict):
                return data
    raise ResultsError(f"{log}: no JSON result (did the bench fail? its output is in the log)")


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = " (" + line.split(":", 1)[1].strip() + ")"
                break
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()}, {os.cpu_count()} CPUs{model}, {mem_gb:.0f} GB"


def commit() -> str | None:
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=RESULTS.parent)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return None
    dirty = git("diff", "--quiet", "HEAD").returncode != 0
    return head.stdout.strip() + ("+uncommitted changes" if dirty else "")


def append(
    bench: Path, log: Path, load_start: float | None, results: Path = RESULTS, args: str = ""
) -> int:
    """Record the figures of one run of ``bench`` with arguments ``args`` (its declared keys
    for those arguments); returns how many were recorded."""
    figures = last_json(log)
    path = results / f"{bench.stem}.json"
    data: dict[str, Any] = (
        json.loads(path.read_text())
        if path.exists()
        else {"bench": f"bench/{bench.name}", "keys": [], "records": []}
    )
    declared = {e["key"]: e for e in data["keys"] if e["args"] == args}
    if data["keys"]:  # a bench that declares keys: only those of this invocation
        wanted: dict[str, Any] = declared
    else:
        wanted = {k: None for k, v in figures.items() if isinstance(v, int | float)}
    common = {
        "commit": commit(),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "machine": machine(),
        "load": [load_start, round(os.getloadavg()[0], 2)],
        "source": "make bench",
    }
    added = 0
    for key, entry in wanted.items():
        value = figures.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            goal = entry["goal"] if entry else None
            data["records"].append(
                {"key": key, "args": args, "value": value, "goal": goal} | common
            )
            added += 1
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return added


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="Print the README table.")
    parser.add_argument("--write-readme", type=Path, metavar="README", help="Rewrite its table.")
    parser.add_argument("--append", nargs=2, type=Path, metavar=("BENCH", "LOG"))
    parser.add_argument("--load-start", type=float, help="Load average when the run started.")
    parser.add_argument(
        "--args",
        default="",
        help="The bench's arguments in that run "
        "(its keys declared for them are recorded; default: none)",
    )
    args = parser.parse_args(argv)
    try:
        if args.append:
            bench, log = args.append
            n = append(bench, log, args.load_start, args=args.args)
            print(f"{bench.name}: {n} figures recorded in bench/{RESULTS.name}/")
        if args.write_readme:
            write_readme(args.write_readme)
        if args.markdown or not (args.append or args.write_readme):
            sys.stdout.write(markdown())
    except (ResultsError, OSError) as e:
        print(f"bench/report.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
