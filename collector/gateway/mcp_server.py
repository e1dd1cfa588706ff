"""``sandpiper sandbox mcp``: one episode's sandbox tools served over the Model Context Protocol.

Any MCP-capable agent (Codex CLI, Claude Code, the OpenAI Agents SDK, ...) then acts on a
task's podman sandbox without Sandpiper knowing its code. The tools are the native loop's
own: :class:`~sandpiper.collector.episode.tools.Toolbox` (``execute_bash``,
``str_replace_editor``, ``submit``) with the schemas the model is shown
(:data:`~sandpiper.collector.episode.tools.schemas.TOOL_SCHEMAS`), so a call runs with the same
uid, limits, output cap and timeouts as a native tool call. The sandbox is prepared as a native
episode's is (the task's files, its ``setup.sh``), and ``submit`` is scored as a native episode
is (:func:`~sandpiper.collector.episode.loop.finish_episode`: the task's tests, its answer file,
its reward function); the tool result names the reward.

Built on the official ``mcp`` SDK's low-level :class:`mcp.server.Server` (our JSON schemas,
not ones derived from Python signatures), served on stdio or streamable HTTP. Logs go to
stderr: on stdio, stdout is the transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mcp_types as types
from mcp.server import Server

from sandpiper.collector.episode.loop import ToolRunner, finish_episode, prepare_sandbox
from sandpiper.collector.episode.parsers import checked_call
from sandpiper.collector.episode.tools.base import ToolResult
from sandpiper.collector.episode.tools.schemas import TOOL_SCHEMAS, offered_schemas
from sandpiper.collector.sandbox.base import ToolSandbox
from sandpiper.collector.tasks.model import Task
from sandpiper.config import SandboxConfig
from sandpiper.store.records import StopReason, ToolErrorKind, utcnow
from sandpiper.version import code_version

log = logging.getLogger(__name__)

SERVER_NAME = "sandpiper-sandbox"
MCP_PATH = "/mcp"
"""The streamable-HTTP endpoint's path (the SDK's default)."""
DEFAULT_MAX_ARGUMENT_BYTES = 65_536
"""``collector.max_argument_bytes``' default."""
TOOL_NAMES = tuple(s["function"]["name"] for s in TOOL_SCHEMAS)
STOP_GRACE_S = 1.0
"""After a signal: how long the transport may take to stop before the sandbox is removed."""


@dataclass(frozen=True, slots=True)
class Submission:
    """What ``submit`` left: the answer and the task's reward for it."""

    answer: str | None
    reward: float | None
    """The task's reward (None: the task could not be scored, see ``error``)."""
    breakdown: dict[str, Any]
    error: str | None = None


