"""The cost of each test module, from pytest's JUnit XML: the table in docs/testing.md.

    python scripts/test_costs.py runs/ci-junit.xml [--long runs/ci-junit-long.xml] [--top N]

Seconds are the sum of the module's test durations (setup and teardown included, as pytest
reports them), so with three workers they add up to about three times the wall time.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def module_costs(report: Path) -> dict[str, tuple[int, float]]:
    """Module path -> (tests, seconds) of one JUnit report."""
    costs: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        costs[module][0] += 1
        costs[module][1] += float(case.get("time") or 0.0)
    return {m: (int(n), s) for m, (n, s) in costs.items()}


def table(test: dict[str, tuple[int, float]], long: dict[str, tuple[int, float]], top: int) -> str:
    modules = sorted(set(test) | set(long), key=lambda m: -(test.get(m, (0, 0.0))[1]
                                                           + long.get(m, (0, 0.0))[1]))  # fmt: skip
    rows = [
        "| module | `make test` tests | s | `make test-long` tests | s |",
        "|---|---|---|---|---|",
    ]
    for module in modules[:top]:
        n, s = test.get(module, (0, 0.0))
        ln, ls = long.get(module, (0, 0.0))
        rows.append(
            f"| `{module}` | {n or ''} | {s:.0f} | {ln or ''} | {f'{ls:.0f}' if ln else ''} |"
        )
    rest = modules[top:]
    if rest:
        n = sum(test.get(m, (0, 0.0))[0] for m in rest)
        s = sum(test.get(m, (0, 0.0))[1] for m in rest)
        ln = sum(long.get(m, (0, 0.0))[0] for m in rest)
        ls = sum(long.get(m, (0, 0.0))[1] for m in rest)
        rows.append(
            f"| {len(rest)} other modules | {n} | {s:.0f} | {ln or ''} | {f'{ls:.0f}' if ln else ''} |"
        )
    n = sum(v[0] for v in test.values())
    s = sum(v[1] for v in test.values())
    ln = sum(v[0] for v in long.values())
    ls = sum(v[1] for v in long.values())
    rows.append(f"| **all** | {n} | {s:.0f} | {ln} | {ls:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", type=Path, help="JUnit XML of `make test`")
    parser.add_argument("--long", type=Path, help="JUnit XML of `make test-long`")
    parser.add_argument("--top", type=int, default=30, help="modules listed (the rest summed)")
    args = parser.parse_args(argv)
    long = module_costs(args.long) if args.long else {}
    print(table(module_costs(args.report), long, args.top))


if __name__ == "__main__":
    main()
