"""One episode of an OpenAI Agents SDK agent (PyPI ``openai-agents``) with its default
settings: ``Runner.run`` on the Responses API, the model client built from ``OPENAI_BASE_URL``
and ``OPENAI_API_KEY`` (the episode's gateway URL and token, set by the collector).

A task uses it with ``"agent_command": "python /ABS/PATH/configs/agents/openai_agents.py"``
(docs/gateway.md, Agents). Its one tool, ``bash``, runs the command in the episode's podman
sandbox through the gateway's exec route (:mod:`sandpiper.collector.gateway.exec_client`), so
nothing the model asks for runs on the collector's host. With ``--mcp`` its tools are instead
the episode sandbox's own (``execute_bash``, ``str_replace_editor``, ``submit``), served by the
gateway's MCP route (``SANDPIPER_MCP_URL``) through the SDK's ``MCPServerStreamableHttp``.
Tracing is off: it would upload traces to OpenAI, which an offline run cannot reach (and need
not).
"""

from __future__ import annotations

import asyncio
import os
import sys

import agents

from sandpiper.collector.gateway import exec_client

MAX_TURNS = 6
"""Model calls per episode; the run's own max_turns refuses calls past its budget too."""


@agents.function_tool
def bash(command: str) -> str:
    """Run a shell command in the task's sandbox (cwd /workspace); returns its exit status
    and output."""
    result = exec_client.run(command)
    return f"exit status {result['returncode']}\n{result['output']}"


MCP_TIMEOUT_S = 600.0
"""A tool call's limit: ``submit`` runs the task's tests (``collector.test_timeout_s``)."""


async def main(over_mcp: bool) -> None:
    agents.set_tracing_disabled(True)
    if not over_mcp:
        await run(tools=[bash], mcp_servers=[], what="the bash tool")
        return
    from agents.mcp import MCPServerStreamableHttp

    params = {"url": os.environ["SANDPIPER_MCP_URL"], "sse_read_timeout": MCP_TIMEOUT_S}
    async with MCPServerStreamableHttp(
        params=params, name="sandbox", client_session_timeout_seconds=MCP_TIMEOUT_S
    ) as sandbox:
        await run(tools=[], mcp_servers=[sandbox], what="the sandbox's tools")


async def run(*, tools: list, mcp_servers: list, what: str) -> None:
    agent = agents.Agent(
        name="sandpiper",
        instructions=f"You are an agent in a Linux sandbox. Use {what}, one call per turn; "
        "when you are done, answer with a short summary.",
        tools=tools,
        mcp_servers=mcp_servers,
        model=os.environ["SANDPIPER_MODEL"],
    )
    try:
        result = await agents.Runner.run(agent, os.environ["SANDPIPER_TASK"], max_turns=MAX_TURNS)
    except agents.MaxTurnsExceeded:
        print(f"stopped after {MAX_TURNS} turns")
        return
    print(result.final_output)


if __name__ == "__main__":
    asyncio.run(main(over_mcp="--mcp" in sys.argv[1:]))
