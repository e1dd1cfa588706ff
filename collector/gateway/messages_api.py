"""The Anthropic Messages API (``POST …/v1/messages``) on the gateway's chat path.

Claude Code and the ``anthropic`` SDK are given the episode's base URL *without* ``/v1``
(``ANTHROPIC_BASE_URL={gateway}/episodes/<id>``); they append ``/v1/messages`` (Claude Code
adds ``?beta=true``, which changes nothing here) and may probe the base URL with ``HEAD``.
``anthropic-version`` / ``anthropic-beta`` headers are accepted and change nothing.

A request is converted into the chat messages and tools the chat route renders (``system``
→ a system message, ``tool_use`` blocks → the assistant's tool calls, ``tool_result``
blocks → tool messages, ``input_schema`` tools → chat function tools, ``stop_sequences`` →
``stop``), sampled and recorded by :meth:`Gateway.call
<sandpiper.collector.gateway.server.Gateway.call>`, and the chat reply is converted back
into content blocks (``thinking`` for a reasoning model's ``<think>`` text, ``text``,
``tool_use``). Sent back in the next request, those blocks convert into the very chat
message the episode recorded, so the call extends it token for token (:mod:`.wire`).

Streaming sends the whole event sequence after sampling: ``message_start``, ``ping``, per
block ``content_block_start`` / ``content_block_delta`` (``text_delta``,
``input_json_delta``, ``thinking_delta`` + ``signature_delta``) / ``content_block_stop``,
``message_delta`` (``stop_reason``, usage), ``message_stop``. Errors are Anthropic error
objects (``{"type": "error", "error": {"type", "message"}}``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sandpiper.collector.gateway import openai_api as api
from sandpiper.collector.gateway import wire
from sandpiper.collector.gateway.request_params import log_request, note_ignored
from sandpiper.collector.gateway.session import template_message

ACCEPTED = frozenset(
    {
        "model", "messages", "system", "max_tokens", "tools", "tool_choice", "stop_sequences",
        "stream", "temperature", "top_p", "top_k", "metadata", "thinking", "service_tier",
    }
)  # fmt: skip
"""Fields read here; any other is accepted and logged once, as on the chat route, except:"""
REFUSED = ("container", "mcp_servers")
"""Server-side features the gateway does not have: a 400 naming them."""
RENAMED = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}
"""Chat fields whose errors name the Messages field the client sent."""
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error"}  # fmt: skip


def routes(gateway: wire.ChatPath) -> list[Route]:
    async def create(request: Request) -> Response:
        return await handle(gateway, request)

    async def count(request: Request) -> Response:
        return await count_tokens(gateway, request)

    async def probe(request: Request) -> Response:
        """``HEAD``/``GET`` of an episode's base URL: 200 while it is open."""
        eid = request.path_params["eid"]
        try:
            gateway.session(eid)
        except api.APIError as e:
            return error_response(e)
        return JSONResponse({"episode_id": eid, "open": True})

    return [
        Route("/episodes/{eid}", probe, methods=["GET", "HEAD"]),
        Route("/episodes/{eid}/v1/messages", create, methods=["POST"]),
        Route("/episodes/{eid}/v1/messages/count_tokens", count, methods=["POST"]),
    ]


async def handle(gateway: wire.ChatPath, request: Request) -> Response:
    eid = request.path_params["eid"]
    try:
        body = api.parse_body(await request.body())
        log_request(eid, request.url.path, body)
        if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
            raise api.APIError(400, "max_tokens: a positive integer is required",
                               param="max_tokens")  # fmt: skip
        payload = await gateway.call(eid, to_chat(body))
        index = wire.call_index(payload)
        recorded = gateway.session(eid).calls[index].text
    except api.APIError as e:
        return error_response(wire.renamed(e, RENAMED))
    message = to_message(body, payload, recorded)
    if body.get("stream"):
        return StreamingResponse(_stream(message), media_type="text/event-stream")
    return Response(api.encode_json(message), media_type="application/json")


