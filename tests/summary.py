"""What ``make test`` prints at its end, for a reader who did not write the suite.

- a failure's header names the part of the system it is about (``[store]``, ``[sandbox]``,
  ``[learner]``, ...), from the test module's name, so the first line of every failure says
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
    ("test_store", "store"),
    ("test_sandbox", "sandbox"),
    ("test_editor", "sandbox tools"),
    ("test_tools", "sandbox tools"),
    ("test_host_protection", "sandbox"),
    ("test_janitor", "sandbox"),
    ("test_attacks", "sandbox security"),
    ("test_reward_forging", "rewards security"),
    ("test_trainer", "learner"),
    ("test_learner", "learner"),
    ("test_replay", "learner replay"),
    ("test_gateway", "gateway"),
    ("test_real_agents", "gateway agents"),
    ("test_collector", "collector"),
    ("test_collectors", "collector"),
    ("test_fuzz", "collector"),
    ("test_episode", "collector episode"),
    ("test_lifeline", "collector"),
    ("test_analysis", "analysis"),
    ("test_hostile_display", "analysis"),
    ("test_vllm", "inference (vLLM)"),
    ("test_inference", "inference (vLLM)"),
    ("test_hot_reload", "inference (vLLM)"),
    ("test_real_model", "real model (SmolLM2)"),
    ("test_demo", "demo"),
    ("test_config", "config"),
    ("test_task", "tasks"),
    ("test_shipped_tasks", "tasks"),
    ("test_peer_data", "tasks"),
    ("test_reward", "rewards"),
    ("test_scoring", "rewards"),
    ("test_llm_in_sandbox", "rewards"),
    ("test_scaleout", "scale-out"),
    ("test_race", "benchmarks (race)"),
    ("test_docs", "docs"),
    ("test_cli", "cli"),
    ("test_compose", "deployment"),
    ("test_packaging", "packaging"),
    ("test_model", "models"),
    ("test_tiny_model", "models"),
)
"""Test module name prefix -> the part of the system its failures are about (first match)."""

TIERS = ("unit", "integration", "e2e")


def part_of(nodeid: str) -> str:
    """The part of the system a test is about, from its module's name."""
    stem = PurePosixPath(nodeid.split("::", 1)[0]).stem
    for prefix, part in PARTS:
        if stem.startswith(prefix):
            return part
    if "bench" in stem:
        return "benchmarks"
    return stem.removeprefix("test_").replace("_", " ")


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