class EpisodeTools:
    """One episode's tools behind MCP: the toolbox, then ``submit`` scored like a native
    episode. After ``submit`` the episode is over and every further call is refused.

    ``score_on_submit=False`` (a collector episode served on the gateway's MCP route,
    :mod:`.mcp_route`): ``submit`` runs the task's tests as the native tool does and keeps
    its result in :attr:`submitted`; the episode's own finishing code
    (:func:`~sandpiper.collector.gateway.external.run_external_episode`) grades it once the
    agent exits, through the same ``finish_episode`` as a native episode."""

    def __init__(
        self,
        task: Task,
        sandbox: ToolSandbox,
        toolbox: ToolRunner,
        *,
        offered: Sequence[str] = TOOL_NAMES,
        descriptions: str = "full",
        max_argument_bytes: int = DEFAULT_MAX_ARGUMENT_BYTES,
        score_on_submit: bool = True,
    ) -> None:
        self.task, self.sandbox, self.toolbox = task, sandbox, toolbox
        self.score_on_submit = score_on_submit
        self.max_argument_bytes = max_argument_bytes
        """``collector.max_argument_bytes``: larger calls are refused, as native ones are."""
        self.schemas = offered_schemas(offered, descriptions)
        """What a native episode offers (``collector.tools``, ``collector.tool_descriptions``)."""
        self.episode_id = uuid.uuid4().hex
        self.submission: Submission | None = None
        """What ``submit`` left, scored (``score_on_submit``)."""
        self.submitted: ToolResult | None = None
        """The ``submit`` call's own result (its answer and test outcome); None until then."""
        self._started_at, self._t0 = utcnow(), time.perf_counter()
        self._lock = asyncio.Lock()
        """One call at a time: the sandbox's shell and the editor's undo history are one."""

    def tools(self) -> list[types.Tool]:
        """The offered tools' native schemas as MCP tools."""
        return [
            types.Tool(
                name=s["function"]["name"],
                description=s["function"]["description"],
                input_schema=s["function"]["parameters"],
            )
            for s in self.schemas
        ]

    async def call(self, name: str, arguments: dict[str, Any] | None) -> types.CallToolResult:
        async with self._lock:
            if self.submitted is not None:
                return _text("Error: the episode was already submitted.", error=True)
            offered = [s["function"]["name"] for s in self.schemas]
            if name not in offered:  # as the native loop answers a tool it did not offer
                return _text(f"Error: unknown tool {name!r}; available: {', '.join(offered)}",
                             error=True)  # fmt: skip
            call = checked_call(name, arguments or {}, self.max_argument_bytes)
            if not call.ok or call.arguments is None:  # too large, too deep, not Unicode
                return _text(call.error or "Error: the arguments cannot be used.", error=True)
            result = await self.toolbox.call(name, call.arguments)
            if not result.submitted:
                return _text(result.output, error=result.error_kind is not ToolErrorKind.NONE)
            self.submitted = result
            if not self.score_on_submit:  # graded by the episode's own finish, later
                return _text("Submitted: the episode is over.", error=False)
            self.submission = await self._score(result)
            return _text(_submitted_text(self.submission), error=self.submission.reward is None)

    async def _score(self, result: ToolResult) -> Submission:
        record = await finish_episode(
            turns=(), stop=StopReason.SUBMITTED, error=None, task=self.task,
            sandbox=self.sandbox, episode_id=self.episode_id, sample_index=0,
            started_at=self._started_at, t0=self._t0, answer=result.answer,
            test_reward=result.test_reward, test_details=result.test_details,
        )  # fmt: skip
        log.info("task %s submitted: reward %s", self.task.task_id, record.reward)
        return Submission(result.answer, record.reward, dict(record.reward_breakdown),
                          record.error)  # fmt: skip


def _submitted_text(s: Submission) -> str:
    if s.reward is None:
        return f"Submitted; the task could not be scored: {s.error or 'no reward'}"
    return f"Submitted. Reward: {s.reward:g}"


def _text(text: str, *, error: bool) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                is_error=error)  # fmt: skip