async def count_tokens(gateway: wire.ChatPath, request: Request) -> Response:
    """The prompt's length as the chat template renders it from scratch (no call made)."""
    eid = request.path_params["eid"]
    try:
        body = api.parse_body(await request.body())
        gateway.session(eid)
        api.check_common({"model": body.get("model")}, gateway.settings.model_names)
        chat = to_chat(body)
        messages = [template_message(m) for m in api.check_messages(chat)]
        tools = api.check_tools(chat)
    except api.APIError as e:
        return error_response(wire.renamed(e, RENAMED))
    renderer = gateway.renderer
    ids = renderer.encode(renderer.render(messages, add_generation_prompt=True, tools=tools))
    return JSONResponse({"input_tokens": len(ids)})


def error_response(error: api.APIError) -> Response:
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status < 529 else "overloaded_error")
    body = {"type": "error", "error": {"type": kind, "message": error.message}}
    return JSONResponse(body, status_code=error.status)


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat request of a Messages request."""
    for key in REFUSED:
        if body.get(key) is not None:
            raise api.APIError(400, f"{key}: not supported by the Sandpiper gateway",
                               param=key)  # fmt: skip
    note_ignored(body, known=ACCEPTED)
    messages = _system(body.get("system"))
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise api.APIError(400, "messages: a non-empty list is required", param="messages")
    for i, message in enumerate(value):
        messages += _messages(message, f"messages.{i}")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages,
                            "max_completion_tokens": body.get("max_tokens")}  # fmt: skip
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"], parallel = chat_tool_choice(choice)
        if not parallel:
            chat["parallel_tool_calls"] = False
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    return chat


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "" or system == []:
        return []
    return [{"role": "system", "content": _text(system, "system")}]


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise api.APIError(400, f"{where}: a string or a list of text blocks is required",
                           param=where)  # fmt: skip
    texts = []
    for k, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise api.APIError(400, f"{where}.{k}: only text blocks are supported here, "
                               f"not {kind!r}", param=f"{where}.{k}")  # fmt: skip
        texts.append(str(block.get("text", "")))
    return "".join(texts)


def _messages(message: Any, where: str) -> list[dict[str, Any]]:
    """Chat messages of one Messages message (a user message with tool results becomes
    one tool message per result, then its text as a user message; a ``system`` message, which
    Claude Code 2.1 sends after its first user message, stays a system message there)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant",
                                                                     "system"):  # fmt: skip
        raise api.APIError(400, f"{where}.role: 'user', 'assistant' or 'system' is required",
                           param=f"{where}.role")  # fmt: skip
    if message["role"] == "system":
        return [{"role": "system", "content": _text(message.get("content"), f"{where}.content")}]
    content = message.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise api.APIError(400, f"{where}.content: a string or a list of blocks is required",
                           param=f"{where}.content")  # fmt: skip
    if message["role"] == "assistant":
        return [_assistant(blocks, where)]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for k, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_result":
            assert isinstance(block, dict)
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            result = block.get("content")
            out.append({"role": "tool", "tool_call_id": _tool_id(block.get("tool_use_id")),
                        "content": "" if result is None else
                        _text(result, f"{where}.content.{k}.content")})  # fmt: skip
        else:
            raise api.APIError(400, f"{where}.content.{k}: block type {kind!r} is not "
                               "supported (text, tool_result)",
                               param=f"{where}.content.{k}")  # fmt: skip
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    reasoning, text, calls = "", "", []
    for k, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text += str(block.get("text", ""))
        elif kind == "thinking":
            exact = wire.from_opaque(block.get("signature"))
            reasoning += exact or wire.rebuilt_reasoning(str(block.get("thinking", "")))
        elif kind == "tool_use":
            name, value = block.get("name"), block.get("input")
            if not isinstance(name, str) or not isinstance(value, dict):
                raise api.APIError(400, f"{where}.content.{k}: a tool_use needs a name and "
                                   "an input object", param=f"{where}.content.{k}")  # fmt: skip
            calls.append({"id": _tool_id(block.get("id")), "type": "function",
                          "function": {"name": name, "arguments": json.dumps(value)}})  # fmt: skip
        else:
            raise api.APIError(400, f"{where}.content.{k}: block type {kind!r} is not "
                               "supported (text, thinking, tool_use)",
                               param=f"{where}.content.{k}")  # fmt: skip
    content = reasoning + text
    if calls:
        return {"role": "assistant", "content": content or None, "tool_calls": calls}
    return {"role": "assistant", "content": content}


