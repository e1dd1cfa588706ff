"""The OpenAI Responses API (``POST …/v1/responses``) on the gateway's chat path.

A request is converted into the chat messages and tools the chat route renders (input items
→ messages, ``instructions`` → a system message, flat function tools → chat tools), sampled
and recorded by :meth:`Gateway.call <sandpiper.collector.gateway.server.Gateway.call>`, and
the chat reply is converted back into output items (a ``reasoning`` item for a reasoning
model's ``<think>`` text, a ``message`` with ``output_text``, a ``function_call`` per tool
call). Sent back as input, those items convert into the very chat message the episode
recorded, so the next call extends it token for token (see :mod:`.wire` for reasoning).

- ``input``: a string or items: messages (``user``/``system``/``developer``/``assistant``,
  text parts), ``function_call``, ``function_call_output``, ``reasoning``. Other item types
  (images, files, built-in tool calls, ``item_reference``) get a 400 naming them.
- ``previous_response_id``: a response of the same episode stored with ``store`` (default
  true); its conversation (without its ``instructions``, as OpenAI does) comes before
  ``input``. Responses live as long as their episode.
- ``tools``: function tools only; ``tool_choice`` ``auto``/``none``/``required``/a named
  function (as the chat route treats them). ``include``: ``reasoning.encrypted_content``
  (the reasoning's exact text, opaque to the client) and ``message.output_text.logprobs``
  (with ``top_logprobs``: every sampled token's logprob, as vLLM sampled it) are honoured;
  others are a 400.
- Streaming sends the whole event sequence after sampling (like the chat route):
  ``response.created``, ``response.in_progress``, per item ``response.output_item.added``,
  its content part or argument events, ``response.output_item.done``, then
  ``response.completed`` (or ``response.incomplete`` at ``max_output_tokens``) with usage.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sandpiper.collector.gateway import openai_api as api
from sandpiper.collector.gateway import wire
from sandpiper.collector.gateway.request_params import log_request, note_ignored

PASSED = ("temperature", "top_p", "parallel_tool_calls")
"""Request fields passed to the chat path as they are (it honours or refuses them)."""
ACCEPTED = frozenset(
    {
        "model", "input", "instructions", "tools", "tool_choice", "max_output_tokens",
        "stream", "store", "previous_response_id", "include", "reasoning", "text",
        "truncation", "metadata", "user", "service_tier", "prompt_cache_key",
        "safety_identifier", "stream_options", "background", "top_logprobs", *PASSED,
    }
)  # fmt: skip
"""Fields read here; any other is accepted and logged once, as on the chat route, except:"""
REFUSED = ("conversation", "prompt", "max_tool_calls")
"""Fields the gateway cannot honour (server-side conversations, stored prompts, a cap on
built-in tool calls): a 400 naming them when present and not null."""
RENAMED = {"max_completion_tokens": "max_output_tokens", "messages": "input",
           "logprobs": "include"}  # fmt: skip
"""Chat fields whose errors name the Responses field the client sent."""
LOGPROBS = "message.output_text.logprobs"
INCLUDES = frozenset({"reasoning.encrypted_content", LOGPROBS})
"""``include`` values the gateway honours."""
_STATE = "responses"
"""Key of this API's state in the session's ``api_state``."""


def routes(gateway: wire.ChatPath) -> list[Route]:
    async def create(request: Request) -> Response:
        return await handle(gateway, request)

    return [Route("/episodes/{eid}/v1/responses", create, methods=["POST"])]


class _State:
    """One episode's stored responses and reasoning prefixes (they live with the episode)."""

    def __init__(self) -> None:
        self.conversations: dict[str, list[dict[str, Any]]] = {}
        """Response id → its chat messages (input and reply, without ``instructions``)."""
        self.reasoning: dict[str, str] = {}
        """Reasoning item id → the exact reasoning prefix of its message."""


async def handle(gateway: wire.ChatPath, request: Request) -> Response:
    eid = request.path_params["eid"]
    try:
        body = api.parse_body(await request.body())
        log_request(eid, request.url.path, body)
        state = gateway.session(eid).api_state.setdefault(_STATE, _State())
        chat_body, history = to_chat(body, state)
        payload = await gateway.call(eid, chat_body)
    except api.APIError as e:
        e = wire.renamed(e, RENAMED)
        return JSONResponse(e.body(), status_code=e.status)
    message = payload["choices"][0]["message"]
    response = to_response(body, payload, state)
    if body.get("store", True) is not False:
        state.conversations[response["id"]] = [*history, message]
    if body.get("stream"):
        return StreamingResponse(_stream(response), media_type="text/event-stream")
    return Response(api.encode_json(response), media_type="application/json")


