"""The episode loop: one agent, one task, one sandbox — for training and evaluation alike.

``run_episode`` opens a session with the policy (:mod:`sandpiper.collector.episode.policy`: token ids in and
out for training, a chat API for evaluation), then alternates a reply of the policy and the
execution of its tool calls (through a toolbox bound to the episode's sandbox, results
appended as a non-trainable ``tool`` turn). It stops on ``submit``, a reply without tool
calls, max turns, the episode token budget or the context limit.

Failures are data, and no model output ends anything but its own episode. Malformed tool
calls (bad JSON, lone surrogates, non-finite numbers, deep nesting, oversized arguments),
calls to tools that were not offered and every usage error of a tool become error
observations the agent sees, and the episode goes on.

Outcome classes (docs/security.md, "Robustness and outcome classes"). An episode is
**invalid** (``reward=None``, excluded from training, never a 0 that would bias the
advantage) only for failures the agent could not cause:

- ``sandbox_lost``: the container is gone or stopped without an OOM kill (the host removed
  or killed it; the agent, an unprivileged uid, cannot stop init), or the sandbox failed
  before the agent acted (``setup.sh`` killed, the pool's container unusable);
- ``model_error``: the inference server failed;
- ``task_error``: the task is broken (failing ``setup.sh``, missing test script or image, a
  reward it cannot score);
- ``infra_error``: anything else outside the policy, including a **bug of the collector**: an
  unexpected exception inside one episode is logged with its traceback and recorded as that
  episode's error (``collector bug: ...``); the daemon goes on.

Everything the agent's own commands do to its sandbox is the **policy's outcome, graded**
like any other stop: ``sandbox_died`` (its shell cannot be restarted while the container
runs: pids or memory exhausted, an OOM kill of the container) gets the reward of what it
left (0 for a task graded by tests, or the task's penalty) — otherwise a policy would learn
to escape its penalties by breaking its sandbox. A ``submit`` whose tests time out is 0.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from sandpiper.collector.episode.parsers import ParsedToolCall, submission_answer, system_prompt_for
from sandpiper.collector.episode.policy import Policy, PolicySession, Stopped
from sandpiper.collector.episode.tools.base import ToolResult
from sandpiper.collector.rewards.worker import score_answer
from sandpiper.collector.sandbox.base import ExecOutcome, SandboxSource, ToolSandbox
from sandpiper.collector.tasks.model import DEFAULT_TESTS_DEST, Task
from sandpiper.config import SamplingLimits
from sandpiper.errors import SandboxError, SandboxLostError, SandpiperError, TaskError
from sandpiper.store.records import (
    INFRA_STOPS,
    EpisodeRecord,
    StopReason,
    ToolCallRecord,
    ToolErrorKind,
    TurnRecord,
    utcnow,
)

log = logging.getLogger(__name__)

MAX_ANSWER_FILE_BYTES = 64 * 1024
"""An answer file is read up to this many bytes."""
SYSTEM_PROMPT = (
    "You are an agent working in a Linux sandbox. Use the tools to inspect and change files "
    "in /workspace and to run commands. When you are done, call `submit` (with your final "
    "answer as `answer` when the task asks for one)."
)


class ToolRunner(Protocol):
    """What the loop needs from a toolbox (``collector.episode.tools.Toolbox`` implements it)."""

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult: ...


ToolboxFactory = Callable[[ToolSandbox, Task], ToolRunner]
EpisodeFn = Callable[..., Awaitable[EpisodeRecord]]
"""Runs one episode in a sandbox it is given (keywords: episode_id, sample_index, task,
sandbox, toolbox, limits)."""


@dataclass(slots=True)
class _State:
    """Mutable bookkeeping of one running episode."""

    turns: list[TurnRecord] = field(default_factory=list)
    answer: str | None = None
    submitted_answer: bool = False
    """True when ``submit`` carried an answer (it then wins over the answer file)."""
    test_reward: float | None = None
    test_details: dict[str, Any] = field(default_factory=dict)
    model_text: list[str] = field(default_factory=list)
    stop: StopReason | None = None
    error: str | None = None
    episode_id: str = ""


def default_toolbox_factory(
    *, exec_timeout_s: float, test_timeout_s: float
) -> ToolboxFactory:  # pragma: no cover - thin wiring around the tools package
    def make(sandbox: ToolSandbox, task: Task) -> ToolRunner:
        from sandpiper.collector.episode.tools import Toolbox

        return Toolbox(
            sandbox,
            tests_dir=task.tests_dir,
            test_command=task.resolved_test_command,
            result_format=task.result_format,
            tests_see_agent_processes=task.tests_see_agent_processes,
            subject_command=task.subject_command,
            tests_dest=task.tests_dest if task.tests_dest != DEFAULT_TESTS_DEST else None,
            reward_file=task.reward_file,
            tests_import_workspace=task.format == "open_instruct",
            test_timeout_s=test_timeout_s,
            exec_timeout_s=exec_timeout_s,
        )

    return make


async def prepare_sandbox(sandbox: ToolSandbox, task: Task, *, timeout_s: float = 300.0) -> None:
    """Copy the task's seed files to their destination and run its setup script there."""
    if task.files_dir is not None:
        await sandbox.copy_in(task.files_dir, task.files_dest)
    if task.setup_script is not None:
        await sandbox.write_file("/tmp/sandpiper_setup.sh", task.setup_script.read_bytes())
        result = await sandbox.exec(
            "bash /tmp/sandpiper_setup.sh", timeout_s=timeout_s, cwd="/workspace"
        )
        if result.outcome in (ExecOutcome.SANDBOX_DIED, ExecOutcome.SANDBOX_LOST):
            # before the agent acted: whatever broke it, it was not this policy
            raise SandboxLostError(f"the sandbox died running setup.sh of task {task.task_id}")
        if not result.ok:  # a broken task, not the policy's fault: the episode is invalid
            raise TaskError(
                f"setup.sh of task {task.task_id} failed ({result.outcome}, exit "
                f"{result.exit_code}): {result.stderr[-500:]}"
            )


