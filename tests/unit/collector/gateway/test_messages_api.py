"""The Anthropic Messages API with a scripted policy, driven by the real ``anthropic`` client
on the episode's base URL without ``/v1`` (as Claude Code's ANTHROPIC_BASE_URL): tool use
both ways, streams parsed by the SDK, stop sequences, token counting, the HEAD probe, and a
sub-agent's calls interleaved with the main agent's kept as two token-exact branches."""

from __future__ import annotations

import asyncio
import contextlib

import anthropic
import httpx
import pytest

from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.gateway.assembly import assemble
from sandpiper.collector.gateway.server import Gateway, GatewaySettings
from sandpiper.store.records import Role
from sandpiper.testing import FAKE_TOOL_SCHEMAS, ScriptedPolicy

BASH_LS = '<tool_call>\n{"name": "execute_bash", "arguments": {"command": "ls"}}\n</tool_call>'
SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {"answer": "42"}}\n</tool_call>'
MODEL = "policy"
TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (t["function"] for t in FAKE_TOOL_SCHEMAS)
]
"""The fake tools in the Messages API's form."""
SYSTEM = [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}]


@contextlib.asynccontextmanager
async def _episode(tokenizer, replies, eid="e"):
    """(gateway, policy, renderer, client) with episode ``eid`` open; closes everything."""
    policy = ScriptedPolicy(tokenizer, replies, version=5)
    renderer = ChatRenderer(tokenizer, FAKE_TOOL_SCHEMAS)
    gw = Gateway(client=policy, renderer=renderer,
                 settings=GatewaySettings(model_names=(MODEL,)))  # fmt: skip
    await gw.serve()
    gw.open_episode(eid)
    client = anthropic.AsyncAnthropic(base_url=f"{gw.url}/episodes/{eid}", api_key="x")
    try:
        yield gw, policy, renderer, client
    finally:
        await client.close()
        await gw.aclose()


def _spliced(policy, session, k: int) -> None:
    call = session.calls[k]
    parent = session.calls[call.parent]
    sampled = [int(t) for t in parent.generation.token_ids_T]
    assert call.extends and call.restart_reason is None
    assert policy.prompts[k] == [*policy.prompts[call.parent], *sampled, *call.delta_ids]


def _tool_result(message, output: str) -> list[dict]:
    """The assistant message sent back and the user message answering its tool use."""
    (use,) = [b for b in message.content if b.type == "tool_use"]
    return [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                          for b in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": output}]}]},
    ]  # fmt: skip


def test_a_tool_loop_extends_token_for_token(tiny_tokenizer):
    async def main():
        async with _episode(tiny_tokenizer, [BASH_LS, "done"]) as (gw, policy, renderer, client):
            messages: list = [{"role": "user", "content": "6*7?"}]
            m1 = await client.messages.create(
                model=MODEL, max_tokens=64, system=SYSTEM, tools=TOOLS, messages=messages
            )
            assert m1.stop_reason == "tool_use"
            assert m1.content[-1].name == "execute_bash"
            assert m1.content[-1].input == {"command": "ls"}
            messages += _tool_result(m1, "a.txt")
            m2 = await client.messages.create(
                model=MODEL, max_tokens=64, system=SYSTEM, tools=TOOLS, messages=messages
            )
            assert m2.stop_reason == "end_turn" and m2.content[0].text == "done"
            assert m2.usage.input_tokens == len(policy.prompts[1])
            session = gw.close_episode("e")
            await session.settle()
            return policy, renderer, session

    policy, renderer, session = asyncio.run(main())
    _spliced(policy, session, 1)
    assert not session.calls[1].retokenized_differs
    turns, stats = assemble(session.calls, renderer.decode)
    assert [t.role for t in turns] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
    assert stats.segments == 1 and turns[1].tool_calls[0].output == "a.txt"


