"""Torch threads that follow the cores the other processes leave idle (``learner.torch_threads
= "auto"``).

On a machine the learner shares with the collector's vLLM and the sandboxes, a fixed thread
count is wrong most of the time: one thread leaves cores idle while the collector waits for
a version; all cores make the learner and vLLM fight over them while both run. Before each
step the learner takes as many threads as the cores it may have: the cores that were idle
during its previous step plus the ones it kept busy itself (``cores - others' busy cores``),
measured from ``/proc/stat`` (every process on the machine) and this process's own CPU time.
The previous step is the best guess of the next one's neighbours: the pipeline's phases
repeat step after step.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CpuSample:
    """Machine and own-process CPU counters at one instant."""

    wall_s: float
    busy_s: float
    """Busy CPU-seconds of the whole machine (all cores) since boot."""
    own_s: float
    """CPU-seconds of this process (all its threads)."""


def machine_busy_s(stat_path: str = "/proc/stat") -> float:
    """Busy CPU-seconds of all cores since boot: ``/proc/stat``'s aggregate line less idle
    and iowait (guest time is already inside user time, so it is not added)."""
    with open(stat_path) as f:
        fields = f.readline().split()
    if not fields or fields[0] != "cpu":
        raise ValueError(f"{stat_path}: no aggregate 'cpu' line")
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def sample() -> CpuSample:
    return CpuSample(time.monotonic(), machine_busy_s(), time.process_time())


def threads_for(before: CpuSample, after: CpuSample, cores: int) -> int | None:
    """Threads for the next step: the cores not kept busy by other processes between the two
    samples, rounded, at least 1 and at most ``cores``; None when the window is too short
    to measure (under 0.2 s)."""
    wall = after.wall_s - before.wall_s
    if wall < 0.2:
        return None
    others = max(0.0, (after.busy_s - before.busy_s) - (after.own_s - before.own_s)) / wall
    return max(1, min(cores, round(cores - others)))


class FollowIdleCores:
    """Sets torch's intra-op threads before each step from the previous step's measurement.

    ``begin()`` before a step, ``end()`` after it; the first step runs with the threads the
    process started with (``OMP_NUM_THREADS``)."""

    def __init__(
        self, cores: int | None = None, *, sampler: Callable[[], CpuSample] = sample,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:  # fmt: skip
        self.cores = cores or len(os.sched_getaffinity(0))
        self._sample, self._set = sampler, set_threads
        self._started: CpuSample | None = None
        self.threads = torch.get_num_threads()
        self._next: int | None = None

    def begin(self) -> int:
        """Apply the threads measured at the end of the last step; returns the count in use."""
        if self._next is not None and self._next != self.threads:
            log.info("torch threads %d -> %d (cores left idle by the other processes)",
                     self.threads, self._next)  # fmt: skip
            self._set(self._next)
            self.threads = self._next
        self._started = self._sample()
        return self.threads

    def end(self) -> None:
        if self._started is None:
            return
        measured = threads_for(self._started, self._sample(), self.cores)
        if measured is not None:
            self._next = measured
        self._started = None
