"""Metrics window, status line and JSONL metrics file; the durable sequence journal."""

from __future__ import annotations

import json

import numpy as np

from sandpiper.collector.daemon.journal import SeqJournal
from sandpiper.collector.daemon.status import CollectorMetrics, StatusReporter, status_line
from sandpiper.store.records import (
    EpisodeRecord,
    GroupRecord,
    GroupSampling,
    Role,
    Split,
    StopReason,
    TurnRecord,
    utcnow,
)


def _episode(reward, valid=True, version=2, n=5):
    turn = TurnRecord(
        1, Role.ASSISTANT, "x", np.zeros(n, np.int32), np.zeros(n, np.float32),
        np.full(n, version, np.int32), True,
    )  # fmt: skip
    return EpisodeRecord(
        "e", 0, StopReason.SUBMITTED if valid else StopReason.SANDBOX_LOST, valid, True,
        reward, {}, (turn,), utcnow(), 1.0, None,
    )  # fmt: skip


def _group(*episodes, split=Split.TRAIN):
    return GroupRecord("r/t/0", "r", "t", split, GroupSampling(), tuple(episodes))


def test_snapshot_rates_window_and_lag(tmp_path):
    metrics = CollectorMetrics()
    metrics.policy_version = 3
    metrics.add_group(_group(_episode(1.0), _episode(0.0), _episode(None, valid=False)))
    metrics.add_group(_group(_episode(0.25, version=1), split=Split.VALIDATION))
    snap = metrics.snapshot()
    assert snap["episodes_total"] == 4 and snap["invalid_total"] == 1
    assert snap["reward_mean"] == 0.5  # train episodes only, invalid excluded
    assert snap["valid_fraction"] == 2 / 3
    assert snap["lag_versions"] == 1  # served v3, oldest train token v2
    assert snap["tokens_per_s"] > 0
    line = status_line(snap)
    assert line.startswith("v3 lag 1 |") and "reward 0.500" in line
    again = metrics.snapshot()  # the window restarts
    assert again["reward_mean"] is None and again["episodes_per_s"] == 0.0
    assert "reward -" in status_line(again)
    reporter = StatusReporter(tmp_path / "m.jsonl", live=False)
    reporter.report(snap)
    reporter.report(again)
    reporter.close()
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["episodes_total"] for r in rows] == [4, 4]


def test_journal_survives_reopen_and_reuses_only_unfinished_seqs(tmp_path):
    path = tmp_path / "j.json"
    journal = SeqJournal(path)
    gid = lambda s: f"r/a/{s}"  # noqa: E731
    assert journal.start("a", gid) == (0, "r/a/0")
    assert journal.start("a", gid) == (1, "r/a/1")
    assert journal.start("b", lambda s: f"r/b/{s}") == (0, "r/b/0")
    journal.done("r/a/0")
    # "crash": reopen from disk
    reopened = SeqJournal(path)
    assert reopened.pending == {"r/a/1": ("a", 1), "r/b/0": ("b", 0)}
    assert reopened.reconcile(["r/b/0", "r/a/0", "other"]) == 1
    assert reopened.peek("a") == 1 and reopened.peek("b") == 1
    assert reopened.start("a", gid) == (1, "r/a/1")  # re-run under the same id
    assert reopened.start("a", gid) == (2, "r/a/2")
    reopened.abandon("r/a/2")  # cancelled on shutdown: stays pending, handed out again
    assert reopened.peek("a") == 2 and "r/a/2" in SeqJournal(path).pending


def test_dead_and_refused_groups_are_loud_in_the_status_line():
    metrics = CollectorMetrics()
    assert "DEAD" not in status_line(metrics.snapshot())
    metrics.groups_dead, metrics.groups_rejected = 2, 1
    snap = metrics.snapshot()
    assert snap["groups_dead"] == 2
    assert status_line(snap).endswith("| DEAD 2 grp | REFUSED 1 grp")
