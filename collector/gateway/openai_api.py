"""The OpenAI wire format at the gateway's edge: request checks, responses, errors.

What the gateway cannot honour exactly is an OpenAI-style ``400`` naming the parameter
(``{"error": {"message", "type", "param", "code"}}``), so an agent learns at once instead of
silently getting something else:

- ``n`` must be 1 (a GRPO group is made of episodes, not of choices), ``logit_bias``,
  ``response_format``, ``functions``/``function_call`` (use ``tools``), non-zero
  ``presence_penalty``/``frequency_penalty``, ``audio``/``modalities`` and non-text content
  parts are refused.
- The sampling fields (``stop``, ``logprobs``/``top_logprobs``, ``seed``, ``temperature``,
  ``top_p``, ``max_tokens``, ``parallel_tool_calls``) are read and checked against the run's
  sampling policy by :mod:`sandpiper.collector.gateway.request_params`; fields that change
  nothing (``user``, ``metadata``, ``prompt_cache_key``, unknown ``extra_body`` keys) are
  accepted and logged once.
- ``tool_choice``: ``auto`` (default) and ``none`` (no tools rendered or parsed) are exact;
  ``required`` and a named function are accepted but not enforced by constrained decoding —
  the model answers as it would under ``auto`` (documented in docs/gateway.md).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from sandpiper.collector.inference.base import Generation

_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a surrogate code point (a pair, or a lone one to replace)."""

REFUSED = (
    "logit_bias",
    "response_format",
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "suffix",
    "echo",
    "best_of",
)
"""Request fields the gateway refuses when present and not null/false."""

KNOWN = {
    "model", "messages", "prompt", "tools", "tool_choice", "n", "stream", "stream_options",
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
    "logprobs", "top_logprobs", "parallel_tool_calls", "presence_penalty",
    "frequency_penalty", *REFUSED,
}  # fmt: skip
"""Fields the chat and completions routes read; any other is accepted and logged once
(:func:`~sandpiper.collector.gateway.request_params.note_ignored`)."""


class APIError(Exception):
    """An error the client gets as an OpenAI error object."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 404 and self.code == "model_not_found":
            kind = "invalid_request_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def parse_body(raw: bytes) -> dict[str, Any]:
    """JSON object of a request; lone surrogates (invalid in UTF-8) become U+FFFD.

    orjson parses an agent's whole history several times faster than the json module (see
    :func:`fast_loads`); what it refuses (lone surrogates, NaN, invalid JSON) takes the json
    module's path, which accepts or reports it as before."""
    body = fast_loads(raw)
    if isinstance(body, dict):
        return body  # orjson holds no surrogate: it refuses lone ones
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    if not _ESCAPED_SURROGATE.search(raw):
        return body  # UTF-8 cannot hold a surrogate: only a \\uD8xx-\\uDFxx escape makes one
    text = json.dumps(body, ensure_ascii=False)
    if _SURROGATE.search(text):
        body = json.loads(_SURROGATE.sub("\ufffd", text))
    return body


_LONG_NUMBER = re.compile(rb"\d{19}")
"""19 digits in a row: maybe an integer past 64 bits, which orjson makes a float."""