def test_streams_parse_into_the_same_messages(tiny_tokenizer):
    async def main():
        replies = [BASH_LS, "x", "plain text", "<think>\nhm\n</think>\n\nok"]
        async with _episode(tiny_tokenizer, replies) as (gw, policy, _, client):
            messages: list = [{"role": "user", "content": "go"}]
            raw = await client.beta.messages.create(  # ?beta=true and anthropic-beta
                model=MODEL, max_tokens=64, tools=TOOLS, messages=messages, stream=True,
                betas=["interleaved-thinking-2025-05-14"],
            )  # fmt: skip
            kinds = [event.type async for event in raw]  # the SDK drops pings
            async with httpx.AsyncClient(base_url=f"{gw.url}/episodes/e") as http:
                body = {"model": MODEL, "max_tokens": 8, "messages": messages, "stream": True}
                sse = (await http.post("/v1/messages?beta=true", json=body)).text
            wire = [line.removeprefix("event: ") for line in sse.splitlines()
                    if line.startswith("event: ")]  # fmt: skip
            async with client.messages.stream(
                model=MODEL, max_tokens=64, tools=TOOLS, messages=messages
            ) as stream:
                text = await stream.get_final_message()
            async with client.messages.stream(
                model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "think"}]
            ) as stream:
                thought = await stream.get_final_message()
            # the thinking block sent back is the exact text the model sampled
            again = [{"role": "user", "content": "think"},
                     {"role": "assistant", "content": [b.model_dump() for b in thought.content]},
                     {"role": "user", "content": "more"}]  # fmt: skip
            policy.replies.append("fine")
            await client.messages.create(model=MODEL, max_tokens=8, messages=again)
            return kinds, wire, text, thought, policy, gw.close_episode("e")

    kinds, wire, text, thought, policy, session = asyncio.run(main())
    assert kinds == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert wire == [kinds[0], "ping", *kinds[1:]]
    assert text.content[0].text == "plain text" and text.stop_reason == "end_turn"
    assert [b.type for b in thought.content] == ["thinking", "text"]
    assert thought.content[0].thinking == "hm" and thought.content[1].text == "ok"
    _spliced(policy, session, 4)


def test_a_streamed_tool_use_arrives_as_input_json(tiny_tokenizer):
    async def main():
        async with _episode(tiny_tokenizer, [SUBMIT]) as (_, _, _, client):
            request = client.messages.stream(
                model=MODEL, max_tokens=64, tools=TOOLS,
                messages=[{"role": "user", "content": "go"}],
            )  # fmt: skip
            async with request as stream:
                partial = [e.partial_json async for e in stream if e.type == "input_json"]
                return partial, await stream.get_final_message()

    partial, final = asyncio.run(main())
    assert partial and final.stop_reason == "tool_use"
    assert final.content[0].input == {"answer": "42"}


def test_stop_sequences_end_the_reply_and_are_named(tiny_tokenizer):
    async def main():
        async with _episode(tiny_tokenizer, ["one two END three"]) as (_, _, _, client):
            return await client.messages.create(
                model=MODEL, max_tokens=64, stop_sequences=["END"],
                messages=[{"role": "user", "content": "count"}],
            )  # fmt: skip

    message = asyncio.run(main())
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "END"
    assert message.content[0].text == "one two "