async def run_episode(
    *,
    episode_id: str,
    sample_index: int,
    task: Task,
    policy: Policy,
    sandbox: ToolSandbox,
    toolbox: ToolRunner,
    limits: SamplingLimits,
) -> EpisodeRecord:
    """Run one episode to its end and return its record (never raises for data failures).

    Training (:class:`sandpiper.collector.episode.policy.TokenPolicy`) and evaluation
    (:class:`sandpiper.collector.episode.chat_policy.ChatPolicy`) both run here: the prompt, the offered tools,
    the answer file, the error handling and the reward are the same by construction."""
    started_at, t0 = utcnow(), time.perf_counter()
    messages = [
        {
            "role": "system",
            "content": task.system_prompt
            or system_prompt_for(limits.tool_format, limits.system_prompt or SYSTEM_PROMPT),
        },
        {"role": "user", "content": task.instruction},
    ]
    state = _State(episode_id=episode_id)
    trainable = True
    acting = False  # True once the agent's turns run: a broken sandbox is then its outcome
    try:
        session = policy.session(messages, limits)
        trainable = session.trainable
        state.turns.append(session.prompt_turn(started_at))
        task.check()
        await prepare_sandbox(sandbox, task)
        offered = {t["function"]["name"] for t in policy.tools}
        acting = True
        await _loop(state, session, toolbox, limits, offered)
        if state.stop not in INFRA_STOPS:
            await _read_answer_file(state, task, sandbox)
    except TaskError as e:  # the task is broken, not the policy: invalid, never a 0
        state.stop, state.error = StopReason.TASK_ERROR, f"task: {e}"
    except SandboxError as e:
        state.stop, state.error = sandbox_stop(e, acting), f"sandbox: {e}"
    except SandpiperError as e:
        state.stop, state.error = StopReason.INFRA_ERROR, f"{type(e).__name__}: {e}"
    except Exception as e:  # a bug of ours: visible (traceback, error), never a dead daemon
        state.stop, state.error = StopReason.INFRA_ERROR, collector_bug(episode_id, e)
    return await _finish(state, episode_id, sample_index, task, sandbox, started_at, t0, trainable)


