"""External-agent episodes: an unmodified agent program, one process per episode.

A task whose reference names ``agent_command`` (an argv list or a shell string) is run by
starting that command on the collector's host with:

- ``OPENAI_BASE_URL`` / ``OPENAI_API_BASE`` = the episode's gateway URL
  (``.../episodes/<id>/v1``), ``OPENAI_API_KEY`` = a per-episode token, ``SANDPIPER_MODEL`` =
  the model name the gateway serves (clients must send it as ``model``);
  ``ANTHROPIC_BASE_URL`` = the same URL without ``/v1`` (Anthropic clients append it) and
  ``ANTHROPIC_API_KEY`` = the token;
- ``SANDPIPER_EXEC_URL`` = ``.../episodes/<id>/exec``: the agent's commands go there and
  run in the episode's sandbox through the same ``execute_bash`` tool the native loop uses
  (same uid, caps, timeouts). The sandbox keeps ``--network none``: the agent runs outside
  it and executes inside it. ``python -m sandpiper.collector.gateway.exec_client CMD`` is a shell
  shim; :mod:`sandpiper.collector.gateway.minisweagent_env` is a mini-swe-agent environment;
- ``SANDPIPER_MCP_URL`` = ``.../episodes/<id>/mcp``: the same sandbox's tools
  (``execute_bash``, ``str_replace_editor``, ``submit``) over MCP (streamable HTTP,
  :mod:`.mcp_route`), for agents that bring their own tool loop (Codex CLI, Claude Code,
  with their built-in tools off). A ``submit`` there runs the task's tests then, as a native
  ``submit`` does; that result is the episode's grading;
- ``SANDPIPER_TASK`` = the task's instruction (also in the file ``SANDPIPER_TASK_FILE``).

The episode ends when the process exits or ``agent_timeout_s`` passes (its process group is
then killed). Its calls so far are assembled into turns (:mod:`.assembly`); the sandbox is
graded as after a ``submit`` call (the task's tests, the answer file), through the same
finishing code as a native episode, so groups, rewards, versions and records have the
native shape and the learner, analysis and report need no special case.

Stop reasons: exit status 0 → ``submitted``; a non-zero exit after at least one model call
→ ``agent_error`` (valid and graded: a harness that crashes on the model's output is the
policy's outcome); a non-zero exit before any model call → ``infra_error`` (invalid: the
agent never reached the policy); the time limit → ``time_limit`` (valid, graded); a model
call refused because the episode's turn or token budget was spent → ``max_turns`` /
``max_tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sandpiper.collector.episode.loop import ToolRunner, finish_episode, prepare_sandbox
from sandpiper.collector.episode.parsers import checked_call
from sandpiper.collector.episode.tools.base import ToolResult
from sandpiper.collector.gateway.assembly import assemble
from sandpiper.collector.gateway.server import Gateway
from sandpiper.collector.inference import lifeline
from sandpiper.collector.sandbox.base import ToolSandbox
from sandpiper.collector.tasks.model import Task
from sandpiper.config import SamplingLimits
from sandpiper.errors import SandboxError, SandpiperError, TaskError
from sandpiper.logs import file_tail
from sandpiper.store.records import INFRA_STOPS, EpisodeRecord, StopReason, ToolErrorKind, utcnow

DEFAULT_AGENT_TIMEOUT_S = 600.0
_LOG_TAIL_BYTES = 2000


def agent_command(task: Task) -> list[str] | None:
    """The task's agent command as argv, or None for a native task."""
    cmd = task.reference.agent_command
    if cmd is None:
        return None
    if isinstance(cmd, str):
        return shlex.split(cmd)
    if isinstance(cmd, Sequence) and cmd and all(isinstance(c, str) for c in cmd):
        return list(cmd)
    raise SandpiperError(f"task {task.task_id}: agent_command must be a string or a list of str")


