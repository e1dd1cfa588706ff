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

The same worker runs the kinds whose scorer is someone else's code: a reasoning-gym
dataset's ``score_answer`` and your own function (``python:MODULE:FUNCTION``). Their
exceptions and non-finite results are ``TaskError`` s: one invalid episode with the error's
last line. The worker's address space is capped at ``SCORING_MEMORY_MB`` (an answer that
makes a scorer allocate without bound fails that answer, not the host), and while a
reasoning-gym scorer reads an answer an audit hook (:func:`_guard`) refuses opening files,
starting processes, sockets and new imports, because some of those scorers evaluate the
answer as Python (docs/security.md, "Scorers that evaluate the answer").

The cheap kinds (``tests``, ``exact``, ``strict``, ``choice``, ``none``) are scored in place. A worker that is not
needed is never started; it is killed at exit, and ends on EOF when the collector dies
without cleaning up.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import resource
import select
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import IO, Any

from sandpiper.collector.rewards.compute import RewardOutcome, compute_reward
from sandpiper.collector.rewards.reference import (
    ReasoningGymReference,
    TaskReference,
    parse_reference,
)
from sandpiper.errors import TaskError

log = logging.getLogger(__name__)

SCORING_TIMEOUT_S = 15.0
"""Hard deadline for one answer (math-verify's own deadlines are 5 s to parse each side and
5 s to compare)."""
STARTUP_TIMEOUT_S = 120.0
"""A new worker imports sympy before it takes answers; on a loaded machine that is slow."""
IN_PLACE_KINDS = frozenset({"tests", "exact", "strict", "choice", "none"})
"""Reward kinds that never parse the agent's text with a symbolic library or others' code."""
SCORING_MEMORY_MB = 4096
"""Address-space limit of the worker (``RLIMIT_AS``): sympy, numpy and reasoning-gym loaded
take about 1 GiB of it."""
GUARDED_EVENTS = frozenset({
    "open", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "subprocess.Popen", "pty.spawn", "socket.connect", "socket.bind", "socket.sendto",
    "socket.getaddrinfo", "ctypes.dlopen", "ctypes.cdata", "import", "os.remove", "os.rename",
    "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.kill", "os.killpg", "os.listdir",
    "os.scandir", "os.truncate", "shutil.rmtree", "shutil.copyfile", "glob.glob", "urllib.Request",
    "sys.addaudithook", "os.putenv", "os.unsetenv", "os.chdir", "os.link", "os.symlink",
})  # fmt: skip
"""Audit events refused while a reasoning-gym scorer reads an answer (PEP 578)."""
_GUARD = {"on": False}


def _refuse(event: str, args: tuple[Any, ...]) -> None:
    if _GUARD["on"] and event in GUARDED_EVENTS:
        raise PermissionError(f"{event} refused while scoring an answer")


@contextmanager
def _guard() -> Iterator[None]:
    _GUARD["on"] = True
    try:
        yield
    finally:
        _GUARD["on"] = False


def _score_line(kwargs: dict[str, Any]) -> RewardOutcome:
    """One request: ``{"warm": reference}`` (build a reasoning-gym item and load what its
    scorer loads, no answer involved) or ``compute_reward`` keywords."""
    if "warm" in kwargs:
        from sandpiper.collector.rewards import reasoning_gym_scores

        ref = parse_reference(kwargs["warm"])
        if isinstance(ref, ReasoningGymReference):
            try:
                reasoning_gym_scores.warm(ref)
            except Exception as e:
                raise TaskError(f"reasoning-gym {ref.dataset}: cannot build item {ref.index} "
                                f"with config {ref.config}: {type(e).__name__}: {e}") from None  # fmt: skip
        return RewardOutcome(0.0)
    ref = parse_reference(kwargs.pop("reference"))
    if not isinstance(ref, ReasoningGymReference):
        return compute_reward(ref, **kwargs)
    from sandpiper.collector.rewards import reasoning_gym_scores

    reasoning_gym_scores.warm(ref)  # a no-op after the warm request
    with _guard():
        return compute_reward(ref, **kwargs)


def _limit_memory() -> None:  # in the worker, before exec
    limit = SCORING_MEMORY_MB * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def serve(stdin: IO[str], stdout: IO[str]) -> None:
    """The worker's loop: one JSON line of ``compute_reward`` keywords in, one JSON line out
    (``[status, value]``; JSON keeps lone surrogates as escapes both ways). The symbolic
    libraries are imported before the first line, so no answer's deadline pays for them."""
    import math_verify  # noqa: F401  (sympy and its parsers: ~2 s of imports)

    sys.addaudithook(_refuse)
    stdout.write("ready\n")
    stdout.flush()
    for line in stdin:
        try:
            outcome = _score_line(json.loads(line))
            result: list[Any] = ["ok", outcome.reward, outcome.breakdown]
        except TaskError as e:
            result = ["task_error", str(e)]
        except MemoryError:  # the answer made the scorer allocate past the limit: graded
            result = ["memory", "scoring ran out of memory"]
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
                preexec_fn=_limit_memory,
            )
            assert self._proc.stdout is not None
            ready, _, _ = select.select([self._proc.stdout], [], [], STARTUP_TIMEOUT_S)
            if not ready or self._proc.stdout.readline() != "ready\n":
                self.close()
                raise RuntimeError("the scoring worker did not start")
        return self._proc

    def score(self, kwargs: dict[str, Any], timeout_s: float | None = None) -> RewardOutcome:
        """Score one request; past ``timeout_s`` (default: the worker's) the worker is
        killed and :class:`ScoringTimeoutError` raised."""
        deadline_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            proc = self._running()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(kwargs, default=str) + "\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], deadline_s)
                line = proc.stdout.readline() if ready else None
            except OSError as e:  # the worker died (OOM, killed): started anew next time
                self.close()
                raise AnswerKilledWorkerError(f"the scoring worker died: {e}") from e
            if line is None:
                self.close()
                raise ScoringTimeoutError(f"scoring took more than {deadline_s:.0f} s")
            if not line:
                self.close()
                raise AnswerKilledWorkerError("the scoring worker died")
        status, *value = json.loads(line)
        if status == "task_error":
            raise TaskError(value[0])
        if status == "memory":
            raise AnswerKilledWorkerError(value[0])
        if status == "error":
            raise TaskError(f"scoring failed: {value[0]}")  # a scorer bug: this episode only
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
    if isinstance(ref, ReasoningGymReference):  # imports and item built outside the deadline
        try:
            await asyncio.to_thread(_WORKER.score, {"warm": ref.as_dict()}, STARTUP_TIMEOUT_S)
        except (ScoringTimeoutError, AnswerKilledWorkerError) as e:  # no answer involved
            raise TaskError(f"reasoning-gym {ref.dataset}: the item could not be built: {e}") from e
    try:
        return await asyncio.to_thread(_WORKER.score, {"reference": ref.as_dict(), **kwargs})
    except (ScoringTimeoutError, AnswerKilledWorkerError) as e:  # the answer's doing: graded
        log.warning("%s; the answer scores 0", e)
        flag = "scoring_timed_out" if isinstance(e, ScoringTimeoutError) else "scoring_failed"
        return RewardOutcome(0.0, {"kind": kind, "answered": True, flag: True})


if __name__ == "__main__":
    serve(sys.stdin, sys.stdout)