def sandbox_stop(error: SandboxError, acting: bool) -> StopReason:
    """``sandbox_lost`` (invalid) when the container was lost or the sandbox failed before
    the agent acted; ``sandbox_died`` (graded) when the agent's own commands broke it."""
    if isinstance(error, SandboxLostError) or not acting:
        return StopReason.SANDBOX_LOST
    return StopReason.SANDBOX_DIED


def collector_bug(episode_id: str, error: BaseException) -> str:
    """Log an unexpected exception of one episode with its traceback; the episode's error."""
    log.error("episode %s: unexpected %s (a collector bug)", episode_id,
              type(error).__name__, exc_info=error)  # fmt: skip
    return f"collector bug: {type(error).__name__}: {str(error)[:1000]}"


async def run_pooled_episode(
    pool: SandboxSource,
    *,
    episode_id: str,
    sample_index: int,
    task: Task,
    policy: Policy,
    make_toolbox: ToolboxFactory,
    limits: SamplingLimits,
    run: EpisodeFn | None = None,
) -> EpisodeRecord:
    """Take a sandbox for ``task`` from ``pool``, run the episode, give the sandbox back.

    ``run`` replaces :func:`run_episode` (called with the same keywords but ``policy``): an
    external agent's episode (``collector.gateway.external``) takes its sandbox this way.

    A sandbox that cannot be had is one invalid episode: ``task_error`` when the task's own
    image is missing, ``infra_error`` otherwise (never an abort of the run). Any exception
    of the episode itself (``run``, the toolbox) becomes its record (``infra_error``,
    ``collector bug: ...``, logged with its traceback) and its sandbox is replaced; only a
    pool that fails in an unexpected way (a bug that would fail every episode) propagates."""
    started = utcnow()
    try:
        sandbox = await pool.acquire(episode_id=episode_id, task_id=task.task_id, image=task.image)
    except TaskError as e:
        return failed_episode(
            episode_id, sample_index, started, StopReason.TASK_ERROR, f"task: {e}"
        )
    except SandboxError as e:
        return failed_episode(
            episode_id, sample_index, started, StopReason.INFRA_ERROR, f"no sandbox: {e}"
        )
    broken = True
    run = run or functools.partial(run_episode, policy=policy)
    try:
        episode = await run(
            episode_id=episode_id,
            sample_index=sample_index,
            task=task,
            sandbox=sandbox,
            toolbox=make_toolbox(sandbox, task),
            limits=limits,
        )
        broken = episode.stop_reason in _REPLACE_SANDBOX
        return episode
    except Exception as e:  # one episode's failure stays that episode's outcome
        return failed_episode(episode_id, sample_index, started, StopReason.INFRA_ERROR,
                              collector_bug(episode_id, e), _sandbox_id(sandbox))  # fmt: skip
    finally:
        await pool.release(sandbox, broken=broken)


_REPLACE_SANDBOX = frozenset(
    {StopReason.SANDBOX_DIED, StopReason.SANDBOX_LOST, StopReason.INFRA_ERROR}
)
"""Stops after which the container is replaced rather than reset (its state is unknown)."""


def failed_episode(
    episode_id: str,
    index: int,
    started: datetime,
    stop: StopReason,
    error: str,
    sandbox_id: str | None = None,
) -> EpisodeRecord:
    """An invalid episode that never reached the model (no sandbox, missing image)."""
    return EpisodeRecord(
        episode_id=episode_id,
        sample_index=index,
        stop_reason=stop,
        valid=False,
        trainable=True,
        reward=None,
        reward_breakdown={},
        turns=(),
        started_at=started,
        duration_ms=(utcnow() - started).total_seconds() * 1000,
        sandbox_id=sandbox_id,
        error=error,
    )


