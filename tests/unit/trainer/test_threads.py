"""learner.torch_threads = "auto": threads follow the cores the other processes leave idle."""

from __future__ import annotations

import logging
import time

import pytest
from pydantic import ValidationError

from sandpiper.config import LearnerConfig
from sandpiper.trainer.threads import (
    CpuSample,
    FollowIdleCores,
    machine_busy_s,
    sample,
    threads_for,
)


def test_machine_busy_reads_the_aggregate_line(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 20 30 400 50 6 4 0 7 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    monkeypatch.setattr("os.sysconf", lambda name: 100)
    assert machine_busy_s(str(stat)) == pytest.approx((100 + 20 + 30 + 6 + 4) / 100)
    stat.write_text("intr 1 2 3\n")
    with pytest.raises(ValueError, match="no aggregate"):
        machine_busy_s(str(stat))


@pytest.mark.parametrize(
    ("machine_busy", "own", "expected"),
    [
        (2.0, 2.0, 2),  # only this process ran: take every core
        (2.0, 0.5, 1),  # the others kept 1.5 cores busy: 0.5 left, at least one thread
        (1.0, 1.0, 2),  # one core idle, one kept busy by this process: both
        (1.0, 0.0, 1),  # another process kept one core busy: the other one
        (0.0, 0.0, 2),  # all idle
        (8.0, 0.0, 1),  # overloaded: still one
    ],
)
def test_threads_are_the_cores_the_others_leave(machine_busy, own, expected):
    before = CpuSample(wall_s=10.0, busy_s=100.0, own_s=5.0)
    after = CpuSample(wall_s=11.0, busy_s=100.0 + machine_busy, own_s=5.0 + own)
    assert threads_for(before, after, cores=2) == expected


def test_a_window_too_short_is_not_measured():
    before = CpuSample(1.0, 1.0, 1.0)
    assert threads_for(before, CpuSample(1.1, 1.2, 1.0), cores=2) is None


def test_follow_applies_the_last_steps_measurement_before_the_next(caplog):
    ticks = iter([
        CpuSample(0.0, 0.0, 0.0), CpuSample(2.0, 4.0, 1.0),  # step 1: others 1.5 cores of 4
        CpuSample(3.0, 4.0, 1.0), CpuSample(4.0, 4.0, 1.0),  # step 2: nothing busy
        CpuSample(5.0, 4.0, 1.0),
    ])  # fmt: skip
    applied: list[int] = []
    cores = FollowIdleCores(4, sampler=lambda: next(ticks), set_threads=applied.append)
    cores.threads = 1
    assert cores.begin() == 1 and applied == []  # the first step keeps the start-up count
    cores.end()
    with caplog.at_level(logging.INFO, logger="sandpiper.trainer.threads"):
        assert cores.begin() == 2  # 4 - 1.5 others = 2.5, rounded to even
    assert applied == [2] and "torch threads 1 -> 2" in caplog.text
    cores.end()
    assert cores.begin() == 4 and applied == [2, 4]


def test_a_real_sample_counts_this_process():
    first = sample()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    second = sample()
    assert second.own_s - first.own_s >= 0.3
    assert second.busy_s - first.busy_s >= 0.2  # the machine saw (most of) it too
    assert second.wall_s > first.wall_s


def test_the_setting():
    assert LearnerConfig(torch_threads="auto").torch_threads == "auto"
    assert LearnerConfig(torch_threads=3).torch_threads == 3
    assert LearnerConfig().torch_threads is None
    for bad in (0, "many", -1):
        with pytest.raises(ValidationError):
            LearnerConfig(torch_threads=bad)