async def run_external_episode(
    *,
    episode_id: str,
    sample_index: int,
    task: Task,
    gateway: Gateway,
    sandbox: ToolSandbox,
    toolbox: ToolRunner,
    limits: SamplingLimits,
) -> EpisodeRecord:
    """Run the task's agent command against ``sandbox`` through ``gateway``; never raises for
    data failures (they are the record's stop reason)."""
    started_at, t0 = utcnow(), time.perf_counter()
    argv = agent_command(task)
    assert argv is not None, "run_external_episode needs a task with agent_command"
    timeout_s = task.reference.agent_timeout_s or DEFAULT_AGENT_TIMEOUT_S
    stop: StopReason | None = None
    error: str | None = None
    with tempfile.TemporaryDirectory(prefix="sandpiper-agent-") as tmp:
        try:
            await prepare_sandbox(sandbox, task)
        except SandboxError as e:
            return await finish_episode(  # before the agent acted: not its doing (invalid)
                turns=(), stop=StopReason.SANDBOX_LOST, error=f"sandbox: {e}", answer=None,
                task=task, sandbox=sandbox, episode_id=episode_id, sample_index=sample_index,
                started_at=started_at, t0=t0,
            )  # fmt: skip
        except TaskError as e:  # a broken task (failing setup.sh): not the policy's doing
            return await finish_episode(
                turns=(), stop=StopReason.TASK_ERROR, error=f"task: {e}",
                answer=None, task=task, sandbox=sandbox, episode_id=episode_id,
                sample_index=sample_index, started_at=started_at, t0=t0,
            )  # fmt: skip
        except SandpiperError as e:
            return await finish_episode(
                turns=(), stop=StopReason.INFRA_ERROR, error=f"{type(e).__name__}: {e}",
                answer=None, task=task, sandbox=sandbox, episode_id=episode_id,
                sample_index=sample_index, started_at=started_at, t0=t0,
            )  # fmt: skip
        from sandpiper.collector.gateway.mcp_server import EpisodeTools

        tools = EpisodeTools(task, sandbox, toolbox, score_on_submit=False,
                             max_argument_bytes=limits.max_argument_bytes)  # fmt: skip
        url = gateway.open_episode(
            episode_id,
            exec_fn=_exec_via(toolbox, limits.max_argument_bytes),
            tools=tools,
            max_calls=limits.max_turns,
            max_completion_tokens=limits.max_episode_tokens,
        )
        env = _agent_env(task, url, gateway, episode_id, Path(tmp))
        log_path = Path(tmp) / "agent.log"
        returncode: int | None = None
        try:
            returncode = await _run_agent(argv, env, Path(tmp), log_path, timeout_s)
        except OSError as e:
            stop, error = StopReason.INFRA_ERROR, f"the agent command could not start: {e}"
        finally:
            session = gateway.close_episode(episode_id)
        await gateway.tools_closed(episode_id)  # no MCP call of the agent still runs
        await session.settle()
        turns, stats = assemble(session.calls, gateway.renderer.decode)
        if stop is None:
            stop, error = _stop_reason(returncode, len(session.calls), session, timeout_s)
            if error is not None:
                error = f"{error}; agent log tail: {file_tail(log_path, _LOG_TAIL_BYTES)}"
    grading: dict[str, Any] = {}
    if stop not in INFRA_STOPS:
        # the agent's own `submit` (MCP) ran the task's tests as a native submit does;
        # otherwise the sandbox is graded now, as it stands
        submitted = tools.submitted
        grading = _graded(submitted) if submitted is not None else await _grade(toolbox)
        if grading.get("sandbox_stop"):
            stop = grading["sandbox_stop"]
            error = f"the sandbox was {'lost' if stop is StopReason.SANDBOX_LOST else 'broken'}"
            error += " while grading"
    return await finish_episode(
        turns=turns, stop=stop, error=error, answer=grading.get("answer"), task=task,
        sandbox=sandbox, episode_id=episode_id, sample_index=sample_index,
        started_at=started_at, t0=t0, test_reward=grading.get("test_reward"),
        test_details=grading.get("test_details", {}),
        model_text="".join(c.text for c in session.calls),
        extra_breakdown={"gateway": stats.as_json()},
    )  # fmt: skip


