"""One :class:`SamplingLimits` per run: read from the config once, handed unchanged to the
episode loop, the policy, the gateway and the stored record."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx
import pytest

from sandpiper.collector.episode.chat_policy import ChatEndpoint, ChatPolicy
from sandpiper.collector.episode.policy import TokenPolicy
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.gateway.openai_api import APIError
from sandpiper.collector.gateway.server import GATEWAY_MODEL_NAME, Gateway, GatewaySettings
from sandpiper.config import RunConfig, SamplingLimits
from sandpiper.config.sampling import NoRoom, ReplyRequest
from sandpiper.store.records import GroupSampling, StopReason
from sandpiper.testing import FAKE_TOOL_SCHEMAS, ScriptedPolicy

NON_DEFAULT = {
    "collector": {
        "max_turns": 3, "max_tokens_per_turn": 17, "max_episode_tokens": 99,
        "temperature": 0.5, "top_p": 0.9, "tool_parser": "bash_block",
        "max_argument_bytes": 4096, "system_prompt": "Be terse.", "gateway_sampling": "client",
    },
    "inference": {"max_model_len": 4096},
    "learner": {"algo": "sft"},  # GRPO refuses top_p < 1 (config/checks.py: check_scoring)
}  # fmt: skip


def test_every_limit_is_read_from_the_config():
    """A field that :meth:`SamplingLimits.from_config` forgot would keep its default."""
    limits = RunConfig.model_validate(NON_DEFAULT).for_collector().sampling
    default = SamplingLimits()
    for field in dataclasses.fields(SamplingLimits):
        assert getattr(limits, field.name) != getattr(default, field.name), field.name
    assert limits.context_limit == 4096 and limits.tool_format == "bash_block"


def test_the_defaults_are_the_configs():
    assert RunConfig().for_collector().sampling == SamplingLimits()


def test_the_gateway_and_the_record_take_the_same_limits():
    limits = RunConfig.model_validate(NON_DEFAULT).for_collector().sampling
    gateway = GatewaySettings.for_run(limits, run_id="r")
    assert gateway.sampling is limits and gateway.model_names == (GATEWAY_MODEL_NAME, "r")
    record = GroupSampling.from_limits(limits)
    for name in ("temperature", "top_p", "max_tokens_per_turn", "max_turns",
                 "max_episode_tokens", "context_limit", "tool_format"):  # fmt: skip
        assert getattr(record, name) == getattr(limits, name), name
    assert record.endpoint is None and record.model is None
    assert GroupSampling.from_json(record.to_json()) == record


# ---- the one per-turn cap: SamplingLimits.reply_request ----------------------------------

LIMITS = SamplingLimits(max_tokens_per_turn=50, max_episode_tokens=300, context_limit=1000)


def _cap(limits: SamplingLimits = LIMITS, **kw: Any) -> int:
    reply = limits.reply_request(**{"prompt_tokens": 100, "sampled_tokens": 0, **kw})
    assert isinstance(reply, ReplyRequest), reply
    return reply.max_tokens


def test_each_term_of_the_cap_binds_in_turn():
    assert _cap() == 50  # max_tokens_per_turn
    assert _cap(max_tokens=7) == 7  # the client's ask
    assert _cap(sampled_tokens=280) == 20  # max_episode_tokens - sampled so far
    assert _cap(prompt_tokens=990) == 10  # context_limit - prompt
    assert _cap(prompt_tokens=990, sampled_tokens=295, max_tokens=30) == 5  # the tightest
    assert _cap(prompt_tokens=995, sampled_tokens=290, max_tokens=3) == 3


def test_the_clients_ask_can_only_lower_the_cap():
    assert _cap(max_tokens=10_000) == 50
    assert _cap(max_tokens=10_000, prompt_tokens=980) == 20
    assert _cap(max_tokens=50) == _cap(max_tokens=51) == 50
    with pytest.raises(ValueError, match="max_tokens"):
        LIMITS.reply_request(prompt_tokens=1, sampled_tokens=0, max_tokens=0)


def test_the_episode_budget_is_the_runs_unless_the_caller_has_its_own():
    assert _cap(sampled_tokens=280, episode_budget=None) == 50  # a gateway episode with none
    assert _cap(sampled_tokens=280, episode_budget=290) == 10
    assert _cap(prompt_tokens=None, sampled_tokens=290) == 10  # no context term (chat policy)
    assert _cap(prompt_tokens=None, sampled_tokens=0) == 50


def test_no_room_is_a_clear_outcome_never_a_cap_below_one():
    full = LIMITS.reply_request(prompt_tokens=1000, sampled_tokens=0)
    assert full == NoRoom("context_exceeded", 1000)
    assert LIMITS.reply_request(prompt_tokens=2000, sampled_tokens=0) == full
    spent = LIMITS.reply_request(prompt_tokens=100, sampled_tokens=300)
    assert spent == NoRoom("max_tokens", 300)
    assert LIMITS.reply_request(prompt_tokens=None, sampled_tokens=400) == spent
    # both: the context is checked first (nothing more fits, whatever the budget)
    assert LIMITS.reply_request(prompt_tokens=1000, sampled_tokens=300) == full
    assert StopReason(full.reason) is StopReason.CONTEXT_EXCEEDED
    assert StopReason(spent.reason) is StopReason.MAX_TOKENS
    assert _cap(prompt_tokens=999, sampled_tokens=299) == 1


def test_a_clients_temperature_top_p_and_seed_count_only_when_the_run_honours_them():
    ask = {"prompt_tokens": 1, "sampled_tokens": 0, "temperature": 0.3, "top_p": 0.5, "seed": 9}
    run = SamplingLimits(temperature=0.7, top_p=0.9).reply_request(**ask)
    assert run == ReplyRequest(max_tokens=256, temperature=0.7, top_p=0.9, seed=None)
    client = SamplingLimits(temperature=0.7, top_p=0.9, gateway_sampling="client")
    assert client.reply_request(**ask) == ReplyRequest(256, 0.3, 0.5, 9)
    assert client.reply_request(prompt_tokens=1, sampled_tokens=0) == ReplyRequest(256, 0.7, 0.9)


def test_the_token_policy_the_chat_policy_and_the_gateway_ask_with_the_one_cap(
    tiny_tokenizer, monkeypatch
):
    """Each caller asks ``reply_request`` and sends its cap: with a prompt of the same
    length all three send the same, the context's room here (the chat policy does not know
    its prompt's length: no context term)."""
    asked: list[ReplyRequest | NoRoom] = []
    real = SamplingLimits.reply_request

    def spy(self: SamplingLimits, **kw: Any) -> ReplyRequest | NoRoom:
        asked.append(real(self, **kw))
        return asked[-1]

    monkeypatch.setattr(SamplingLimits, "reply_request", spy)
    renderer = ChatRenderer(tiny_tokenizer, FAKE_TOOL_SCHEMAS)
    messages = [{"role": "user", "content": "go"}]
    prompt = renderer.prompt_ids(messages)
    limits = SamplingLimits(max_tokens_per_turn=64, context_limit=len(prompt) + 5)

    client = ScriptedPolicy(tiny_tokenizer, ["hello there"])
    session = TokenPolicy(client, renderer).session(messages, limits)
    asyncio.run(session.reply())
    assert client.params[0].max_tokens == asked[-1].max_tokens == 5  # type: ignore[union-attr]

    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        choice = {"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        return httpx.Response(200, json={"choices": [choice], "usage": {"completion_tokens": 1}})

    endpoint = ChatEndpoint("http://x", "m", transport=httpx.MockTransport(handler))
    asyncio.run(ChatPolicy(endpoint, FAKE_TOOL_SCHEMAS).session(messages, limits).reply())
    assert seen[0]["max_tokens"] == asked[-1].max_tokens == 64  # type: ignore[union-attr]

    policy = ScriptedPolicy(tiny_tokenizer, ["hello there"])
    gateway = Gateway(client=policy, renderer=renderer,
                      settings=GatewaySettings(model_names=("m",), sampling=limits))  # fmt: skip
    gateway.open_episode("e")
    body = {"model": "m", "messages": messages, "tools": FAKE_TOOL_SCHEMAS, "max_tokens": 100}
    asyncio.run(gateway.call("e", body))
    assert policy.params[0].max_tokens == asked[-1].max_tokens  # type: ignore[union-attr]
    assert len(policy.prompts[0]) == len(prompt) and policy.params[0].max_tokens == 5
    assert len(asked) == 3


def test_the_gateway_caps_by_its_episodes_budget_and_refuses_a_call_with_no_room(
    tiny_tokenizer,
):
    renderer = ChatRenderer(tiny_tokenizer, FAKE_TOOL_SCHEMAS)
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}]}

    async def main(limits: SamplingLimits, budget: int, calls: int) -> Any:
        policy = ScriptedPolicy(tiny_tokenizer, ["one two three four five six seven"] * 3)
        gateway = Gateway(client=policy, renderer=renderer,
                          settings=GatewaySettings(model_names=("m",), sampling=limits))  # fmt: skip
        gateway.open_episode("e", max_completion_tokens=budget)
        for _ in range(calls):
            await gateway.call("e", body)
        with pytest.raises(APIError) as refused:
            await gateway.call("e", body)
        return policy, gateway.close_episode("e"), refused.value

    policy, session, refused = asyncio.run(main(SamplingLimits(max_tokens_per_turn=6), 10, 2))
    assert [p.max_tokens for p in policy.params] == [6, 4]  # the per-turn cap, then the budget
    assert refused.code == "episode_budget_exhausted" and refused.status == 400
    assert session.budget_spent is StopReason.MAX_TOKENS

    # a full context is the answer when the budget is spent too (checked first)
    policy, session, refused = asyncio.run(main(SamplingLimits(context_limit=16), 0, 0))
    assert refused.code == "context_length_exceeded" and session.budget_spent is None
    assert policy.prompts == []
