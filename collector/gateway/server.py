"""An OpenAI-compatible server in front of the run's vLLM servers, one base URL per episode.

``Gateway`` is the Python API the collector uses (and ``sandpiper gateway`` serves
standalone). An episode is opened (:meth:`Gateway.open_episode`), its agent is given
``{gateway}/episodes/<episode_id>/v1`` as ``OPENAI_BASE_URL``, and every call it makes is
rendered with the run's chat template (:class:`sandpiper.collector.episode.render.ChatRenderer`), sent as
token ids through the run's :class:`~sandpiper.collector.inference.base.PolicyClient` (the same client,
routing and retries as the native loop), parsed with the run's tool-call parser
(:func:`sandpiper.collector.episode.parsers.parse_tool_calls`) and recorded with its prompt ids, sampled ids,
sampling logprobs and per-token policy versions (:class:`~sandpiper.collector.gateway.session.
EpisodeSession`). Closing the episode hands the calls to :mod:`sandpiper.collector.gateway.assembly`.

Routes (``/episodes/<id>/v1`` is the base URL an OpenAI client is given):

- ``POST /episodes/<id>/v1/chat/completions`` (streaming and not, ``tools``, ``tool_choice``)
- ``POST /episodes/<id>/v1/completions`` (a text prompt, no chat template)
- ``GET  /episodes/<id>/v1/models``
- ``POST /episodes/<id>/v1/responses`` — the OpenAI Responses API
  (:mod:`~sandpiper.collector.gateway.responses_api`), converted to a chat call
- ``POST /episodes/<id>/v1/messages`` (and ``/count_tokens``), ``HEAD /episodes/<id>`` — the
  Anthropic Messages API (:mod:`~sandpiper.collector.gateway.messages_api`), likewise
- any other method or path: a JSON 404 naming it and the routes served
- ``POST /episodes/<id>/exec`` — run a command in the episode's sandbox (external agents,
  see :mod:`sandpiper.collector.gateway.external`); 404 unless the episode has a sandbox.
- ``GET|POST|DELETE /episodes/<id>/mcp`` — the episode's sandbox tools over MCP (streamable
  HTTP, :mod:`~sandpiper.collector.gateway.mcp_route`); 404 unless the episode has tools.
- ``POST /episodes`` / ``POST /episodes/<id>/close`` — open / close an episode (standalone
  use; the collector calls the Python methods).

Calls of one episode are serialised (an agent is one conversation); episodes run
concurrently. The streamed form of a response is sent after the whole completion is sampled:
the gateway must parse the tool calls of the finished text before it can describe them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sandpiper.collector.episode.client_tools import client_calls
from sandpiper.collector.episode.parsers import ParsedMessage
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.gateway import messages_api, responses_api
from sandpiper.collector.gateway import openai_api as api
from sandpiper.collector.gateway.assembly import call_id
from sandpiper.collector.gateway.mcp_route import EpisodeMCP, MCPEndpoint
from sandpiper.collector.gateway.request_params import (
    RequestParams,
    chat_params,
    cut_at_stop,
    log_request,
    note_ignored,
)
from sandpiper.collector.gateway.session import BudgetSpent, EpisodeSession
from sandpiper.collector.inference.base import Generation, PolicyClient
from sandpiper.collector.inference.vllm_client import ContextLengthExceeded
from sandpiper.config import SamplingLimits
from sandpiper.config.sampling import NoRoom
from sandpiper.errors import InferenceError
from sandpiper.store.records import utcnow

if TYPE_CHECKING:
    from sandpiper.collector.gateway.mcp_server import EpisodeTools

log = logging.getLogger(__name__)

GATEWAY_MODEL_NAME = "policy"
"""The model name clients send (the run's name is accepted too)."""

KEEP_ALIVE_S = 900
"""Seconds an idle client connection stays open (longer than an agent's tool calls)."""

ExecFn = Callable[[str, float], Awaitable[dict[str, Any]]]
"""Runs a shell command in an episode's sandbox: (command, timeout_s) → result JSON."""


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """What the gateway answers to and how it samples."""

    model_names: tuple[str, ...]
    """Names a client may ask for (the first is listed by ``/models``)."""
    sampling: SamplingLimits = SamplingLimits()  # noqa: RUF009 (frozen: shared safely)
    """The run's sampling, the same object its native episodes get: action format,
    temperature and top_p (and whether a request may change them, ``gateway_sampling``),
    the per-reply and context caps, the argument byte limit."""

    @classmethod
    def for_run(cls, sampling: SamplingLimits, *, run_id: str) -> GatewaySettings:
        """A run's gateway: it samples exactly like the run's native loop."""
        return cls(model_names=(GATEWAY_MODEL_NAME, run_id), sampling=sampling)


class _Episode:
    def __init__(
        self, session: EpisodeSession, exec_fn: ExecFn | None, mcp: EpisodeMCP | None
    ) -> None:
        self.session = session
        self.exec_fn = exec_fn
        self.mcp = mcp
        """The episode's sandbox tools over MCP (``/episodes/<id>/mcp``); None: no route."""
        self.lock = asyncio.Lock()


class Gateway:
    """The gateway's state and ASGI app; :meth:`serve` runs it on the current event loop."""

    def __init__(
        self, *, client: PolicyClient, renderer: ChatRenderer, settings: GatewaySettings
    ) -> None:
        self.client, self.renderer, self.settings = client, renderer, settings
        self._episodes: dict[str, _Episode] = {}
        self._closing: dict[str, asyncio.Future] = {}
        """Closed episodes' MCP servers still stopping."""
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self.url = ""
        """``http://host:port`` once serving."""
        self.app = Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/episodes", self._open, methods=["POST"]),
                Route("/episodes/{eid}/close", self._close, methods=["POST"]),
                Route("/episodes/{eid}/exec", self._exec, methods=["POST"]),
                Route(
                    "/episodes/{eid}/mcp",
                    MCPEndpoint(self._episode_mcp, _not_found),
                    methods=["GET", "POST", "DELETE"],
                ),
                Route("/episodes/{eid}/v1/models", self._models, methods=["GET"]),
                Route("/episodes/{eid}/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/episodes/{eid}/v1/completions", self._completions, methods=["POST"]),
                *responses_api.routes(self),
                *messages_api.routes(self),
            ],
            exception_handlers={404: self._unknown_route, 405: self._unknown_route},
        )

    # ---- Python API -------------------------------------------------------------------

    def open_episode(
        self,
        episode_id: str,
        *,
        exec_fn: ExecFn | None = None,
        tools: EpisodeTools | None = None,
        max_calls: int | None = None,
        max_completion_tokens: int | None = None,
    ) -> str:
        """Start recording ``episode_id``; returns its OpenAI base URL. Calls past
        ``max_calls`` or ``max_completion_tokens`` sampled tokens are refused (HTTP 400,
        code ``episode_budget_exhausted``) and set the session's ``budget_spent``.
        ``tools``: the episode's sandbox tools, served over MCP at :meth:`mcp_url`."""
        if episode_id in self._episodes:
            raise ValueError(f"episode {episode_id} is already open")
        session = EpisodeSession(episode_id, self.renderer)
        session.max_calls, session.max_completion_tokens = max_calls, max_completion_tokens
        mcp = EpisodeMCP(tools) if tools is not None else None
        self._episodes[episode_id] = _Episode(session, exec_fn, mcp)
        return self.episode_url(episode_id)

    def close_episode(self, episode_id: str) -> EpisodeSession:
        """Stop serving ``episode_id`` (later calls get 404) and return its recorded calls.
        Its MCP server stops too (:meth:`tools_closed` waits for that)."""
        episode = self._episodes.pop(episode_id)
        if episode.mcp is not None:
            self._closing[episode_id] = asyncio.ensure_future(episode.mcp.stop())
        return episode.session

    async def tools_closed(self, episode_id: str) -> None:
        """Once a closed episode's MCP server has stopped: no tool call of it is still
        running (the episode can be graded)."""
        closing = self._closing.pop(episode_id, None)
        if closing is not None:
            await closing

    def _episode_mcp(self, episode_id: str) -> EpisodeMCP | None:
        episode = self._episodes.get(episode_id)
        return None if episode is None else episode.mcp

    def mcp_url(self, episode_id: str) -> str:
        """The episode's MCP endpoint (streamable HTTP)."""
        return f"{self.url}/episodes/{episode_id}/mcp"

    def episode_url(self, episode_id: str) -> str:
        return f"{self.url}/episodes/{episode_id}/v1"

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: a free port) in this event loop; returns the URL."""
        import uvicorn

        # An agent keeps its connection between calls while its tools run; uvicorn's default
        # 5 s keep-alive closes it meanwhile, and a client that reuses it just as it closes
        # gets a connection error (seen as httpx.ReadError in bench/gateway_bench.py).
        config = uvicorn.Config(
            self.app, host=host, port=port, log_level="warning", access_log=False,
            lifespan="off", timeout_keep_alive=KEEP_ALIVE_S,
        )  # fmt: skip
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the start-up error
                raise RuntimeError("the gateway server stopped during start-up")
            await asyncio.sleep(0.01)
        sock = self._server.servers[0].sockets[0]
        bound_host, bound_port = sock.getsockname()[:2]
        self.url = f"http://{bound_host}:{bound_port}"
        log.info("gateway serving at %s", self.url)
        return self.url

    async def aclose(self) -> None:
        for eid in list(self._closing):
            await self.tools_closed(eid)
        if self._server is not None:
            self._server.should_exit = True
            if self._task is not None:
                await self._task
            self._server = None

    # ---- routes -----------------------------------------------------------------------

    async def _unknown_route(self, request: Request, exc: Exception) -> Response:
        """No route for this method and path: a JSON error naming the supported ones."""
        supported = [f"{' '.join(sorted(r.methods or ()))} {r.path}" for r in self.app.routes
                     if isinstance(r, Route)]  # fmt: skip
        log.debug("gateway: no route %s %s", request.method, request.url.path)
        err = api.APIError(
            404, f"no route {request.method} {request.url.path} on this gateway; it serves: "
            + "; ".join(supported), code="unknown_route",
        )  # fmt: skip
        return JSONResponse(err.body(), status_code=404)

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"ok": True, "episodes": len(self._episodes)})

    async def _open(self, request: Request) -> Response:
        try:
            body = api.parse_body(await request.body() or b"{}")
        except api.APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        episode_id = str(body.get("episode_id") or uuid.uuid4().hex)
        if episode_id in self._episodes:
            err = api.APIError(409, f"episode {episode_id} is already open", code="conflict")
            return JSONResponse(err.body(), status_code=409)
        return JSONResponse({"episode_id": episode_id, "base_url": self.open_episode(episode_id)})

    async def _close(self, request: Request) -> Response:
        eid = request.path_params["eid"]
        if eid not in self._episodes:
            return _not_found(eid)
        session = self.close_episode(eid)
        await session.settle()
        return JSONResponse({"episode_id": eid, "calls": [_call_json(c) for c in session.calls]})

    async def _models(self, request: Request) -> Response:
        if request.path_params["eid"] not in self._episodes:
            return _not_found(request.path_params["eid"])
        data = [{"id": n, "object": "model", "owned_by": "sandpiper"} for n in
                self.settings.model_names]  # fmt: skip
        return JSONResponse({"object": "list", "data": data})

    async def _exec(self, request: Request) -> Response:
        episode = self._episodes.get(request.path_params["eid"])
        if episode is None or episode.exec_fn is None:
            return _not_found(request.path_params["eid"])
        try:
            body = api.parse_body(await request.body())
            command = body.get("command")
            if not isinstance(command, str):
                raise api.APIError(400, "command must be a string", param="command")
            timeout_s = float(body.get("timeout_s") or 30.0)
        except (api.APIError, ValueError) as e:
            err = e if isinstance(e, api.APIError) else api.APIError(400, str(e))
            return JSONResponse(err.body(), status_code=err.status)
        return JSONResponse(await episode.exec_fn(command, timeout_s))

    async def _chat(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def _handle(self, request: Request, *, chat: bool) -> Response:
        eid = request.path_params["eid"]
        if eid not in self._episodes:
            return _not_found(eid)
        try:
            body = api.parse_body(await request.body())
            log_request(eid, request.url.path, body)
            payload = await self.call(eid, body, chat=chat)
        except api.APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        if body.get("stream"):
            assert chat or payload["object"] == "text_completion"
            return StreamingResponse(_sse(payload, body, chat), media_type="text/event-stream")
        return Response(api.encode_json(payload), media_type="application/json")

    def session(self, eid: str) -> EpisodeSession:
        """The open episode ``eid``'s session (APIError 404 when there is none)."""
        episode = self._episodes.get(eid)
        if episode is None:
            raise _not_found_error(eid)
        return episode.session

    async def call(self, eid: str, body: dict[str, Any], *, chat: bool = True) -> dict[str, Any]:
        """One chat (or completions) request of episode ``eid`` → its response payload.

        The Responses and Messages APIs convert their requests into chat requests and come
        here, so every API shares the renderer, parser, sampler and assembly."""
        episode = self._episodes.get(eid)
        if episode is None:
            raise _not_found_error(eid)
        api.check_common(body, self.settings.model_names)
        note_ignored(body, known=api.KNOWN)
        params = chat_params(body, completions=not chat)
        params.check(self.settings.sampling)
        async with episode.lock:
            if chat:
                return await self._chat_call(episode.session, body, params)
            return await self._completion_call(episode.session, body, params)

    async def _chat_call(
        self, session: EpisodeSession, body: dict[str, Any], params: RequestParams
    ) -> dict[str, Any]:
        messages = api.check_messages(body)
        tools = api.check_tools(body)
        prompt, extends, delta, reason, check = session.chat_prompt(messages, tools)
        generation, started, model_ms = await self._generate(session, prompt, params)
        generation, stop_at = cut_at_stop(generation, params.stop, self.renderer.decode)
        text = self.renderer.decode(generation.token_ids_T.tolist())
        visible = self.renderer.strip_eos(text) if stop_at is None else text[:stop_at]
        if tools:  # calls to tools the client did not declare are the model's errors
            parsed = client_calls(
                visible, self.settings.sampling.tool_format, tools,
                parallel=params.parallel_tool_calls,
                max_argument_bytes=self.settings.sampling.max_argument_bytes,
            )  # fmt: skip
        else:
            parsed = ParsedMessage(content=visible, tool_calls=())
        index = len(session.calls)
        good = [(i, c) for i, c in enumerate(parsed.tool_calls) if c.ok]
        message: dict[str, Any] = {"role": "assistant"}
        if good:
            # Malformed blocks stay visible to the agent as text, like a native observation.
            message["content"] = (visible if len(good) < len(parsed.tool_calls)
                                  else parsed.content) or None  # fmt: skip
            message["tool_calls"] = [
                {"id": call_id(index, i), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments_json}}
                for i, c in good
            ]  # fmt: skip
        else:
            message["content"] = visible
        finish = _finish_reason(generation.finish_reason, bool(good))
        call = session.record(
            endpoint="chat", prompt_ids=prompt, extends=extends, delta_ids=delta,
            restart_reason=reason, retokenized_differs=False, generation=generation,
            text=text, tool_calls=parsed.tool_calls, started_at=started,
            duration_ms=model_ms, messages=messages, returned=message,
        )  # fmt: skip
        if check is not None:  # the re-tokenization check runs when the episode closes
            session.check_later(call, check)
        return api.chat_response(
            response_id=f"chatcmpl-{session.episode_id[:12]}-{index}",
            model=body["model"],
            message=message,
            finish_reason=finish,
            prompt_tokens=len(prompt),
            completion_tokens=len(generation.token_ids_T),
            logprobs=api.chat_logprobs(generation, self.renderer.decode)
            if params.logprobs
            else None,
        )

    async def _completion_call(
        self, session: EpisodeSession, body: dict[str, Any], params: RequestParams
    ) -> dict[str, Any]:
        prompt_in = body.get("prompt")
        if isinstance(prompt_in, str):
            prompt = self.renderer.encode(prompt_in)
        elif (
            isinstance(prompt_in, list)
            and prompt_in
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_in)
        ):
            prompt = [int(t) for t in prompt_in]
        else:
            raise api.APIError(
                400, "prompt must be a string or a list of token ids (one prompt per call)",
                param="prompt",
            )  # fmt: skip
        previous = session.calls[-1] if session.calls else None
        extends = previous is not None and _extends(prompt, previous)
        delta = prompt[len(previous.prompt_ids) + len(previous.generation.token_ids_T) :] if (
            extends and previous is not None) else []  # fmt: skip
        reason = None if previous is None or extends else "the prompt does not extend the last"
        generation, started, model_ms = await self._generate(session, prompt, params)
        generation, stop_at = cut_at_stop(generation, params.stop, self.renderer.decode)
        text = self.renderer.decode(generation.token_ids_T.tolist())
        session.record(
            endpoint="completions", prompt_ids=prompt, extends=extends, delta_ids=delta,
            restart_reason=reason, retokenized_differs=False, generation=generation, text=text,
            tool_calls=(), started_at=started, duration_ms=model_ms,
            messages=None, returned=None,
        )  # fmt: skip
        return api.completion_response(
            response_id=f"cmpl-{session.episode_id[:12]}-{len(session.calls) - 1}",
            model=body["model"],
            text=self.renderer.strip_eos(text) if stop_at is None else text[:stop_at],
            finish_reason="length" if generation.finish_reason == "length" else "stop",
            prompt_tokens=len(prompt),
            completion_tokens=len(generation.token_ids_T),
            logprobs=api.completion_logprobs(generation, self.renderer.decode)
            if params.logprobs
            else None,
        )

    async def _generate(
        self, session: EpisodeSession, prompt: list[int], request: RequestParams
    ) -> tuple[Generation, datetime, float]:
        """(generation, when the model call started, its duration in ms): the time of the
        client's ``generate`` alone, recorded as the call's ``duration_ms``. ``request``:
        the client's sampling fields, already checked against the run's policy. The reply's
        cap is the run's one formula (``SamplingLimits.reply_request``); a call with no room
        left is refused (HTTP 400) before the model is asked."""
        sampling = self.settings.sampling
        try:
            session.check_turns()
        except BudgetSpent as e:
            raise api.APIError(400, str(e), code="episode_budget_exhausted") from e
        reply = sampling.reply_request(
            prompt_tokens=len(prompt), sampled_tokens=session.completion_tokens,
            episode_budget=session.max_completion_tokens, max_tokens=request.max_tokens,
            temperature=request.temperature, top_p=request.top_p, seed=request.seed,
        )  # fmt: skip
        if isinstance(reply, NoRoom) and reply.reason == "context_exceeded":
            raise _context_error(len(prompt), reply.limit)
        if isinstance(reply, NoRoom):
            spent = session.tokens_spent()
            raise api.APIError(400, str(spent), code="episode_budget_exhausted") from spent
        params = request.sampling_params(reply, stop_token_ids=self.renderer.stop_token_ids)
        started, t0 = utcnow(), time.perf_counter()
        try:
            generation = await self.client.generate(prompt, params)
        except ContextLengthExceeded as e:
            raise _context_error(len(prompt), sampling.context_limit) from e
        except InferenceError as e:
            raise api.APIError(
                503, f"the inference server failed: {e}", code="upstream_error"
            ) from e
        model_ms = (time.perf_counter() - t0) * 1000
        if generation.finish_reason == "abort" or len(generation.token_ids_T) == 0:
            raise api.APIError(503, "the inference server aborted the request",
                               code="upstream_error")  # fmt: skip
        return generation, started, model_ms