def test_count_tokens_head_probe_and_errors(tiny_tokenizer):
    async def main():
        async with _episode(tiny_tokenizer, ["hi"]) as (gw, policy, _, client):
            messages = [{"role": "user", "content": "hello"}]
            counted = await client.messages.count_tokens(
                model=MODEL, system="sys", tools=TOOLS, messages=messages
            )
            await client.messages.create(
                model=MODEL, max_tokens=8, system="sys", tools=TOOLS, messages=messages
            )
            async with httpx.AsyncClient(base_url=gw.url) as http:
                head = await http.head("/episodes/e")
                missing = await http.head("/episodes/nope")
            with pytest.raises(anthropic.BadRequestError) as bad:
                await client.messages.create(
                    model=MODEL, max_tokens=8,
                    messages=[{"role": "user", "content": [
                        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}],
                )  # fmt: skip
            with pytest.raises(anthropic.BadRequestError) as server_tool:
                await client.messages.create(
                    model=MODEL, max_tokens=8, messages=messages,
                    tools=[{"type": "web_search_20250305", "name": "web_search"}],
                )  # fmt: skip
            with pytest.raises(anthropic.NotFoundError) as unknown:
                await client.messages.create(model="claude-x", max_tokens=8, messages=messages)
            return counted, policy, head, missing, bad, server_tool, unknown

    counted, policy, head, missing, bad, server_tool, unknown = asyncio.run(main())
    assert counted.input_tokens == len(policy.prompts[0])
    assert head.status_code == 200 and missing.status_code == 404
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "'image'" in bad.value.message and "web_search_20250305" in server_tool.value.message
    assert unknown.value.body["error"]["type"] == "not_found_error"
    assert len(policy.prompts) == 1  # no refused request reached the model


def test_a_sub_agent_between_two_main_calls_keeps_both_branches_exact(tiny_tokenizer):
    """Claude Code runs a sub-agent (its own system prompt and history) between two calls
    of the main agent: each call extends the longest earlier prefix, so the episode is two
    segments, each one contiguous token sequence."""

    async def main():
        replies = [BASH_LS, SUBMIT, "main done", "sub done"]
        async with _episode(tiny_tokenizer, replies) as (gw, policy, renderer, client):
            main_msgs: list = [{"role": "user", "content": "task"}]
            sub_msgs: list = [{"role": "user", "content": "subtask"}]
            m1 = await client.messages.create(model=MODEL, max_tokens=64, system="main",
                                              tools=TOOLS, messages=main_msgs)  # fmt: skip
            s1 = await client.messages.create(model=MODEL, max_tokens=64, system="sub",
                                              tools=TOOLS, messages=sub_msgs)  # fmt: skip
            main_msgs += _tool_result(m1, "main out")
            sub_msgs += _tool_result(s1, "sub out")
            await client.messages.create(model=MODEL, max_tokens=64, system="main",
                                         tools=TOOLS, messages=main_msgs)  # fmt: skip
            await client.messages.create(model=MODEL, max_tokens=64, system="sub",
                                         tools=TOOLS, messages=sub_msgs)  # fmt: skip
            session = gw.close_episode("e")
            return policy, renderer, session

    policy, renderer, session = asyncio.run(main())
    assert [c.parent for c in session.calls] == [None, None, 0, 1]
    assert session.calls[1].restart_reason == "the history is not longer than the previous call's"
    _spliced(policy, session, 2)
    _spliced(policy, session, 3)
    turns, stats = assemble(session.calls, renderer.decode)
    assert stats.segments == 2
    assert [t.role for t in turns] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT] * 2
    main_ids = [int(t) for turn in turns[:4] for t in turn.token_ids_T]
    sampled = [int(t) for t in session.calls[2].generation.token_ids_T]
    assert main_ids == [*policy.prompts[2], *sampled]
    assert turns[1].tool_calls[0].output == "main out"
    assert turns[5].tool_calls[0].output == "sub out"


def test_an_external_agent_gets_the_anthropic_base_url(tmp_path, monkeypatch):
    """Claude Code reads ANTHROPIC_BASE_URL (no ``/v1``); a key from the collector's own
    environment never reaches the agent."""
    from types import SimpleNamespace

    from sandpiper.collector.gateway.external import _agent_env

    monkeypatch.setenv("ANTHROPIC_API_KEY", "the-host-key")
    task = SimpleNamespace(instruction="do", reference=SimpleNamespace(agent_env=None))
    gateway = SimpleNamespace(settings=GatewaySettings(model_names=(MODEL,)))
    url = "http://127.0.0.1:9/episodes/e1/v1"
    env = _agent_env(task, url, gateway, "e1", tmp_path)
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9/episodes/e1"
    assert env["ANTHROPIC_API_KEY"] == "sandpiper-e1" == env["OPENAI_API_KEY"]


def test_a_system_message_among_the_messages_stays_a_system_message(tiny_tokenizer):
    """Claude Code 2.1 sends its environment as a ``system`` message after the first user
    message (``messages.1.role == "system"``); it was refused with a 400 and Claude Code
    exited having made no call."""
    env = "# Environment\nPrimary working directory: /tmp/x"

    async def main():
        async with _episode(tiny_tokenizer, ["hi", "done"]) as (gw, policy, renderer, client):
            messages: list = [
                {"role": "user", "content": [{"type": "text", "text": "say hi"}]},
                {"role": "system", "content": [{"type": "text", "text": env}]},
            ]
            m1 = await client.messages.create(model=MODEL, max_tokens=8, system=SYSTEM,
                                              messages=messages)  # fmt: skip
            messages += [{"role": "assistant", "content": m1.content[0].text},
                         {"role": "user", "content": "again"}]  # fmt: skip
            await client.messages.create(model=MODEL, max_tokens=8, system=SYSTEM,
                                         messages=messages)  # fmt: skip
            bad = [{"role": "tool", "content": "x"}]
            with pytest.raises(anthropic.BadRequestError, match=r"messages\.0\.role"):
                await client.messages.create(model=MODEL, max_tokens=8, messages=bad)
            session = gw.close_episode("e")
            await session.settle()
            return policy, renderer, session

    policy, renderer, session = asyncio.run(main())
    prompt = renderer.decode(policy.prompts[0])
    assert prompt.index("say hi") < prompt.index(env)
    _spliced(policy, session, 1)
