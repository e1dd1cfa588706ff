"""Scoring an episode's answer without letting the answer stall the collector.

The math and LLM-in-Sandbox rewards parse the agent's text with sympy (through math-verify).
A hostile answer such as ``$9^{9^{9^{9}}}$`` holds that parse for about 6 s, until
math-verify's own SIGALRM deadlines stop it — on the collector's event loop that stalls every
episode in flight (and in a thread those deadlines never fire). So those kinds are scored in
one long-lived worker process:

- the event loop waits in a thread, never on the parse itself (the worker is
  ``python -m sandpiper.collector.rewards.worker``, JSON lines over its pipes);
- the worker's main thread runs math-verify, so its own deadlines apply there;
- past ``SCORING_TIMEOUT_S`` the worker is killed (and started again for the next answer) and
  the answer scores 0, with ``scoring_timed_out`` in the breakdown (``scoring_failed`` when the
  answer killed the worker): it is the policy's answer that could not be judged, a graded
  outcome, never an invalid episode. A worker that cannot start is the collector's failure.

The cheap kinds (``tests``, ``exact``, ``none``) are scored in place. A worker that is not
needed is never started; it is killed at exit, and ends on EOF when the collector dies
without cleaning up.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import select
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import IO, Any

from sandpiper.collector.rewards.compute import RewardOutcome, compute_reward
from sandpiper.collector.rewards.reference import TaskReference, parse_reference
from sandpiper.errors import TaskError

log = logging.getLogger(__name__)

SCORING_TIMEOUT_S = 15.0
"""Hard deadline for one answer (math-verify's own deadlines are 5 s to parse each side and
5 s to compare)."""
STARTUP_TIMEOUT_S = 120.0
"""A new worker imports sympy before it takes answers; on a loaded machine that is slow."""
IN_PLACE_KINDS = frozenset({"tests", "exact", "none"})
"""Reward kinds that never parse the agent's text with a symbolic library."""


def serve(stdin: IO[str], stdout: IO[str]) -> None:
    """The worker's loop: one JSON line of ``compute_reward`` keywords in, one JSON line out
    (``[status, value]``; JSON keeps lone surrogates as escapes both ways). The symbolic
    libraries are imported before the first line, so no answer's deadline pays for them."""
    import math_verify  # noqa: F401  (sympy and its parsers: ~2 s of imports)

    stdout.write("ready\n")
    stdout.flush()
    for line in stdin:
        try:
            outcome = compute_reward(**json.loads(line))
            result: list[Any] = ["ok", outcome.reward, outcome.breakdown]
        except TaskError as e:
            result = ["task_error", str(e)]
        except Exception as e:  # a scorer bug: reported to the collector, worker stays up
            result = ["error", f"{type(e).__name__}: {e}"]
        stdout.write(json.dumps(result, default=str) + "\n")
        stdout.flush()


class ScoringTimeoutError(TimeoutError):
    """An answer took longer than ``SCORING_TIMEOUT_S`` to score."""


class AnswerKilledWorkerError(RuntimeError):
    """The worker died while it scored an answer (a parse that ran it out of memory)."""


class ScoringWorker:
    """One worker process (``python -m sandpiper.collector.rewards.worker``); ``score`` blocks and is
    serialised, so call it from a thread."""

    def __init__(self, timeout_s: float = SCORING_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None

    def _running(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "sandpiper.collector.rewards.worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                encoding="utf-8",
            )
            assert self._proc.stdout is not None
            ready, _, _ = select.select([self._proc.stdout], [], [], STARTUP_TIMEOUT_S)
            if not ready or self._proc.stdout.readline() != "ready\n":
                self.close()
                raise RuntimeError("the scoring worker did not start")
        return self._proc

    def score(self, kwargs: dict[str, Any]) -> RewardOutcome:
        with self._lock:
            proc = self._running()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(kwargs, default=str) + "\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
                line = proc.stdout.readline() if ready else None
            except OSError as e:  # the worker died (OOM, killed): started anew next time
                self.close()
                raise AnswerKilledWorkerError(f"the scoring worker died: {e}") from e
            if line is None:
                self.close()
                raise ScoringTimeoutError(f"scoring took more than {self.timeout_s:.0f} s")
            if not line:
                self.close()
                raise AnswerKilledWorkerError("the scoring worker died")
        status, *value = json.loads(line)
        if status == "task_error":
            raise TaskError(value[0])
        if status == "error":
            raise RuntimeError(f"scoring failed: {value[0]}")
        return RewardOutcome(float(value[0]), value[1])

    def close(self) -> None:
        """Stop the worker (it is started again on the next ``score``)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._proc = None


_WORKER = ScoringWorker()
atexit.register(_WORKER.close)


async def score_answer(
    reference: TaskReference | Mapping[str, Any], **kwargs: Any
) -> RewardOutcome:
    """``compute_reward(reference, **kwargs)`` without blocking the event loop on the answer
    (see the module docstring); raises ``TaskError`` as ``compute_reward`` does."""
    default = "tests" if kwargs.get("test_reward") is not None else "exact"
    ref = parse_reference(reference, default_kind=default)
    kind = ref.reward
    if kind in IN_PLACE_KINDS:
        return compute_reward(ref, **kwargs)
    try:
        return await asyncio.to_thread(_WORKER.score, {"reference": ref.as_dict(), **kwargs})
    except (ScoringTimeoutError, AnswerKilledWorkerError) as e:  # the answer's doing: graded
        log.warning("%s; the answer scores 0", e)
        flag = "scoring_timed_out" if isinstance(e, ScoringTimeoutError) else "scoring_failed"
        return RewardOutcome(0.0, {"kind": kind, "answered": True, flag: True})


if __name__ == "__main__":
    serve(sys.stdin, sys.stdout)