async def _loop(
    state: _State,
    session: PolicySession,
    toolbox: ToolRunner,
    limits: SamplingLimits,
    offered: set[str],
) -> None:
    for _ in range(limits.max_turns):
        gen_at, gen_t0 = utcnow(), time.perf_counter()
        reply = await session.reply()
        if isinstance(reply, Stopped):
            state.stop, state.error = reply.stop, reply.error
            return
        timing = (gen_at, (time.perf_counter() - gen_t0) * 1000)
        state.model_text.append(reply.text)
        index = len(state.turns)
        if reply.truncated is not None:
            state.turns.append(session.assistant_turn(index, reply, (), timing))
            state.stop = reply.truncated
            return
        if not reply.tool_calls:
            state.turns.append(session.assistant_turn(index, reply, (), timing))
            state.answer, state.stop = reply.content, StopReason.NO_TOOL_CALL
            return
        t_tools = time.perf_counter()
        records, tool_messages = await _run_tools(
            state,
            reply.tool_calls,
            toolbox,
            offered,
            bash_block=limits.tool_format == "bash_block",
        )
        tools_ms = (time.perf_counter() - t_tools) * 1000
        state.turns.append(session.assistant_turn(index, reply, records, timing))
        if state.stop is not None:
            return
        state.turns.append(
            session.add_tool_results(len(state.turns), tool_messages, utcnow(), tools_ms)
        )
    state.stop = StopReason.MAX_TURNS


async def _run_tools(
    state: _State,
    calls: Sequence[ParsedToolCall],
    toolbox: ToolRunner,
    offered: set[str] | None = None,
    *,
    bash_block: bool = False,
) -> tuple[list[ToolCallRecord], list[dict[str, Any]]]:
    """Run the calls in order; stop after ``submit`` or a dead sandbox.

    ``offered`` is the set of tool names rendered into the prompt (None = all): calling any
    other tool is an ``unknown_tool`` error observation, even if the toolbox has it.
    A ``TaskError`` from a tool (the task's tests are broken) propagates: invalid episode.
    With ``bash_block`` a command whose output starts with the submit sentinel is followed by
    a ``submit`` call with the rest of its output as the answer (mini-swe-agent's protocol)."""
    records: list[ToolCallRecord] = []
    messages: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        if call.ok and offered is not None and call.name not in offered:
            result = ToolResult(
                output=f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(offered))}",
                error_kind=ToolErrorKind.UNKNOWN_TOOL,
            )
        elif call.ok:
            assert call.arguments is not None
            try:
                result = await toolbox.call(call.name, call.arguments)
            except SandboxError as e:
                lost = isinstance(e, SandboxLostError)
                kind = ToolErrorKind.SANDBOX_LOST if lost else ToolErrorKind.SANDBOX_DIED
                result = ToolResult(output=str(e), error_kind=kind)
            except SandpiperError:
                raise  # a broken task (TaskError): the episode's outcome, decided above
            except Exception as e:  # a bug of ours: this call's turn is kept, then it ends
                state.stop, state.error = StopReason.INFRA_ERROR, collector_bug(state.episode_id, e)
                records.append(tool_record(index, call, ToolResult("", ToolErrorKind.TOOL_ERROR)))
                break
        else:
            result = ToolResult(output=call.error or "Error", error_kind=call.error_kind)
        if bash_block and call.name == "execute_bash" and result.error_kind is ToolErrorKind.NONE:
            answer = submission_answer(result.output)
            if answer is not None:
                call = ParsedToolCall("submit", {"answer": answer}, call.arguments_json)
                result = await toolbox.call("submit", {"answer": answer} if answer else {})
        records.append(tool_record(index, call, result))
        messages.append(
            {
                "role": "tool",
                "name": call.name,
                "content": result.output,
                "exit_code": result.exit_code,
            }
        )
        if result.error_kind in _SANDBOX_STOPS:
            # The sampled turn and this call are still stored (by the caller) before stopping.
            state.stop = _SANDBOX_STOPS[result.error_kind]
            state.error = f"sandbox {state.stop.removeprefix('sandbox_')} during {call.name}: "
            state.error += result.output[-300:]
            break
        if result.submitted:
            state.stop = StopReason.SUBMITTED
            state.submitted_answer = result.answer is not None
            state.answer, state.test_reward = result.answer, result.test_reward
            state.test_details = dict(result.test_details)
            break
    return records, messages


_SANDBOX_STOPS = {
    ToolErrorKind.SANDBOX_DIED: StopReason.SANDBOX_DIED,
    ToolErrorKind.SANDBOX_LOST: StopReason.SANDBOX_LOST,
}


