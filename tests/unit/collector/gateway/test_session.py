"""How a gateway session compares an agent's resent history with what the model saw.

A call normalises only the messages that differ from the previous request's (agents resend
their history unchanged); these tests check that an edit anywhere in the history, the
agent's own re-serialisation of a returned assistant message, and a restart are all judged
as the full comparison judges them.
"""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np

from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.gateway.session import EpisodeSession
from sandpiper.collector.inference.base import Generation
from sandpiper.testing import FAKE_TOOL_SCHEMAS

REPLY = '<tool_call>\n{"name": "execute_bash", "arguments": {"command": "ls"}}\n</tool_call>'


def _call(session: EpisodeSession, messages: list[dict]) -> tuple[bool, str | None, dict]:
    """One chat call with a scripted reply; (extends, restart reason, message returned)."""
    prompt, extends, delta, reason, _ = session.chat_prompt(messages, FAKE_TOOL_SCHEMAS)
    renderer = session.renderer
    ids = [*renderer.encode(REPLY), *renderer.stop_token_ids]
    n = len(ids)
    generation = Generation(
        np.asarray(ids, np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32), "stop"
    )
    index = len(session.calls)
    returned = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call_{index}_0", "type": "function",
             "function": {"name": "execute_bash", "arguments": '{"command": "ls"}'}}
        ],
    }  # fmt: skip
    session.record(
        endpoint="chat", prompt_ids=prompt, extends=extends, delta_ids=delta,
        restart_reason=reason, retokenized_differs=False, generation=generation, text=REPLY,
        tool_calls=(), started_at=datetime.now(UTC), duration_ms=0.0, messages=messages,
        returned=returned,
    )  # fmt: skip
    return extends, reason, returned


def _tool(returned: dict, content: str) -> dict:
    return {"role": "tool", "tool_call_id": returned["tool_calls"][0]["id"], "content": content}


def test_edits_anywhere_in_a_resent_history_restart_and_equivalent_forms_extend(tiny_tokenizer):
    session = EpisodeSession("e", ChatRenderer(tiny_tokenizer, FAKE_TOOL_SCHEMAS))
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    assert _call(session, messages)[:2] == (False, None)
    extends, _, returned = _call(session, [*messages])  # same history again: not longer
    assert not extends

    # the agent resends the returned message re-serialised (other whitespace): still extends
    history = [*messages, {**returned, "tool_calls": [
        {**returned["tool_calls"][0], "function": {"name": "execute_bash",
                                                    "arguments": '{ "command" : "ls" }'}}]},
        _tool(returned, "a.txt")]  # fmt: skip
    extends, reason, returned = _call(session, history)
    assert (extends, reason) == (True, None)

    # the next call resends that history unchanged: extends
    history = [*history, returned, _tool(returned, "b.txt")]
    extends, reason, returned = _call(session, history)
    assert (extends, reason) == (True, None)

    # an edit deep in the otherwise unchanged history: a restart naming the message
    edited = [*history[:3], {**history[3], "content": "A.TXT"}, *history[4:], returned,
              _tool(returned, "c.txt")]  # fmt: skip
    extends, reason, returned = _call(session, edited)
    assert (extends, reason) == (False, "message 3 differs from what the model saw")

    # after the restart, the original message 3 differs from what the model saw ...
    reverted = [*edited[:3], history[3], *edited[4:], returned, _tool(returned, "d.txt")]
    extends, reason, returned = _call(session, reverted)
    assert (extends, reason) == (False, "message 3 differs from what the model saw")
    # ... and a call extending the last one's history extends
    extends, reason, _ = _call(session, [*reverted, returned, _tool(returned, "e.txt")])
    assert (extends, reason) == (True, None)
