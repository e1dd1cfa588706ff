"""Pieces the Responses and Messages APIs share on top of the chat path.

Both APIs convert a request into the chat messages and tools the chat path renders, and the
chat reply back into their own items or blocks. A reply is stored as the chat assistant
message the model's text parsed into; the next request's history must convert back into
that same message, character for character, for the call to extend the episode token for
token (:mod:`sandpiper.collector.gateway.session`). The only part that needs care is a
reasoning model's ``<think>…</think>`` text: both APIs hand it to the client as a separate
reasoning item / thinking block, and the client sends that back in its own shape. The exact
text (tags and the whitespace that followed them included) travels in the item's opaque
field (``encrypted_content`` / ``signature``), which clients return unchanged; the gateway
also remembers it by item id. A client that sends back only the visible reasoning gets a
best-effort rebuild, and where that differs from what the model saw, the call is a restart
(a new segment), never a wrong splice.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any, Protocol

from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.gateway.openai_api import APIError
from sandpiper.collector.gateway.session import EpisodeSession


class ChatPath(Protocol):
    """What an API module needs of the gateway (:class:`~.server.Gateway`): the module is
    imported by the server, so it names this shape rather than the class."""

    renderer: ChatRenderer

    @property
    def settings(self) -> Any: ...

    def session(self, eid: str) -> EpisodeSession: ...

    async def call(
        self, eid: str, body: dict[str, Any], *, chat: bool = True
    ) -> dict[str, Any]: ...


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_OPAQUE_PREFIX = "sandpiper.reasoning.v1:"
"""Marks an opaque reasoning field made by this gateway (base64 of the exact text)."""


def split_reasoning(content: str) -> tuple[str, str, str]:
    """(raw reasoning prefix, its visible text, the answer) of an assistant message's text,
    with ``raw + answer == content``; ("", "", content) when it holds no reasoning.

    Reasoning opens the reply with ``<think>`` or, where the chat template's generation
    prompt already opened the block (Qwen3, DeepSeek-R1), is all text before a first
    ``</think>``. A reply cut off inside its ``<think>`` block is all reasoning."""
    if content.lstrip().startswith(THINK_OPEN):
        start = content.index(THINK_OPEN) + len(THINK_OPEN)
    elif THINK_CLOSE in content and THINK_OPEN not in content:
        start = 0
    else:
        return "", "", content
    end = content.find(THINK_CLOSE, start)
    if end < 0:
        return content, content[start:].strip(), ""
    after = end + len(THINK_CLOSE)
    answer_at = len(content) - len(content[after:].lstrip())
    return content[:answer_at], content[start:end].strip(), content[answer_at:]


def opaque(raw: str) -> str:
    """The opaque field carrying a reasoning prefix exactly."""
    return _OPAQUE_PREFIX + base64.b64encode(raw.encode("utf-8", "surrogatepass")).decode()


def from_opaque(value: Any) -> str | None:
    """The reasoning prefix an :func:`opaque` field carries (None: not one of ours)."""
    if not isinstance(value, str) or not value.startswith(_OPAQUE_PREFIX):
        return None
    try:
        raw = base64.b64decode(value[len(_OPAQUE_PREFIX) :], validate=True)
        return raw.decode("utf-8", "surrogatepass")
    except ValueError:
        return None


def rebuilt_reasoning(text: str) -> str:
    """A best-effort reasoning prefix from visible reasoning text alone."""
    return f"{THINK_OPEN}\n{text}\n{THINK_CLOSE}\n\n" if text else ""


def call_index(payload: Mapping[str, Any]) -> int:
    """The episode call index of a chat payload (its id ends with ``-<index>``)."""
    return int(str(payload["id"]).rsplit("-", 1)[1])


def renamed(error: APIError, names: Mapping[str, str]) -> APIError:
    """``error`` naming the field the client sent where the chat path named its own."""
    name = names.get(error.param or "")
    if name is None or error.param is None:
        return error
    message = error.message.replace(error.param, name)
    return APIError(error.status, message, param=name, code=error.code)


def sse(event: str, data: Mapping[str, Any]) -> bytes:
    """One server-sent event with a named type (both APIs name their events)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def arguments_object(arguments: str) -> Any:
    """A tool call's JSON arguments as an object (the Messages API's ``input``)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
