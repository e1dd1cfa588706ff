"""The gateway's per-episode MCP route: ``/episodes/<id>/mcp`` serves that episode's sandbox
tools over streamable HTTP.

An external agent with its own tool loop (Codex CLI, Claude Code, the Agents SDK) is pointed
at it (``SANDPIPER_MCP_URL``) with its built-in shell and file tools turned off
(``configs/agents/``), so every command, read and edit it makes runs in the episode's own
podman sandbox — the one the episode is graded on — through the native
:class:`~sandpiper.collector.episode.tools.Toolbox` (:class:`.mcp_server.EpisodeTools`: same
uid, limits, output cap, timeouts and argument checks as a native tool call).

Each episode that has tools gets its own MCP :class:`mcp.server.Server` and
:class:`~mcp.server.streamable_http_manager.StreamableHTTPSessionManager` (the SDK's public
API, no protocol code here), started by the first request to its route and stopped when the
episode closes (:meth:`EpisodeMCP.stop`): calls in flight are cancelled, later requests get
the gateway's 404. The SDK's DNS-rebinding check admits only loopback ``Host`` and ``Origin``
headers, as the gateway listens on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the SDK loads with the first episode that has tools
    from sandpiper.collector.gateway.mcp_server import EpisodeTools

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ["127.0.0.1:*", "localhost:*", "[::1]:*"]
LOOPBACK_ORIGINS = ["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"]


class EpisodeMCP:
    """One episode's MCP server on the gateway: created with the episode, served from the
    first request on, stopped with the episode."""

    def __init__(self, tools: EpisodeTools) -> None:
        self.tools = tools
        self._manager: Any = None
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()
        self._start_lock = asyncio.Lock()

    async def handle(self, scope: Any, receive: Any, send: Any) -> None:
        """Serve one HTTP request of the route (ASGI)."""
        await self._started()
        await self._manager.handle_request(scope, receive, send)

    async def _started(self) -> None:
        async with self._start_lock:
            if self._task is None:
                from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
                from mcp.server.transport_security import TransportSecuritySettings

                from sandpiper.collector.gateway.mcp_server import build_server

                security = TransportSecuritySettings(
                    enable_dns_rebinding_protection=True, allowed_hosts=LOOPBACK_HOSTS,
                    allowed_origins=LOOPBACK_ORIGINS,
                )  # fmt: skip
                self._manager = StreamableHTTPSessionManager(
                    app=build_server(self.tools), security_settings=security
                )
                # its run() holds the sessions' task group: a task of its own, not the
                # first request's, so it outlives that request
                self._task = asyncio.create_task(self._run())
        await self._ready.wait()
        if self._task.done():
            raise RuntimeError("the episode's MCP server is not running")

    async def _run(self) -> None:
        try:
            async with self._manager.run():
                self._ready.set()
                await self._stop.wait()
        finally:
            self._ready.set()  # a failed start: the waiting request must not hang

    async def stop(self) -> None:
        """Stop serving: open sessions and calls in flight are cancelled."""
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


class MCPEndpoint:
    """The route ``/episodes/<id>/mcp`` as an ASGI app (so the SDK's transport answers the
    request itself): the open episode's MCP server, else ``not_found(eid)``, the gateway's
    JSON 404."""

    def __init__(
        self, lookup: Callable[[str], EpisodeMCP | None], not_found: Callable[[str], Any]
    ) -> None:
        self.lookup, self.not_found = lookup, not_found

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        eid = scope["path_params"]["eid"]
        mcp = self.lookup(eid)
        if mcp is None:
            await self.not_found(eid)(scope, receive, send)
            return
        await mcp.handle(scope, receive, send)
