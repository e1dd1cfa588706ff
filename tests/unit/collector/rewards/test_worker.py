"""Answers are scored off the collector's event loop, with a hard deadline (collector.rewards.worker)."""

from __future__ import annotations

import asyncio
import time

import pytest

from sandpiper.collector.rewards import worker as scoring
from sandpiper.errors import TaskError

TOWER = "$9^{9^{9^{9}}}$"  # holds math-verify's parse for ~6 s (its own deadlines are 5 s)
MATH = {"reward": "math", "answer": "42"}


@pytest.fixture
def worker(monkeypatch):
    w = scoring.ScoringWorker(timeout_s=1.0)
    monkeypatch.setattr(scoring, "_WORKER", w)
    yield w
    w.close()


async def _score_while_ticking(reference, answer):
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    task = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    try:
        outcome = await scoring.score_answer(reference, answer=answer)
    finally:
        task.cancel()
    return outcome, ticks, time.perf_counter() - t0


def test_an_answer_past_the_deadline_scores_0_and_the_loop_keeps_running(worker):
    outcome, ticks, elapsed_s = asyncio.run(_score_while_ticking(MATH, TOWER))
    assert outcome.reward == 0.0 and outcome.breakdown["scoring_timed_out"] is True
    assert 0.9 < elapsed_s < 10
    assert ticks >= 10  # the loop ran while the worker parsed (in place it stalls ~6 s)
    again, _, _ = asyncio.run(_score_while_ticking(MATH, "42"))  # a fresh worker
    assert again.reward == 1.0 and "scoring_timed_out" not in again.breakdown


def test_the_worker_scores_like_compute_reward_and_raises_task_errors(worker):
    surrogate = "\ud800 42"
    outcome, _, _ = asyncio.run(_score_while_ticking(MATH, surrogate))
    assert outcome == scoring.compute_reward(MATH, answer=surrogate)
    with pytest.raises(TaskError, match="unknown reward kind"):
        asyncio.run(scoring.score_answer({"reward": "nonsense", "answer": "1"}, answer="1"))
    proc = worker._proc
    assert proc is not None and proc.poll() is None
    worker.close()
    assert proc.poll() is not None  # killed, not left behind


def test_cheap_kinds_never_start_a_worker(worker):
    outcome = asyncio.run(scoring.score_answer({"reward": "exact", "answer": "a"}, answer="a"))
    assert outcome.reward == 1.0 and worker._proc is None