def _tool_id(value: Any) -> str:
    """The chat tool-call id of a ``tool_use`` id (the gateway's own carry a prefix)."""
    return str(value).removeprefix("toolu_")


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Messages tools (``input_schema``) as chat function tools."""
    if not isinstance(tools, list):
        raise api.APIError(400, "tools: a list is required", param="tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or kind not in (None, "custom") or not tool.get("name"):
            raise api.APIError(400, f"tools.{i}: only client tools with a name and an "
                               f"input_schema are supported, not {kind!r} (the gateway has "
                               "no server tools)", param=f"tools.{i}")  # fmt: skip
        function: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema") or {"type": "object"}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> tuple[Any, bool]:
    """(the chat ``tool_choice``, whether parallel tool use is allowed)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use"))
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice, dict) and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise api.APIError(400, f"tool_choice: invalid {choice!r} (auto, any, tool, none)",
                       param="tool_choice")  # fmt: skip


def to_message(
    body: Mapping[str, Any], payload: Mapping[str, Any], recorded: str
) -> dict[str, Any]:
    """The Messages object of a chat payload; ``recorded`` is the call's sampled text (to
    name the stop sequence that ended it)."""
    choice = payload["choices"][0]
    message = choice["message"]
    blocks: list[dict[str, Any]] = []
    raw, thought, answer = wire.split_reasoning(message.get("content") or "")
    if raw:
        blocks.append({"type": "thinking", "thinking": thought, "signature": wire.opaque(raw)})
    calls = message.get("tool_calls") or []
    if answer or not calls:
        blocks.append({"type": "text", "text": answer})
    for call in calls:
        blocks.append({"type": "tool_use", "id": "toolu_" + call["id"],
                       "name": call["function"]["name"],
                       "input": wire.arguments_object(call["function"]["arguments"])})  # fmt: skip
    stop, stop_sequence = _stop_reason(choice["finish_reason"], body, recorded)
    usage = payload["usage"]
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": payload["model"],
        "content": blocks,
        "stop_reason": stop,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def _stop_reason(finish: str, body: Mapping[str, Any], recorded: str) -> tuple[str, str | None]:
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    hits = [(recorded.find(s), s) for s in body.get("stop_sequences") or [] if s in recorded]
    if hits:
        return "stop_sequence", min(hits)[1]
    return "end_turn", None


def events(message: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The streamed form of a finished message, as Anthropic sends it."""
    usage = message["usage"]
    opening = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {**usage, "output_tokens": 0}}  # fmt: skip
    yield {"type": "message_start", "message": opening}
    yield {"type": "ping"}
    for n, block in enumerate(message["content"]):
        if block["type"] == "text":
            yield {"type": "content_block_start", "index": n,
                   "content_block": {"type": "text", "text": ""}}  # fmt: skip
            if block["text"]:
                yield _delta(n, {"type": "text_delta", "text": block["text"]})
        elif block["type"] == "tool_use":
            yield {"type": "content_block_start", "index": n,
                   "content_block": {**block, "input": {}}}  # fmt: skip
            yield _delta(n, {"type": "input_json_delta",
                             "partial_json": json.dumps(block["input"])})  # fmt: skip
        else:  # thinking
            yield {
                "type": "content_block_start",
                "index": n,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""},
            }
            yield _delta(n, {"type": "thinking_delta", "thinking": block["thinking"]})
            yield _delta(n, {"type": "signature_delta", "signature": block["signature"]})
        yield {"type": "content_block_stop", "index": n}
    yield {
        "type": "message_delta",
        "delta": {"stop_reason": message["stop_reason"],
                  "stop_sequence": message["stop_sequence"]},
        "usage": {"output_tokens": usage["output_tokens"]},
    }  # fmt: skip
    yield {"type": "message_stop"}


def _delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


async def _stream(message: Mapping[str, Any]) -> AsyncIterator[bytes]:
    for event in events(message):
        yield wire.sse(event["type"], event)