def to_chat(body: Mapping[str, Any], state: _State) -> tuple[dict[str, Any], list[dict]]:
    """(the chat request, the conversation to store with the reply: without instructions)."""
    for key in REFUSED:
        if body.get(key) is not None:
            raise _invalid(key, f"the parameter {key!r} is not supported by the Sandpiper "
                           "gateway", code="unsupported_parameter")  # fmt: skip
    note_ignored(body, known=ACCEPTED)
    _check_options(body)
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if previous not in state.conversations:
            raise api.APIError(
                400, f"Previous response with id '{previous}' not found (responses live "
                "as long as their episode, and only with store=true)",
                param="previous_response_id", code="previous_response_not_found",
            )  # fmt: skip
        history = list(state.conversations[previous])
    history += input_messages(body.get("input"), state)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _invalid("instructions", "instructions must be a string")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict[str, Any] = {"model": body.get("model"), "messages": [*messages, *history]}
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if LOGPROBS in (body.get("include") or []):
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs")
    elif body.get("top_logprobs"):
        raise _invalid("top_logprobs", f"top_logprobs needs include=[{LOGPROBS!r}]")
    for key in PASSED:
        if body.get(key) is not None:
            chat[key] = body[key]
    return chat, history


def _check_options(body: Mapping[str, Any]) -> None:
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise _invalid("include", "include must be a list of strings")
    for value in include:
        if value not in INCLUDES:
            raise _invalid(
                "include", f"include value {value!r} is not supported by the Sandpiper "
                f"gateway (it serves no built-in tools, images or logprobs here); "
                f"supported: {', '.join(sorted(INCLUDES))}", code="unsupported_parameter",
            )  # fmt: skip
    if body.get("background"):
        raise _invalid("background", "background responses are not supported")
    if body.get("truncation") not in (None, "disabled"):
        raise _invalid("truncation", "only truncation='disabled' is supported: the gateway "
                       "never drops history (the context limit is an error)")  # fmt: skip
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _invalid("text.format", "only text output is supported (no JSON schema "
                       "enforcement: the model samples freely)")  # fmt: skip