def _stop_reason(
    returncode: int | None, n_calls: int, session: Any, timeout_s: float
) -> tuple[StopReason, str | None]:
    if session.budget_spent is not None:
        return session.budget_spent, None
    if returncode is None:
        return StopReason.TIME_LIMIT, f"the agent ran past its time limit of {timeout_s:g} s"
    if returncode == 0:
        return StopReason.SUBMITTED, None
    if n_calls == 0:
        return StopReason.INFRA_ERROR, f"the agent exited with status {returncode} before any call"
    return StopReason.AGENT_ERROR, f"the agent exited with status {returncode}"


def _agent_env(
    task: Task, url: str, gateway: Gateway, episode_id: str, tmp: Path
) -> dict[str, str]:
    task_file = tmp / "task.txt"
    task_file.write_text(task.instruction, encoding="utf-8", errors="replace")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OPENAI_", "ANTHROPIC_", "SANDPIPER_"))}  # fmt: skip
    # programs installed beside sandpiper (mini-swe-agent's `mini`, say) are found first
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    extra = task.reference.agent_env or {}
    env.update({str(k): str(v) for k, v in extra.items()})
    env.update(
        OPENAI_BASE_URL=url,
        OPENAI_API_BASE=url,
        OPENAI_API_KEY=f"sandpiper-{episode_id}",
        ANTHROPIC_BASE_URL=url.removesuffix("/v1"),
        ANTHROPIC_API_KEY=f"sandpiper-{episode_id}",
        SANDPIPER_MODEL=gateway.settings.model_names[0],
        SANDPIPER_EXEC_URL=url.removesuffix("/v1") + "/exec",
        SANDPIPER_MCP_URL=url.removesuffix("/v1") + "/mcp",
        SANDPIPER_TASK=task.instruction,
        SANDPIPER_TASK_FILE=str(task_file),
        HOME=str(tmp),
    )
    return env


async def _run_agent(
    argv: list[str], env: dict[str, str], cwd: Path, log_path: Path, timeout_s: float
) -> int | None:
    """Exit status of the agent, or None when it was killed at the time limit.

    The agent runs under a lifeline (:mod:`sandpiper.collector.inference.lifeline`) in a
    session of its own: a collector killed with SIGKILL takes it and everything it started
    along, instead of leaving an agent that keeps calling a gateway nobody serves."""
    wrapped, fds = lifeline.wrap(list(argv))
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *wrapped, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True, pass_fds=fds,
        )  # fmt: skip
        try:
            return await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            return None
        finally:
            # the agent's whole process group: children it started must not outlive it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if proc.returncode is None:
                await proc.wait()


def _exec_via(toolbox: ToolRunner, max_argument_bytes: int):
    async def run(command: str, timeout_s: float) -> dict[str, Any]:
        call = checked_call("execute_bash", {"command": command}, max_argument_bytes)
        if not call.ok:  # refused as a native call of this size is: never run
            return {"output": call.error, "returncode": -1, "timed_out": False,
                    "error_kind": str(call.error_kind)}  # fmt: skip
        result = await toolbox.call("execute_bash", {"command": command})
        return {
            "output": result.output,
            "returncode": result.exit_code if result.exit_code is not None else -1,
            "timed_out": result.timed_out,
            "error_kind": str(result.error_kind),
        }

    return run


async def _grade(toolbox: ToolRunner) -> dict[str, Any]:
    """Grade the sandbox as a native ``submit`` does (the task's tests, its answer file)."""
    return _graded(await toolbox.call("submit", {}))


def _graded(result: ToolResult) -> dict[str, Any]:
    """A ``submit`` call's result as the grading ``finish_episode`` takes."""
    if result.error_kind is ToolErrorKind.SANDBOX_LOST:
        return {"sandbox_stop": StopReason.SANDBOX_LOST}  # the host's doing: invalid
    if result.error_kind is ToolErrorKind.SANDBOX_DIED:
        return {"sandbox_stop": StopReason.SANDBOX_DIED}  # the agent's doing: graded
    return {
        "answer": result.answer,
        "test_reward": result.test_reward,
        "test_details": dict(result.test_details),
    }