def build_server(tools: EpisodeTools) -> Server:
    """The MCP server of one episode's tools."""

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools.tools())

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        return await tools.call(params.name, params.arguments)

    return Server(
        SERVER_NAME,
        version=code_version().removeprefix("sandpiper "),
        instructions=f"The sandbox of task {tools.task.task_id}: {tools.task.instruction}",
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def serve_stdio(server: Server) -> None:
    """Serve on this process's stdin/stdout until stdin ends."""
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


async def serve_http(server: Server, host: str, port: int) -> None:
    """Serve streamable HTTP on ``http://host:port/mcp`` until cancelled."""
    import uvicorn

    app = server.streamable_http_app(host=host, streamable_http_path=MCP_PATH)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    http = uvicorn.Server(config)
    task = asyncio.create_task(http.serve())
    try:
        while not http.started and not task.done():
            await asyncio.sleep(0.05)
        if http.started:
            bound = http.servers[0].sockets[0].getsockname()[1]
            log.info("MCP server at http://%s:%d%s", host, bound, MCP_PATH)
        await asyncio.shield(task)
    except asyncio.CancelledError:
        http.should_exit = True  # a graceful stop: a cancelled uvicorn logs tracebacks
        with contextlib.suppress(Exception):
            await task
        raise


async def serve_task(
    sandbox_config: SandboxConfig,
    task: Task,
    *,
    test_timeout_s: float,
    http: tuple[str, int] | None,
    labels: dict[str, str],
    stop: asyncio.Event,
    offered: Sequence[str] = TOOL_NAMES,
    descriptions: str = "full",
    max_argument_bytes: int = DEFAULT_MAX_ARGUMENT_BYTES,
) -> Submission | None:
    """Start a sandbox for ``task``, prepare it, serve its tools (stdio, or streamable HTTP
    on ``http``) until the transport ends (stdin's end) or ``stop`` is set (a signal), then
    remove the container. Returns what ``submit`` left (None when nothing was submitted)."""
    from sandpiper.collector.episode.loop import default_toolbox_factory
    from sandpiper.collector.sandbox.pool import SandboxPool

    config = sandbox_config.model_copy(
        update={"image": task.image or sandbox_config.image, "pool_size": 1}
    )
    pool = SandboxPool(config, labels=labels)
    tools: EpisodeTools | None = None
    guard: asyncio.subprocess.Process | None = None
    try:
        if not (await _until(stop, pool.start()))[0]:
            return None
        done, box = await _until(stop, pool.acquire(episode_id="mcp", task_id=task.task_id))
        if not done:
            return None
        log.info("sandbox %s started for task %s", box.id, task.task_id)
        guard = await start_guard(["podman", "rm", "-f", "-t", "0", "--ignore", box.id])
        task.check()
        await prepare_sandbox(box, task)
        toolbox = default_toolbox_factory(
            exec_timeout_s=config.exec_timeout_s, test_timeout_s=test_timeout_s
        )(box, task)
        tools = EpisodeTools(task, box, toolbox, offered=offered, descriptions=descriptions,
                             max_argument_bytes=max_argument_bytes)  # fmt: skip
        server = build_server(tools)
        await _until(stop, serve_http(server, *http) if http else serve_stdio(server))
        return tools.submission
    finally:
        begun = time.perf_counter()
        await pool.close()  # removes every container of this pool, idle or in use
        log.info("sandbox removed (%.1f s)", time.perf_counter() - begun)
        if guard is not None:  # nothing left to guard: it exits without a podman call
            guard.kill()
            await guard.wait()


GUARD = (
    "import subprocess, sys\n"
    "if sys.stdin.buffer.read() == b'':\n"  # end of file: the server died, however
    "    subprocess.run(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,"
    " stderr=subprocess.DEVNULL)\n"
)
"""The guard's program: wait for its stdin's end, then run its arguments."""


async def start_guard(argv: list[str]) -> asyncio.subprocess.Process:
    """A process that runs ``argv`` (the container's removal) once this one dies, however it
    dies: ``kill -9`` included, which skips every ``finally``. It waits on a pipe whose write
    end only this process holds (not inherited: close-on-exec), in a session of its own, so
    the process-group signal an MCP client sends its server (the SDK's stdio client: SIGTERM,
    then SIGKILL, to the group) does not reach it. Killed on a normal exit."""
    import sys

    return await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-c", GUARD, *argv,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


async def _until(stop: asyncio.Event, coro: Any) -> tuple[bool, Any]:
    """``(True, await coro)``, or ``(False, None)`` once ``stop`` is set (``coro`` is then
    cancelled, or never started). Its exceptions propagate."""
    if stop.is_set():
        coro.close()
        return False, None
    work = asyncio.ensure_future(coro)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not work.done():
        work.cancel()
        # stdio's reader is a thread blocked on stdin that no cancellation reaches: give
        # the transport a moment, then go on (the caller exits without waiting for it)
        await asyncio.wait({work}, timeout=STOP_GRACE_S)
        return False, None
    return True, work.result()