def input_messages(value: Any, state: _State) -> list[dict[str, Any]]:
    """Chat messages of a Responses ``input`` (consecutive assistant items — reasoning, an
    assistant message, function calls — are one assistant message, as the reply was)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if value is None:
        return []
    if not isinstance(value, list):
        raise _invalid("input", "input must be a string or a list of items")
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being gathered

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            content = turn["reasoning"] + turn["text"]
            message: dict[str, Any] = {"role": "assistant", "content": content or None}
            if turn["calls"]:
                message["tool_calls"] = turn["calls"]
            else:
                message["content"] = content
            out.append(message)
        turn = None

    def gathering(starts_turn: bool) -> dict[str, Any]:
        nonlocal turn
        if turn is not None and starts_turn and (turn["text"] or turn["calls"]):
            flush()
        if turn is None:
            turn = {"reasoning": "", "text": "", "calls": []}
        return turn

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _invalid(where, f"{where} must be an object")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                gathering(starts_turn=True)["text"] += text
            elif role in ("user", "system", "developer"):
                flush()
                out.append({"role": "user" if role == "user" else "system", "content": text})
            else:
                raise _invalid(f"{where}.role", f"{where} has no valid role")
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", where), "type": "function",
                    "function": {"name": _str(item, "name", where),
                                 "arguments": _str(item, "arguments", where)}}  # fmt: skip
            gathering(starts_turn=False)["calls"].append(call)
        elif kind == "function_call_output":
            flush()
            output = _text(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", where),
                        "content": output})  # fmt: skip
        elif kind == "reasoning":
            gathering(starts_turn=True)["reasoning"] += _reasoning_prefix(item, state)
        else:
            raise _invalid(where, f"{where}: input items of type {kind!r} are not supported "
                           "(message, function_call, function_call_output, reasoning)")  # fmt: skip
    flush()
    return out


def _reasoning_prefix(item: Mapping[str, Any], state: _State) -> str:
    exact = state.reasoning.get(str(item.get("id")))
    if exact is None:
        exact = wire.from_opaque(item.get("encrypted_content"))
    if exact is not None:
        return exact
    parts = item.get("content") or item.get("summary") or []
    text = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
    return wire.rebuilt_reasoning(text)


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(where, f"{where} must be a string or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise _invalid(where, f"{where}: only text parts are supported, not {kind!r}")
    return "".join(texts)


def _str(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _invalid(f"{where}.{key}", f"{where}.{key} must be a string")
    return value


HOSTED_TOOLS = frozenset(
    {
        "web_search", "web_search_preview", "file_search", "code_interpreter",
        "image_generation", "computer_use_preview", "mcp", "local_shell",
    }
)  # fmt: skip
"""Tools OpenAI's servers run (or a model calls natively): the gateway has none, so they are
left out of the prompt (logged once) rather than refused: Codex declares ``web_search``."""


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Flat Responses function tools as chat tools (what the chat template renders); the
    function tools of a ``namespace`` (Codex groups its sub-agent tools so) are flattened."""
    if not isinstance(tools, list):
        raise _invalid("tools", "tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in HOSTED_TOOLS:
            note_ignored([f"tools[type={kind}]"], known=())
            continue
        if kind == "namespace" and isinstance(tool, dict):
            out += chat_tools(tool.get("tools") or [])
            continue
        if not isinstance(tool, dict) or kind != "function" or not tool.get("name"):
            raise _invalid(f"tools[{i}]", f"tools[{i}]: only function tools with a name are "
                           f"supported (got type {kind!r})")  # fmt: skip
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def tool_namespaces(tools: Any) -> dict[str, str]:
    """Function name → the ``namespace`` tool it was declared in (flattened by
    :func:`chat_tools`): a call of it is answered with that ``namespace``, which is how Codex
    routes a call to its MCP server (``mcp__<server>``) or sub-agent tools; without it
    Codex answers ``unsupported call``."""
    found: dict[str, str] = {}
    for tool in tools if isinstance(tools, list) else ():
        if isinstance(tool, dict) and tool.get("type") == "namespace" and tool.get("name"):
            for inner in tool.get("tools") or []:
                if isinstance(inner, dict) and inner.get("name"):
                    found.setdefault(str(inner["name"]), str(tool["name"]))
    return found


def chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _invalid("tool_choice", f"invalid tool_choice {choice!r} (auto, none, required, "
                   "or a function by name)")  # fmt: skip


def to_response(
    body: Mapping[str, Any], payload: Mapping[str, Any], state: _State
) -> dict[str, Any]:
    """The Responses object of a chat payload."""
    choice = payload["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    raw, thought, answer = wire.split_reasoning(message.get("content") or "")
    if raw:
        rid = f"rs_{uuid.uuid4().hex}"
        state.reasoning[rid] = raw
        reasoning: dict[str, Any] = {
            "type": "reasoning", "id": rid, "summary": [],
            "content": [{"type": "reasoning_text", "text": thought}],
        }  # fmt: skip
        if "reasoning.encrypted_content" in (body.get("include") or []):
            reasoning["encrypted_content"] = wire.opaque(raw)
        output.append(reasoning)
    calls = message.get("tool_calls") or []
    if answer or not calls:
        # every sampled token's logprob (reasoning and tool-call text included): what vLLM
        # sampled, not only the answer's tokens
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        output.append({
            "type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": answer, "annotations": [],
                         "logprobs": logprobs}],
        })  # fmt: skip
    namespaces = tool_namespaces(body.get("tools"))
    for call in calls:
        item = {
            "type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "status": "completed",
            "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
        }  # fmt: skip
        if call["function"]["name"] in namespaces:
            item["namespace"] = namespaces[call["function"]["name"]]
        output.append(item)
    usage = payload["usage"]
    cut = choice["finish_reason"] == "length"
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": payload["model"],
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", True) is not False,
        "temperature": body.get("temperature"),
        "text": {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def events(response: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The streamed form of a finished response, as OpenAI sends it."""
    opening = {**response, "status": "in_progress", "output": [], "usage": None,
               "incomplete_details": None}  # fmt: skip
    yield {"type": "response.created", "response": opening}
    yield {"type": "response.in_progress", "response": opening}
    for n, item in enumerate(response["output"]):
        yield from _item_events(n, item)
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield {"type": final, "response": dict(response)}


def _item_events(n: int, item: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    at = {"item_id": item["id"], "output_index": n}
    if item["type"] == "message":
        yield {"type": "response.output_item.added", "output_index": n,
               "item": {**item, "status": "in_progress", "content": []}}  # fmt: skip
        for k, part in enumerate(item["content"]):
            empty = {**part, "text": ""}
            yield {"type": "response.content_part.added", **at, "content_index": k,
                   "part": empty}  # fmt: skip
            if part["text"]:
                yield {"type": "response.output_text.delta", **at, "content_index": k,
                       "delta": part["text"], "logprobs": part["logprobs"]}  # fmt: skip
            yield {"type": "response.output_text.done", **at, "content_index": k,
                   "text": part["text"], "logprobs": part["logprobs"]}  # fmt: skip
            yield {"type": "response.content_part.done", **at, "content_index": k,
                   "part": part}  # fmt: skip
    elif item["type"] == "function_call":
        yield {"type": "response.output_item.added", "output_index": n,
               "item": {**item, "status": "in_progress", "arguments": ""}}  # fmt: skip
        yield {"type": "response.function_call_arguments.delta", **at,
               "delta": item["arguments"]}  # fmt: skip
        yield {"type": "response.function_call_arguments.done", **at,
               "name": item["name"], "arguments": item["arguments"]}  # fmt: skip
    else:  # reasoning
        yield {"type": "response.output_item.added", "output_index": n,
               "item": {**item, "content": []}}  # fmt: skip
        for k, part in enumerate(item["content"]):
            yield {"type": "response.reasoning_text.delta", **at, "content_index": k,
                   "delta": part["text"]}  # fmt: skip
            yield {"type": "response.reasoning_text.done", **at, "content_index": k,
                   "text": part["text"]}  # fmt: skip
    yield {"type": "response.output_item.done", "output_index": n, "item": dict(item)}


async def _stream(response: Mapping[str, Any]) -> AsyncIterator[bytes]:
    for seq, event in enumerate(events(response)):
        yield wire.sse(event["type"], {**event, "sequence_number": seq})


def _invalid(param: str, message: str, *, code: str | None = None) -> api.APIError:
    return api.APIError(400, message, param=param, code=code)