def fast_loads(raw: bytes | str) -> Any:
    """``raw`` parsed by orjson, or None where the json module must decide: orjson refused
    it (lone surrogates, NaN, invalid JSON), or it may hold an integer orjson would turn into
    a float (json keeps it exact)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if _LONG_NUMBER.search(data):
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def encode_json(payload: Any) -> bytes:
    """A response body: the bytes Starlette's ``JSONResponse`` sends (compact, UTF-8) for the
    str/int/bool/None payloads of a completion, made by orjson (the json module's path for
    what orjson refuses, e.g. a lone surrogate, which fails there as before)."""
    try:
        return orjson.dumps(payload)
    except TypeError:
        return json.dumps(
            payload, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
        ).encode("utf-8")


def check_common(body: Mapping[str, Any], model_names: Sequence[str]) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "you must provide a model parameter", param="model")
    if model not in model_names:
        raise APIError(
            404,
            f"The model `{model}` does not exist. This gateway serves: {', '.join(model_names)}",
            param="model",
            code="model_not_found",
        )
    n = body.get("n", 1)
    if n not in (1, None):
        raise APIError(
            400,
            f"n={n} is not supported: each call samples one choice (a GRPO group is several "
            "episodes, each with its own base URL)",
            param="n",
            code="unsupported_parameter",
        )
    for key in REFUSED:
        if body.get(key) not in (None, False):
            raise APIError(
                400, f"the parameter {key!r} is not supported by the Sandpiper gateway",
                param=key, code="unsupported_parameter",
            )  # fmt: skip
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise APIError(
                400, f"{key} is not supported by the Sandpiper gateway (only 0): it changes "
                "the distribution the learner corrects for",
                param=key, code="unsupported_parameter",
            )  # fmt: skip


def check_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise APIError(400, f"messages[{i}] has no valid role", param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise APIError(
                        400, f"messages[{i}]: only text content parts are supported",
                        param=f"messages[{i}].content",
                    )  # fmt: skip
        elif content is not None and not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be text", param=f"messages[{i}]")
    return [{**m, "role": "system"} if m.get("role") == "developer" else dict(m) for m in messages]


def check_tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The request's tools as rendered into the prompt (empty for ``tool_choice: none``)."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list", param="tools")
    for i, t in enumerate(tools):
        if (
            not isinstance(t, dict)
            or t.get("type") != "function"
            or not isinstance(t.get("function"), dict)
            or not t["function"].get("name")
        ):
            raise APIError(400, f"tools[{i}] must be a function tool with a name",
                           param=f"tools[{i}]")  # fmt: skip
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        return []
    if choice not in (None, "auto", "required") and not (
        isinstance(choice, dict) and choice.get("type") == "function"
    ):
        raise APIError(400, f"invalid tool_choice {choice!r}", param="tool_choice")
    return tools


def chat_response(
    *,
    response_id: str,
    model: str,
    message: Mapping[str, Any],
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": dict(message),
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ],
        "usage": _usage(prompt_tokens, completion_tokens),
    }


def chat_chunks(
    *,
    response_id: str,
    model: str,
    message: Mapping[str, Any],
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    include_usage: bool,
    logprobs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The streamed form of a finished completion (role with the logprobs, content, tool
    calls, finish)."""
    created = int(time.time())

    def chunk(
        delta: dict[str, Any], finish: str | None = None, lp: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}],
        }

    chunks = [chunk({"role": "assistant", "content": ""}, lp=logprobs)]
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}))
    for i, call in enumerate(message.get("tool_calls") or []):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    chunks.append(chunk({}, finish_reason))
    if include_usage:
        chunks.append(
            {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(prompt_tokens, completion_tokens),
            }
        )
    return chunks


def completion_response(
    *,
    response_id: str,
    model: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
        "usage": _usage(prompt_tokens, completion_tokens),
    }


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def chat_logprobs(generation: Generation, decode: Callable[[Sequence[int]], str]) -> dict[str, Any]:
    """``choices[0].logprobs`` of a chat completion: every sampled token (the end-of-turn
    token included) with the logprob vLLM sampled it with, and its ``top_logprobs`` when
    asked. A token's text is its own decoding; ``bytes`` are that text's UTF-8."""
    top = generation.top_logprobs
    content = []
    for i, (tid, lp) in enumerate(zip(generation.token_ids_T, generation.logprobs_T, strict=True)):
        token = decode([int(tid)])
        alternatives = [] if top is None else [
            {"token": (t := decode([cid])), "logprob": float(clp), "bytes": list(t.encode())}
            for cid, clp in top[i]
        ]  # fmt: skip
        content.append({"token": token, "logprob": float(lp), "bytes": list(token.encode()),
                        "top_logprobs": alternatives})  # fmt: skip
    return {"content": content, "refusal": None}


def completion_logprobs(
    generation: Generation, decode: Callable[[Sequence[int]], str]
) -> dict[str, Any]:
    """``choices[0].logprobs`` of a legacy completion (tokens, their logprobs, the top ones
    as ``{token: logprob}``, each token's offset in the text)."""
    tokens = [decode([int(t)]) for t in generation.token_ids_T]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top = generation.top_logprobs
    return {
        "tokens": tokens,
        "token_logprobs": [float(x) for x in generation.logprobs_T],
        "top_logprobs": None
        if top is None
        else [{decode([cid]): float(clp) for cid, clp in position} for position in top],
        "text_offset": offsets,
    }
