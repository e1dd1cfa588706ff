"""What ``make test`` prints at its end, for a reader who did not write the suite.

- a failure's header names the part of the system it is about (``[store]``, ``[sandbox]``,
  ``[learner]``, ...), from the test module's path, so the first line of every failure says
  where to look before its traceback does;
- after the run: the time each tier took (the sum of its tests' setup, call and teardown,
  and how many ran) and the ten slowest tests.

Loaded by ``tests/conftest.py`` (``pytest_plugins``). Under pytest-xdist the reports reach
the controller, which prints the summary; the header is set on the worker, where the report
is made, and travels with it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import PurePosixPath

import pytest

PARTS: tuple[tuple[str, str], ...] = (
    ("security/test_reward_forging", "rewards security"),
    ("security/test_hostile_display", "analysis"),
    ("security/test_host_protection", "sandbox"),
    ("security/test_episode_robustness", "collector episode"),
    ("security/test_fuzz_daemon", "collector"),
    ("security/", "sandbox security"),
    ("collector/episode/tools/", "sandbox tools"),
    ("collector/episode/", "collector episode"),
    ("collector/sandbox/", "sandbox"),
    ("collector/test_sandbox", "sandbox"),
    ("collector/gateway/", "gateway"),
    ("collector/inference/test_lifeline", "collector"),
    ("collector/inference/", "inference (vLLM)"),
    ("collector/rewards/", "rewards"),
    ("collector/test_rewards", "rewards"),
    ("collector/tasks/", "tasks"),
    ("collector/", "collector"),
    ("store/", "store"),
    ("trainer/test_replay", "learner replay"),
    ("commands/test_replay", "learner replay"),
    ("trainer/", "learner"),
    ("analysis/", "analysis"),
    ("config/", "config"),
    ("commands/", "cli"),
    ("demo/", "demo"),
    ("models/", "models"),
    ("testing/", "test doubles"),
    ("fixtures/", "test fixtures"),
    ("tasks/", "tasks"),
    ("bench/test_race", "benchmarks (race)"),
    ("bench/", "benchmarks"),
    ("docs/", "docs"),
    ("scripts/", "scripts"),
    ("test_cli", "cli"),
    ("test_compose", "deployment"),
    ("test_packaging", "packaging"),
    ("test_real_model", "real model (SmolLM2)"),
    ("test_scaleout", "scale-out"),
    ("test_demo", "demo"),
)
"""A test module's path inside its tier folder (a prefix: ``store/``, ``test_cli``) -> the part
of the system its failures are about (first match). The folders mirror the source tree."""

TIERS = ("unit", "integration", "e2e")


def part_of(nodeid: str) -> str:
    """The part of the system a test is about, from its module's path."""
    path = PurePosixPath(nodeid.split("::", 1)[0])
    inside = path.parts[2:] if path.parts[:1] == ("tests",) and path.parts[1:2] else path.parts
    where = "/".join(inside)
    for prefix, part in PARTS:
        if where.startswith(prefix):
            return part
    if "bench" in path.stem:
        return "benchmarks"
    return path.stem.removeprefix("test_").replace("_", " ")


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        path, line, domain = report.location
        if not domain.startswith("["):
            report.location = (path, line, f"[{part_of(report.nodeid)}] {domain}")


class Summary:
    """Collects every report the controller sees; prints tiers and the slowest tests."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds: dict[str, float] = defaultdict(float)
        self.tier: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        if report.nodeid not in self.tier:
            keywords = getattr(report, "keywords", {}) or {}
            self.tier[report.nodeid] = next((t for t in TIERS if t in keywords), "other")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.seconds:
            return
        tw = terminalreporter
        tw.section("time by tier")
        totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for nodeid, s in self.seconds.items():
            totals[self.tier.get(nodeid, "other")][0] += s
            totals[self.tier.get(nodeid, "other")][1] += 1
        for tier in (*TIERS, "other"):
            if tier in totals:
                s, n = totals[tier]
                tw.write_line(f"{tier:>12}: {s:8.1f} s of tests, {int(n)} tests")
        wall = time.monotonic() - self.started
        tw.write_line(f"{'wall':>12}: {wall:8.1f} s (the tiers run side by side)")
        tw.section("slowest 10 tests")
        slowest = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:10]
        for nodeid, s in slowest:
            tw.write_line(f"{s:8.1f} s  [{part_of(nodeid)}] {nodeid.split('@', 1)[0]}")


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is None:  # the controller (or a run without xdist)
        config.pluginmanager.register(Summary(), "sandpiper-summary")
