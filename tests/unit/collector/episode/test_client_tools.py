"""A client's own tools in the plain-text ``bash_block`` format: described in the prompt,
parsed back as those tools, undeclared ones recorded as the model's error; the OpenAI
Agents SDK (chat completions model) runs its function tools through the gateway."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from sandpiper.collector.episode.client_tools import client_calls, plain_history, tools_prompt
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.gateway.assembly import assemble
from sandpiper.collector.gateway.server import Gateway, GatewaySettings
from sandpiper.config import SamplingLimits
from sandpiper.store.records import Role, ToolErrorKind
from sandpiper.testing import FAKE_TOOL_SCHEMAS, ScriptedPolicy

MODEL = "policy"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}  # fmt: skip
SHELL = {
    "type": "function",
    "function": {"name": "shell", "description": "Run a command.",
                 "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
}  # fmt: skip
CALL = 'Let me look.\n\n```get_weather\n{"city": "Paris"}\n```'


async def _serve(tokenizer, replies):
    policy = ScriptedPolicy(tokenizer, replies)
    renderer = ChatRenderer(tokenizer, FAKE_TOOL_SCHEMAS, action_format="bash_block")
    gw = Gateway(client=policy, renderer=renderer,
                 settings=GatewaySettings(model_names=(MODEL,), sampling=SamplingLimits(tool_format="bash_block")))  # fmt: skip
    await gw.serve()
    return gw, policy, renderer


def test_plain_text_calls_are_parsed_as_the_declared_tools():
    parsed = client_calls(CALL + "\n```shell\nls -l /\n```", "bash_block", [WEATHER, SHELL])
    assert parsed.content == "Let me look."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("shell", {"cmd": "ls -l /"})]  # fmt: skip
    (bash,) = client_calls("```bash\nls\n```", "bash_block", [WEATHER]).tool_calls
    assert bash.error_kind is ToolErrorKind.UNKNOWN_TOOL and "get_weather" in bash.error
    (raw,) = client_calls("```get_weather\nParis\n```", "bash_block", [WEATHER]).tool_calls
    assert raw.arguments == {"city": "Paris"}  # its only parameter is a string: the text
    two = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "string"}, "y": {"type": "string"}},
            },
        },
    }
    (bad,) = client_calls("```move\nleft\n```", "bash_block", [two]).tool_calls
    assert bad.error_kind is ToolErrorKind.BAD_JSON and bad.arguments is None
    answer = client_calls("It is sunny.", "bash_block", [WEATHER])
    assert answer.tool_calls == () and answer.content == "It is sunny."
    big = client_calls('```get_weather\n{"city": "' + "x" * 99 + '"}\n```', "bash_block",
                       [WEATHER], max_argument_bytes=50)  # fmt: skip
    assert big.tool_calls[0].error_kind is ToolErrorKind.ARGUMENTS_TOO_LARGE


def test_the_history_renders_back_as_the_model_wrote_it():
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
    ]  # fmt: skip
    out = plain_history(messages, [WEATHER])
    assert out[0]["content"] == "sys\n\n" + tools_prompt([WEATHER])
    assert out[2] == {"role": "assistant", "content": CALL}
    assert out[3] == {"role": "user", "content": "<output>\nsunny\n</output>"}


def test_bash_block_gateway_renders_parses_and_extends_with_client_tools(tiny_tokenizer):
    async def main():
        gw, policy, renderer = await _serve(tiny_tokenizer, [CALL, "```bash\nls\n```"])
        try:
            client = openai.AsyncOpenAI(base_url=gw.open_episode("e"), api_key="x")
            messages = [{"role": "user", "content": "weather in Paris?"}]
            r1 = await client.chat.completions.create(model=MODEL, messages=messages,
                                                      tools=[WEATHER])  # fmt: skip
            (call,) = r1.choices[0].message.tool_calls
            messages += [r1.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]  # fmt: skip
            r2 = await client.chat.completions.create(model=MODEL, messages=messages,
                                                      tools=[WEATHER])  # fmt: skip
            await client.close()
            session = gw.close_episode("e")
            await session.settle()
            return r1, r2, session, policy, renderer
        finally:
            await gw.aclose()

    r1, r2, session, policy, renderer = asyncio.run(main())
    first_prompt = renderer.decode(policy.prompts[0])
    assert "get_weather" in first_prompt and "execute_bash" not in first_prompt
    (call,) = r1.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                         {"city": "Paris"})  # fmt: skip
    assert r1.choices[0].finish_reason == "tool_calls"
    # ```bash is not one of this client's tools: text for the client, an error in the record
    assert r2.choices[0].message.tool_calls is None and "ls" in r2.choices[0].message.content
    _first, second = session.calls
    assert second.extends and not second.retokenized_differs
    assert "<output>\nsunny\n</output>" in renderer.decode(second.delta_ids)
    turns, stats = assemble(session.calls, renderer.decode)
    assert stats.segments == 1
    assert turns[1].tool_calls[0].output == "sunny"
    assert [t.role for t in turns] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
    assert turns[3].tool_calls[0].error_kind is ToolErrorKind.UNKNOWN_TOOL


def test_the_agents_sdk_runs_its_own_tools_in_bash_block(tiny_tokenizer):
    agents = pytest.importorskip("agents")  # openai-agents: a dev dependency
    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "sunny"

    async def main(replies):
        gw, _policy, _ = await _serve(tiny_tokenizer, replies)
        try:
            client = openai.AsyncOpenAI(base_url=gw.open_episode("e"), api_key="x")
            model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
            agent = agents.Agent(name="w", instructions="Answer.", tools=[get_weather],
                                 model=model)  # fmt: skip
            result = await agents.Runner.run(agent, "Weather in Paris?")
            await client.close()
            session = gw.close_episode("e")
            return result, session
        finally:
            await gw.aclose()

    result, session = asyncio.run(main([CALL, "It is sunny in Paris."]))
    assert seen == ["Paris"] and result.final_output == "It is sunny in Paris."
    assert len(session.calls) == 2 and session.calls[1].extends
    # the native protocol's block names no tool of this agent: its answer, not a crash
    result, session = asyncio.run(main(["```bash\nls\n```"]))
    assert "ls" in result.final_output
    assert session.calls[0].tool_calls[0].error_kind is ToolErrorKind.UNKNOWN_TOOL
