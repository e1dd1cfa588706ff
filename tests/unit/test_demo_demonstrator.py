"""The demo's scripted demonstrator answers like a policy that always samples the right call."""

from __future__ import annotations

import asyncio

import pytest

from collector.demo_tasks import DEMO_TOOLS, SYSTEM_PROMPT, command, instruction
from collector.inference.base import SamplingParams
from collector.parsers import parse_tool_calls
from collector.render import ChatRenderer
from collector.tools import TOOL_SCHEMAS
from sandpiper.demo import Demonstrator
from sandpiper.errors import SandpiperError

PARAMS = SamplingParams(max_tokens=64)


def _renderer(tokenizer) -> ChatRenderer:
    tools = [t for t in TOOL_SCHEMAS if t["function"]["name"] in DEMO_TOOLS]
    return ChatRenderer(tokenizer, tools)


@pytest.mark.parametrize("op", ["median", "product"])
def test_runs_the_named_operation_then_submits(tiny_tokenizer, op: str) -> None:
    renderer = _renderer(tiny_tokenizer)
    demonstrator = Demonstrator(tiny_tokenizer)
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": instruction(op)},
    ]
    context = renderer.prompt_ids(messages)
    first = asyncio.run(demonstrator.generate(context, PARAMS))
    assert first.finish_reason == "stop"
    assert first.token_ids_T[-1] == renderer.stop_token_ids[0]
    assert len(first.logprobs_T) == len(first.policy_versions_T) == len(first.token_ids_T)
    call = parse_tool_calls(renderer.decode(first.token_ids_T)).tool_calls[0]
    assert (call.name, call.arguments) == ("execute_bash", {"command": command(op)})

    context += [*first.token_ids_T.tolist()]
    context += renderer.tool_delta_ids([{"role": "tool", "name": "execute_bash", "content": ""}])
    second = asyncio.run(demonstrator.generate(context, PARAMS))
    call = parse_tool_calls(renderer.decode(second.token_ids_T)).tool_calls[0]
    assert (call.name, call.arguments) == ("submit", {})


def test_refuses_prompts_that_are_not_demo_tasks(tiny_tokenizer) -> None:
    ids = _renderer(tiny_tokenizer).prompt_ids([{"role": "user", "content": "Fix the bug."}])
    with pytest.raises(SandpiperError, match="demo tasks"):
        asyncio.run(Demonstrator(tiny_tokenizer).generate(ids, PARAMS))
