"""The OpenAI-compatible gateway with a scripted policy: the real ``openai`` client talks to a
real (in-process) server; prompts extend token for token, rewrites become segments, bad
clients get OpenAI errors."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.gateway.assembly import assemble
from sandpiper.collector.gateway.server import Gateway, GatewaySettings
from sandpiper.config import SamplingLimits
from sandpiper.store.records import Role
from sandpiper.testing import FAKE_TOOL_SCHEMAS, ScriptedPolicy

BASH_LS = '<tool_call>\n{"name": "execute_bash", "arguments": {"command": "ls"}}\n</tool_call>'
SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {"answer": "42"}}\n</tool_call>'
MODEL = "policy"


def _gateway(tokenizer, replies, **settings):
    policy = ScriptedPolicy(tokenizer, replies, version=7)
    renderer = ChatRenderer(tokenizer, FAKE_TOOL_SCHEMAS)
    gw = Gateway(
        client=policy,
        renderer=renderer,
        settings=GatewaySettings(model_names=(MODEL,), sampling=SamplingLimits(**settings)),
    )
    return gw, policy, renderer


_CLIENTS: list = []


def _openai(url: str):
    """An OpenAI client closed by the test (an open one's sockets outlive the test's loop)."""
    client = openai.AsyncOpenAI(base_url=url, api_key="x")
    _CLIENTS.append(client)
    return client


async def _close_clients() -> None:
    while _CLIENTS:
        await _CLIENTS.pop().close()


def _run(coro):
    return asyncio.run(coro)


def test_tool_loop_extends_token_for_token_and_assembles_one_sequence(tiny_tokenizer):
    async def main():
        gw, policy, renderer = _gateway(tiny_tokenizer, [BASH_LS, SUBMIT])
        await gw.serve()
        try:
            url = gw.open_episode("ep1")
            client = _openai(url)
            messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "6*7?"}]
            r1 = await client.chat.completions.create(
                model=MODEL, messages=messages, tools=FAKE_TOOL_SCHEMAS
            )
            m1 = r1.choices[0].message
            assert r1.choices[0].finish_reason == "tool_calls"
            assert m1.tool_calls[0].function.name == "execute_bash"
            assert json.loads(m1.tool_calls[0].function.arguments) == {"command": "ls"}
            messages += [
                m1.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": m1.tool_calls[0].id, "content": "a.txt"},
            ]
            r2 = await client.chat.completions.create(
                model=MODEL, messages=messages, tools=FAKE_TOOL_SCHEMAS
            )
            assert r2.choices[0].message.tool_calls[0].function.name == "submit"
            session = gw.close_episode("ep1")
            await session.settle()
        finally:
            await _close_clients()
            await gw.aclose()
        return session, policy, renderer

    session, policy, renderer = _run(main())
    first, second = session.calls
    assert not first.extends and second.extends
    # the second prompt is the first prompt + the exact sampled ids + the tool delta
    sampled = [int(t) for t in first.generation.token_ids_T]
    assert policy.prompts[1] == [*policy.prompts[0], *sampled, *second.delta_ids]
    assert first.tool_outputs == {"call_0_0": "a.txt"}
    turns, stats = assemble(session.calls, renderer.decode)
    assert [t.role for t in turns] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
    assert stats.segments == 1 and stats.calls == 2
    assert turns[1].tool_calls[0].output == "a.txt"
    assert set(turns[3].policy_versions_T.tolist()) == {7}


def test_a_turn_cut_off_by_max_tokens_is_continued_token_for_token(tiny_tokenizer):
    """A reply truncated at ``max_tokens`` (no end-of-turn token) that the agent echoes back
    extends the episode: the sampled ids stay as sampled and the next delta closes the turn
    with the template's text, so the prompt reads exactly as a from-scratch render."""

    async def main():
        gw, policy, renderer = _gateway(tiny_tokenizer, ["one two three four five six", SUBMIT])
        await gw.serve()
        try:
            client = _openai(gw.open_episode("e"))
            messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
            r1 = await client.chat.completions.create(
                model=MODEL, messages=messages, tools=FAKE_TOOL_SCHEMAS, max_tokens=3
            )
            assert r1.choices[0].finish_reason == "length"
            messages += [r1.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "go on"}]  # fmt: skip
            await client.chat.completions.create(
                model=MODEL, messages=messages, tools=FAKE_TOOL_SCHEMAS
            )
            session = gw.close_episode("e")
            await session.settle()
            return session, policy, renderer, messages
        finally:
            await _close_clients()
            await gw.aclose()

    session, policy, renderer, messages = _run(main())
    first, second = session.calls
    sampled = [int(t) for t in first.generation.token_ids_T]
    assert len(sampled) == 3 and sampled[-1] not in renderer.stop_token_ids
    assert (second.extends, second.restart_reason) == (True, None)
    assert policy.prompts[1] == [*policy.prompts[0], *sampled, *second.delta_ids]
    fresh = renderer.render(messages, add_generation_prompt=True, tools=FAKE_TOOL_SCHEMAS)
    assert renderer.decode(policy.prompts[1]) == fresh
    _, stats = assemble(session.calls, renderer.decode)
    assert stats.segments == 1 and stats.restart_reasons == {}