def _extends(prompt: Sequence[int], previous: Any) -> bool:
    context = [*previous.prompt_ids, *(int(t) for t in previous.generation.token_ids_T)]
    return len(prompt) > len(context) and list(prompt[: len(context)]) == context


def _finish_reason(server_reason: str, has_calls: bool) -> str:
    if server_reason == "length":
        return "length"
    return "tool_calls" if has_calls else "stop"


def _context_error(n_prompt: int, limit: int) -> api.APIError:
    return api.APIError(
        400,
        f"This model's maximum context length is {limit} tokens. However, your messages "
        f"resulted in {n_prompt} tokens. Please reduce the length of the messages.",
        param="messages",
        code="context_length_exceeded",
    )


def _not_found_error(eid: str) -> api.APIError:
    return api.APIError(
        404, f"no open episode {eid!r} on this gateway (closed, or never opened)",
        code="episode_not_found",
    )  # fmt: skip


def _not_found(eid: str) -> Response:
    err = _not_found_error(eid)
    return JSONResponse(err.body(), status_code=404)


async def _sse(payload: dict[str, Any], body: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    if chat:
        choice = payload["choices"][0]
        chunks = api.chat_chunks(
            response_id=payload["id"],
            model=payload["model"],
            message=choice["message"],
            finish_reason=choice["finish_reason"],
            prompt_tokens=payload["usage"]["prompt_tokens"],
            completion_tokens=payload["usage"]["completion_tokens"],
            include_usage=include_usage,
            logprobs=choice.get("logprobs"),
        )
    else:
        chunks = [{**payload, "usage": payload["usage"] if include_usage else None}]
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _call_json(call: Any) -> dict[str, Any]:
    g = call.generation
    return {
        "index": call.index,
        "endpoint": call.endpoint,
        "prompt_ids": list(call.prompt_ids),
        "extends": call.extends,
        "restart_reason": call.restart_reason,
        "retokenized_differs": call.retokenized_differs,
        "token_ids": [int(t) for t in g.token_ids_T],
        "logprobs": [float(x) for x in g.logprobs_T],
        "policy_versions": [int(v) for v in g.policy_versions_T],
        "finish_reason": g.finish_reason,
        "text": call.text,
    }