async def _read_answer_file(state: _State, task: Task, sandbox: ToolSandbox) -> None:
    """Tasks whose answer is a file (LLM-in-Sandbox: ``answer.txt``) read it at the end of
    every valid episode, as the peer does; an answer passed to ``submit`` wins. It is read
    with the agent's own rights (a link to /etc/passwd reads what the agent could read) and
    never through the agent's shell (its PATH could hold a fake ``cat``)."""
    path = task.reference.answer_file
    if not path or state.submitted_answer:
        return
    try:
        data = await sandbox.read_file(path, limit=MAX_ANSWER_FILE_BYTES)
    except OSError:
        return  # no answer file (or not a file): the policy's outcome, scored as no answer
    state.answer = data[:MAX_ANSWER_FILE_BYTES].decode("utf-8", "replace").strip()


def tool_record(index: int, call: ParsedToolCall, result: ToolResult) -> ToolCallRecord:
    return ToolCallRecord(
        index=index,
        name=call.name,
        arguments_json=call.arguments_json,
        output=result.output,
        output_bytes_total=result.output_bytes_total or len(result.output.encode()),
        exit_code=result.exit_code,
        duration_ms=result.duration_ms,
        timed_out=result.timed_out,
        error_kind=result.error_kind,
    )


async def _finish(
    state: _State,
    episode_id: str,
    sample_index: int,
    task: Task,
    sandbox: ToolSandbox,
    started_at: datetime,
    t0: float,
    trainable: bool,
) -> EpisodeRecord:
    stop = state.stop or StopReason.INFRA_ERROR
    reward, breakdown, error = None, {}, state.error
    if stop not in INFRA_STOPS:
        try:
            outcome = await score_answer(
                task.reference,
                answer=state.answer,
                test_reward=state.test_reward,
                test_details=state.test_details,
                model_text="".join(state.model_text),
            )
            reward, breakdown = outcome.reward, outcome.breakdown
        except TaskError as e:  # e.g. a reward kind this version cannot score
            stop, error = StopReason.TASK_ERROR, f"task: {e}"
    return EpisodeRecord(
        episode_id=episode_id,
        sample_index=sample_index,
        stop_reason=stop,
        valid=stop not in INFRA_STOPS,
        trainable=trainable,
        reward=reward,
        reward_breakdown=breakdown,
        turns=tuple(state.turns),
        started_at=started_at,
        duration_ms=(time.perf_counter() - t0) * 1000,
        sandbox_id=_sandbox_id(sandbox),
        error=error,
    )


def _sandbox_id(sandbox: ToolSandbox) -> str | None:
    try:
        return sandbox.id
    except Exception:  # a dead sandbox may not know its id any more
        return None


async def finish_episode(
    *,
    turns: Sequence[TurnRecord],
    stop: StopReason,
    error: str | None,
    task: Task,
    sandbox: ToolSandbox,
    episode_id: str,
    sample_index: int,
    started_at: datetime,
    t0: float,
    answer: str | None = None,
    test_reward: float | None = None,
    test_details: dict[str, Any] | None = None,
    model_text: str = "",
    extra_breakdown: dict[str, Any] | None = None,
) -> EpisodeRecord:
    """The record of an episode whose turns were produced elsewhere (an external agent
    through the gateway), scored exactly as :func:`run_episode` scores its own: the answer
    file, the test reward and the task's reward function."""
    state = _State(turns=list(turns), stop=stop, error=error, answer=answer)
    state.submitted_answer = answer is not None
    state.test_reward, state.test_details = test_reward, dict(test_details or {})
    state.model_text = [model_text]
    if stop not in INFRA_STOPS:
        try:
            await _read_answer_file(state, task, sandbox)
        except SandboxError as e:
            state.stop, state.error = sandbox_stop(e, acting=True), f"sandbox: {e}"
    record = await _finish(state, episode_id, sample_index, task, sandbox, started_at, t0, True)
    if extra_breakdown:
        breakdown = {**record.reward_breakdown, **extra_breakdown}
        record = dataclasses.replace(record, reward_breakdown=breakdown)
    return record