def test_rewritten_history_starts_a_new_segment(tiny_tokenizer):
    async def main():
        gw, _, renderer = _gateway(tiny_tokenizer, ["hello", "again"])
        await gw.serve()
        try:
            client = _openai(gw.open_episode("e"))
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
            # the agent summarises: its history no longer holds what the model sampled
            await client.chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "(summary)"},
                    {"role": "user", "content": "go on"},
                ],
            )
            session = gw.close_episode("e")
            await session.settle()
            return session, renderer
        finally:
            await _close_clients()
            await gw.aclose()

    session, renderer = _run(main())
    assert session.calls[1].restart_reason == "message 1 differs from what the model saw"
    # both prompts are the tokenizer's own ids of the template's text (the renderer's piece
    # cache, filled by the first call, serves the rewritten history exactly as well)
    rewritten = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "(summary)"},
        {"role": "user", "content": "go on"},
    ]
    for call, messages in zip(session.calls, [rewritten[:1], rewritten], strict=True):
        text = renderer.render(messages, add_generation_prompt=True, tools=[])
        assert list(call.prompt_ids) == tiny_tokenizer.encode(text, add_special_tokens=False)
    turns, stats = assemble(session.calls, renderer.decode)
    assert [t.role for t in turns] == [Role.USER, Role.ASSISTANT, Role.USER, Role.ASSISTANT]
    assert stats.segments == 2
    assert stats.restart_reasons == {"message 1 differs from what the model saw": 1}


def test_streaming_matches_the_plain_response(tiny_tokenizer):
    async def main():
        gw, _, _ = _gateway(tiny_tokenizer, [BASH_LS])
        await gw.serve()
        try:
            client = _openai(gw.open_episode("s"))
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}],
                tools=FAKE_TOOL_SCHEMAS, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            chunks = [c async for c in stream]
            return chunks, gw.close_episode("s")
        finally:
            await _close_clients()
            await gw.aclose()

    chunks, session = _run(main())
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "execute_bash"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(session.calls[0].generation.token_ids_T)


def test_completions_endpoint_extends_its_own_prompt(tiny_tokenizer):
    async def main():
        gw, policy, _ = _gateway(tiny_tokenizer, ["one", "two"])
        await gw.serve()
        try:
            client = _openai(gw.open_episode("c"))
            r = await client.completions.create(model=MODEL, prompt="Count:")
            first = policy.prompts[0] + [
                int(t) for t in gw._episodes["c"].session.calls[0].generation.token_ids_T
            ]
            await client.completions.create(model=MODEL, prompt=[*first, 5, 6])
            return r, gw.close_episode("c")
        finally:
            await _close_clients()
            await gw.aclose()

    r, session = _run(main())
    assert r.choices[0].text == "one"
    assert session.calls[1].extends and session.calls[1].delta_ids == (5, 6)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, 404,
         "model_not_found"),
        ({"model": MODEL, "n": 2, "messages": [{"role": "user", "content": "x"}]}, 400,
         "unsupported_parameter"),
        ({"model": MODEL, "logit_bias": {"1": 5}, "messages": [{"role": "user", "content": "x"}]},
         400, "unsupported_parameter"),
        ({"model": MODEL, "presence_penalty": 1, "messages": [{"role": "user", "content": "x"}]},
         400, "unsupported_parameter"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}, 400,
         "context_length_exceeded"),
        ({"model": MODEL, "messages": []}, 400, None),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors(tiny_tokenizer, body, status, code):
    async def main():
        gw, policy, _ = _gateway(tiny_tokenizer, ["never"], context_limit=256)
        await gw.serve()
        try:
            url = gw.open_episode("b")
            async with httpx.AsyncClient() as http:
                r = await http.post(f"{url}/chat/completions", json=body)
            return r, policy
        finally:
            await _close_clients()
            await gw.aclose()

    r, policy = _run(main())
    assert r.status_code == status
    assert r.json()["error"]["code"] == code
    assert policy.prompts == []  # nothing reached the model


def test_unknown_episode_and_surrogates(tiny_tokenizer):
    async def main():
        gw, _, _ = _gateway(tiny_tokenizer, ["ok"])
        await gw.serve()
        try:
            url = gw.open_episode("u")
            async with httpx.AsyncClient() as http:
                missing = await http.post(f"{gw.url}/episodes/nope/v1/chat/completions", json={})
                raw = b'{"model": "policy", "messages": [{"role": "user", "content": "\\ud800"}]}'
                ok = await http.post(f"{url}/chat/completions", content=raw)
                bad = await http.post(f"{url}/chat/completions", content=b"\xff{")
            return missing, ok, bad
        finally:
            await _close_clients()
            await gw.aclose()

    missing, ok, bad = _run(main())
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "episode_not_found"
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"
    assert bad.status_code == 400


def test_a_call_records_the_model_call_time_only(tiny_tokenizer):
    """``duration_ms`` is the client's ``generate`` alone (bench/gateway_bench.py subtracts it
    from the agent's latency): 50 ms in the model, then 200 ms decoding what it sampled."""

    async def main():
        gw, policy, renderer = _gateway(tiny_tokenizer, [SUBMIT])
        generate, decode = policy.generate, renderer.decode

        async def slow_generate(prompt_ids, params):
            await asyncio.sleep(0.05)
            return await generate(prompt_ids, params)

        def slow_decode(token_ids):
            time.sleep(0.2)
            return decode(token_ids)

        policy.generate, renderer.decode = slow_generate, slow_decode
        await gw.serve()
        try:
            client = _openai(gw.open_episode("ep"))
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "6*7?"}],
                tools=FAKE_TOOL_SCHEMAS,
            )  # fmt: skip
            (call,) = gw.close_episode("ep").calls
        finally:
            await _close_clients()
            await gw.aclose()
        assert 50 <= call.duration_ms < 200

    _run(main())
