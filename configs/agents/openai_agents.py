"""One episode of an OpenAI Agents SDK agent (PyPI ``openai-agents``) with its default
settings: ``Runner.run`` on the Responses API, the model client built from ``OPENAI_BASE_URL``
and ``OPENAI_API_KEY`` (the episode's gateway URL and token, set by the collector).

A task uses it with ``"agent_command": "python /ABS/PATH/configs/agents/openai_agents.py"``
(docs/gateway.md, Agents). Its one tool, ``bash``, runs the command in the episode's podman
sandbox through the gateway's exec route (:mod:`sandpiper.collector.gateway.exec_client`), so
nothing the model asks for runs on the collector's host. Tracing is off: it would upload
traces to OpenAI, which an offline run cannot reach (and need not).
"""

from __future__ import annotations

import asyncio
import os

import agents

from sandpiper.collector.gateway import exec_client

MAX_TURNS = 4
"""Model calls per episode; the run's own max_turns refuses calls past its budget too."""


@agents.function_tool
def bash(command: str) -> str:
    """Run a shell command in the task's sandbox (cwd /workspace); returns its exit status
    and output."""
    result = exec_client.run(command)
    return f"exit status {result['returncode']}\n{result['output']}"


async def main() -> None:
    agents.set_tracing_disabled(True)
    agent = agents.Agent(
        name="sandpiper",
        instructions="You are an agent in a Linux sandbox. Use the bash tool, one command "
        "per turn; when you are done, answer with a short summary.",
        tools=[bash],
        model=os.environ["SANDPIPER_MODEL"],
    )
    try:
        result = await agents.Runner.run(agent, os.environ["SANDPIPER_TASK"], max_turns=MAX_TURNS)
    except agents.MaxTurnsExceeded:
        print(f"stopped after {MAX_TURNS} turns")
        return
    print(result.final_output)


if __name__ == "__main__":
    asyncio.run(main())
