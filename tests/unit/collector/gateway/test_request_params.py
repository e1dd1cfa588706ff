"""The parameters clients send, with the real ``openai`` client against the in-process gateway
and a scripted policy: stop strings, logprobs, seed/temperature per the run's sampling
policy, parallel_tool_calls, fields that change nothing, the request log; and the vLLM
request and answer those fields become."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import openai
import pytest

from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.gateway.assembly import assemble
from sandpiper.collector.gateway.request_params import RequestParams, cut_at_stop
from sandpiper.collector.gateway.server import Gateway, GatewaySettings
from sandpiper.collector.inference.base import Generation, SamplingParams
from sandpiper.collector.inference.vllm_client import _to_generation, generate_body
from sandpiper.config import SamplingLimits
from sandpiper.config.sampling import ReplyRequest
from sandpiper.store.records import ToolErrorKind
from sandpiper.testing import FAKE_TOOL_SCHEMAS, ScriptedPolicy

MODEL = "policy"
USER = [{"role": "user", "content": "go"}]
BASH_LS = '<tool_call>\n{"name": "execute_bash", "arguments": {"command": "ls"}}\n</tool_call>'


async def _serve(tokenizer, replies, **settings):
    policy = ScriptedPolicy(tokenizer, replies, version=3)
    renderer = ChatRenderer(tokenizer, FAKE_TOOL_SCHEMAS)
    gw = Gateway(client=policy, renderer=renderer,
                 settings=GatewaySettings(model_names=(MODEL,), sampling=SamplingLimits(**settings)))  # fmt: skip
    await gw.serve()
    client = openai.AsyncOpenAI(base_url=gw.open_episode("e"), api_key="x", max_retries=0)
    return gw, policy, renderer, client


async def _done(gw, client):
    session = gw.close_episode("e")
    await session.settle()
    await client.close()
    await gw.aclose()
    return session


def test_a_stop_string_ends_the_reply_and_its_tokens_are_recorded(tiny_tokenizer):
    async def main():
        gw, policy, renderer, client = await _serve(tiny_tokenizer, ["one two END three", "ok"])
        r1 = await client.chat.completions.create(model=MODEL, messages=USER, stop=["END"])
        messages = [*USER, r1.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "more"}]  # fmt: skip
        await client.chat.completions.create(model=MODEL, messages=messages, stop="END")
        return r1, await _done(gw, client), policy, renderer

    r1, session, policy, renderer = asyncio.run(main())
    assert r1.choices[0].message.content == "one two "
    assert r1.choices[0].finish_reason == "stop"
    assert policy.params[0].stop == ("END",)
    first, second = session.calls
    # the sampled ids are kept up to the token that completes the stop string, no further
    assert renderer.decode(first.generation.token_ids_T.tolist()) == "one two END"
    assert first.text == "one two END" and len(first.generation.logprobs_T) == len(
        first.generation.token_ids_T
    )
    # the agent's echo of the cut reply extends token for token (the stop text stays as sampled)
    assert second.extends
    sampled = first.generation.token_ids_T.tolist()
    assert policy.prompts[1] == [*policy.prompts[0], *sampled, *second.delta_ids]


def test_cut_at_stop_leaves_a_reply_without_the_string_alone(tiny_tokenizer):
    ids = tiny_tokenizer.encode("alpha beta", add_special_tokens=False)
    g = Generation(np.asarray(ids), np.zeros(len(ids)), np.zeros(len(ids)), "length")
    decode = lambda t: tiny_tokenizer.decode(list(t))  # noqa: E731
    assert cut_at_stop(g, ("gamma",), decode) == (g, None)
    cut, at = cut_at_stop(g, ("beta", "alp"), decode)
    assert at == 0 and cut.finish_reason == "stop"  # the earliest string wins
    assert decode(cut.token_ids_T.tolist()).startswith("alp")


def test_logprobs_and_top_logprobs_come_from_the_sample(tiny_tokenizer):
    async def main():
        gw, policy, _, client = await _serve(tiny_tokenizer, ["hi there"] * 3)
        plain = await client.chat.completions.create(
            model=MODEL, messages=USER, logprobs=True, top_logprobs=2
        )
        chunks = [
            c async for c in await client.chat.completions.create(
                model=MODEL, messages=USER, logprobs=True, stream=True
            )
        ]  # fmt: skip
        legacy = await client.completions.create(model=MODEL, prompt="say hi", logprobs=1)
        return plain, chunks, legacy, await _done(gw, client), policy

    plain, chunks, legacy, session, policy = asyncio.run(main())
    content = plain.choices[0].logprobs.content
    sampled = session.calls[0].generation
    assert [c.logprob for c in content] == pytest.approx(sampled.logprobs_T.tolist())
    assert "".join(c.token for c in content) == session.calls[0].text
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(-0.5)
    assert policy.params[0].top_logprobs == 2 and policy.params[1].top_logprobs == 0
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]  # fmt: skip
    assert len(streamed) == len(session.calls[1].generation.token_ids_T)
    assert legacy.choices[0].logprobs.token_logprobs == pytest.approx(
        session.calls[2].generation.logprobs_T.tolist()
    )
    assert all(len(top) == 1 for top in legacy.choices[0].logprobs.top_logprobs)


@pytest.mark.parametrize(
    ("extra", "param", "why"),
    [
        ({"seed": 7}, "seed", "GRPO group"),
        ({"temperature": 0.2}, "temperature", "collector.temperature"),
        ({"top_p": 0.5}, "top_p", "collector.top_p"),
    ],
)
def test_the_run_policy_refuses_other_sampling_and_says_why(tiny_tokenizer, extra, param, why):
    async def main():
        gw, policy, _, client = await _serve(tiny_tokenizer, ["never"])
        try:
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model=MODEL, messages=USER, **extra)
            return e.value, policy
        finally:
            await _done(gw, client)

    error, policy = asyncio.run(main())
    assert error.body["param"] == param and why in error.body["message"]
    assert policy.prompts == []


def test_the_runs_own_values_pass_and_the_client_policy_honours_the_request(tiny_tokenizer):
    async def main():
        gw, policy, _, client = await _serve(tiny_tokenizer, ["a", "b"], temperature=0.7)
        await client.chat.completions.create(model=MODEL, messages=USER, temperature=0.7)
        await _done(gw, client)
        gw, policy2, _, client = await _serve(tiny_tokenizer, ["c"], gateway_sampling="client")
        await client.chat.completions.create(
            model=MODEL, messages=USER, temperature=0.2, top_p=0.9, seed=11
        )
        await _done(gw, client)
        return policy.params, policy2.params

    run_params, client_params = asyncio.run(main())
    assert (run_params[0].temperature, run_params[0].seed) == (0.7, None)
    assert (client_params[0].temperature, client_params[0].top_p) == (0.2, 0.9)
    assert client_params[0].seed == 11


def test_parallel_tool_calls_false_returns_one_call_and_records_the_rest(tiny_tokenizer):
    two = BASH_LS + "\n" + BASH_LS.replace("ls", "pwd")

    async def main():
        gw, _, renderer, client = await _serve(tiny_tokenizer, [two, two])
        one = await client.chat.completions.create(
            model=MODEL, messages=USER, tools=FAKE_TOOL_SCHEMAS, parallel_tool_calls=False
        )
        both = await client.chat.completions.create(
            model=MODEL, messages=USER, tools=FAKE_TOOL_SCHEMAS
        )
        return one, both, await _done(gw, client), renderer

    one, both, session, renderer = asyncio.run(main())
    assert len(one.choices[0].message.tool_calls) == 1
    assert len(both.choices[0].message.tool_calls) == 2
    turns, _ = assemble(session.calls, renderer.decode)
    kinds = [c.error_kind for c in turns[1].tool_calls]
    assert kinds == [ToolErrorKind.NONE, ToolErrorKind.FORMAT_ERROR]


def test_a_call_to_an_undeclared_tool_is_the_models_error_not_the_clients(tiny_tokenizer):
    reply = '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'

    async def main():
        gw, _, renderer, client = await _serve(tiny_tokenizer, [reply])
        r = await client.chat.completions.create(
            model=MODEL, messages=USER, tools=FAKE_TOOL_SCHEMAS
        )
        return r, await _done(gw, client), renderer

    r, session, renderer = asyncio.run(main())
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert "launch_rockets" in r.choices[0].message.content
    turns, _ = assemble(session.calls, renderer.decode)
    (call,) = turns[1].tool_calls
    assert (call.name, call.error_kind) == ("launch_rockets", ToolErrorKind.UNKNOWN_TOOL)


def test_fields_that_change_nothing_are_accepted_and_logged_once(tiny_tokenizer, caplog):
    extra = dict(
        user="u1", metadata={"k": "v"}, prompt_cache_key="c", safety_identifier="s",
        extra_body={"verbosity": "low", "top_k": 20, "frobnicate_xyz": 1},
    )  # fmt: skip

    async def main():
        gw, _, _, client = await _serve(tiny_tokenizer, ["a", "b"])
        for _ in range(2):
            r = await client.chat.completions.create(model=MODEL, messages=USER, **extra)
            assert r.choices[0].message.content
        await _done(gw, client)

    with caplog.at_level(logging.DEBUG, logger="sandpiper.collector.gateway"):
        asyncio.run(main())
    noted = [r.getMessage() for r in caplog.records if "logged once" in r.getMessage()]
    assert sum("'frobnicate_xyz'" in m for m in noted) == 1
    assert sum("'top_k'" in m for m in noted) <= 1  # once per process (another test may log it)
    requests = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert (
        sum(m.startswith("episode e: POST /episodes/e/v1/chat/completions") for m in requests) == 2
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stop": ["", "x"]}, "stop"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
        ({"temperature": "hot"}, "temperature"),
        ({"seed": True}, "seed"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"stop": ["s"] * 17}, "stop"),
    ],
)
def test_malformed_sampling_fields_are_named_in_a_400(tiny_tokenizer, body, param):
    async def main():
        gw, policy, _, client = await _serve(tiny_tokenizer, ["never"])
        try:
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model=MODEL, messages=USER, extra_body=body)
            return e.value, policy
        finally:
            await _done(gw, client)

    error, policy = asyncio.run(main())
    assert error.body["param"] == param and policy.prompts == []


def test_the_vllm_request_and_answer_carry_stop_strings_and_top_logprobs():
    reply = SamplingLimits().reply_request(prompt_tokens=3, sampled_tokens=0, max_tokens=8)
    assert isinstance(reply, ReplyRequest)
    params = RequestParams(stop=("END",), logprobs=True, top_logprobs=2).sampling_params(
        reply, stop_token_ids=(2,)
    )
    sent = generate_body([1, 2, 3], params)["sampling_params"]
    assert sent["stop"] == ["END"] and sent["detokenize"] is True and sent["logprobs"] == 2
    assert "stop" not in generate_body([1], SamplingParams(max_tokens=1))["sampling_params"]
    payload = {"choices": [{"token_ids": [5, 6], "finish_reason": "stop", "logprobs": {
        "content": [
            {"token_id": 5, "logprob": -2.0, "top_logprobs": [
                {"token_id": 5, "logprob": -2.0}, {"token_id": 9, "logprob": -0.1},
                {"token_id": 4, "logprob": -1.0}]},
            {"token_id": 6, "logprob": -0.2, "top_logprobs": [
                {"token_id": 6, "logprob": -0.2}, {"token_id": 7, "logprob": -3.0}]},
        ]}}]}  # fmt: skip
    g = _to_generation(payload, "u", 0, 2)
    assert g.top_logprobs == (((9, -0.1), (4, -1.0)), ((6, -0.2), (7, -3.0)))
    assert _to_generation(payload, "u", 0).top_logprobs is None
    assert g.logprobs_T.tolist() == pytest.approx([-2.0, -0.2])
