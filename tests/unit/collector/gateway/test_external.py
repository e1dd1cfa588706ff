"""External-agent episodes: a real agent process (a script using the ``openai`` client and the
exec shim) talks to the gateway; its episode has the native record shape. The sandbox and the
grader are fakes here (tests/integration/collector/gateway/test_external_mini_swe_agent.py runs podman and vLLM)."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import numpy as np
import pytest

from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.episode.tools.base import ToolResult
from sandpiper.collector.gateway.external import run_external_episode
from sandpiper.collector.gateway.server import Gateway, GatewaySettings
from sandpiper.collector.tasks.model import Task
from sandpiper.config import SamplingLimits
from sandpiper.store.records import Role, StopReason, ToolErrorKind
from sandpiper.testing import (
    FAKE_TOOL_SCHEMAS,
    FakeToolbox,
    ScriptedPolicy,
    scripted_sandbox,
)

BASH_LS = '<tool_call>\n{"name": "execute_bash", "arguments": {"command": "ls"}}\n</tool_call>'

AGENT = textwrap.dedent(
    """
    import json, os, sys
    import openai
    from sandpiper.collector.gateway.exec_client import run
    client = openai.OpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    model = os.environ["SANDPIPER_MODEL"]
    tools = json.loads(sys.argv[1])
    messages = [{"role": "user", "content": os.environ["SANDPIPER_TASK"]}]
    for _ in range(int(sys.argv[2])):
        r = client.chat.completions.create(model=model, messages=messages, tools=tools)
        m = r.choices[0].message
        messages.append(m.model_dump(exclude_none=True))
        if not m.tool_calls:
            break
        for tc in m.tool_calls:
            out = run(json.loads(tc.function.arguments)["command"])["output"]
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": out})
    if sys.argv[3] == "hang":
        import time
        time.sleep(3600)
    sys.exit(int(sys.argv[3]))
    """
)


def _episode(tokenizer, replies, *, calls=2, exit_code=0, timeout_s=60.0, limits=None,
             toolbox_type=FakeToolbox):  # fmt: skip
    import json

    task = Task(
        "ext",
        "List the files.",
        {
            "reward": "tests",
            "agent_command": [sys.executable, "-c", AGENT, json.dumps(FAKE_TOOL_SCHEMAS),
                              str(calls), str(exit_code)],
            "agent_timeout_s": timeout_s,
        },
        "unit",
        "jsonl",
    )  # fmt: skip
    policy = ScriptedPolicy(tokenizer, replies, version=4)
    renderer = ChatRenderer(tokenizer, FAKE_TOOL_SCHEMAS)
    sandbox = scripted_sandbox()
    toolbox = toolbox_type(sandbox, test_reward=1.0)
    limits = limits or SamplingLimits()

    async def main():
        gw = Gateway(
            client=policy, renderer=renderer,
            settings=GatewaySettings(model_names=("policy",)),
        )  # fmt: skip
        await gw.serve()
        try:
            return await run_external_episode(
                episode_id="e1", sample_index=0, task=task, gateway=gw, sandbox=sandbox,
                toolbox=toolbox, limits=limits,
            )  # fmt: skip
        finally:
            await gw.aclose()

    return asyncio.run(main()), sandbox, toolbox


def test_an_agent_episode_has_the_native_shape(tiny_tokenizer):
    episode, _, toolbox = _episode(tiny_tokenizer, [BASH_LS, "done"])
    assert episode.stop_reason is StopReason.SUBMITTED and episode.valid
    assert episode.reward == 1.0  # graded by the task's tests after the agent exited
    assert [t.role for t in episode.turns] == [
        Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT,
    ]  # fmt: skip
    assert "ran: ls" in episode.turns[1].tool_calls[0].output  # the sandbox ran the command
    assert ("execute_bash", {"command": "ls"}) in toolbox.calls
    assert toolbox.calls[-1][0] == "submit"
    assert episode.reward_breakdown["gateway"]["segments"] == 1
    assert episode.policy_version_range == (4, 4)


def test_a_crashing_agent_keeps_its_calls_and_is_graded(tiny_tokenizer):
    episode, _, _ = _episode(tiny_tokenizer, [BASH_LS, "done"], exit_code=3)
    assert episode.stop_reason is StopReason.AGENT_ERROR and episode.valid
    assert "status 3" in episode.error
    assert sum(t.role is Role.ASSISTANT for t in episode.turns) == 2


def test_an_agent_that_never_reaches_the_model_is_infra(tiny_tokenizer):
    episode, _, _ = _episode(tiny_tokenizer, [], calls=0, exit_code=2)
    assert episode.stop_reason is StopReason.INFRA_ERROR and not episode.valid


def test_a_hanging_agent_is_killed_at_its_time_limit(tiny_tokenizer):
    # 10 s: the agent is a fresh Python process that imports its client and makes two calls
    # before it hangs; 3 s was too short for that on a loaded 2-core machine.
    episode, _, _ = _episode(tiny_tokenizer, [BASH_LS, "done"], calls=2, exit_code="hang",
                             timeout_s=10.0)  # fmt: skip
    assert episode.stop_reason is StopReason.TIME_LIMIT and episode.valid
    assert sum(t.role is Role.ASSISTANT for t in episode.turns) == 2  # its calls are kept
    assert episode.duration_ms < 40_000


def test_the_turn_budget_ends_the_episode(tiny_tokenizer):
    episode, _, _ = _episode(
        tiny_tokenizer, [BASH_LS] * 10, calls=10, limits=SamplingLimits(max_turns=2)
    )
    assert episode.stop_reason is StopReason.MAX_TURNS and episode.valid
    assert sum(t.role is Role.ASSISTANT for t in episode.turns) == 2


MINI = (
    'python -m minisweagent.run.mini -c {config} -m openai/policy -t "$SANDPIPER_TASK" '
    "-y --exit-immediately -o traj.json"
)


def test_mini_swe_agent_unmodified_through_the_gateway(tiny_tokenizer, repo_root):
    """mini-swe-agent (PyPI) as it ships, with the shipped example config: its calls extend
    token for token (one segment), its commands reach the sandbox."""
    import pytest

    pytest.importorskip("minisweagent")
    ls = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    done = ('<tool_call>\n{"name": "bash", "arguments": {"command": '
            '"echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}}\n</tool_call>')  # fmt: skip
    config = repo_root / "configs/agents/mini_swe_agent.yaml"
    task = Task(
        "mini", "List the files.",
        {"reward": "tests", "agent_command": ["sh", "-c", MINI.format(config=config)],
         "agent_timeout_s": 120, "agent_env": {"MSWEA_CONFIGURED": "true"}},
        "unit", "jsonl",
    )  # fmt: skip
    policy = ScriptedPolicy(tiny_tokenizer, [ls, done, "no action"], version=2)
    sandbox = scripted_sandbox()

    async def main():
        gw = Gateway(client=policy, renderer=ChatRenderer(tiny_tokenizer, FAKE_TOOL_SCHEMAS),
                     settings=GatewaySettings(model_names=("policy",)))  # fmt: skip
        await gw.serve()
        try:
            return await run_external_episode(
                episode_id="m", sample_index=0, task=task, gateway=gw, sandbox=sandbox,
                toolbox=FakeToolbox(sandbox, test_reward=0.0), limits=SamplingLimits(),
            )  # fmt: skip
        finally:
            await gw.aclose()

    episode = asyncio.run(main())
    assert episode.valid and episode.stop_reason is StopReason.SUBMITTED, episode.error
    stats = episode.reward_breakdown["gateway"]
    assert stats["calls"] == 3 and stats["segments"] == 1
    assert any(c.endswith("ls") for c in sandbox.commands)  # its command ran in the sandbox
    # the stored sequence is exactly what the model was sent and sampled
    ids = np.concatenate([t.token_ids_T for t in episode.turns]).tolist()
    assert ids[: len(policy.prompts[-1])] == policy.prompts[-1]


@pytest.mark.parametrize(
    ("kind", "stop", "valid"),
    [(ToolErrorKind.SANDBOX_DIED, StopReason.SANDBOX_DIED, True),
     (ToolErrorKind.SANDBOX_LOST, StopReason.SANDBOX_LOST, False)],
)  # fmt: skip
def test_a_sandbox_broken_while_grading_is_graded_unless_the_host_lost_it(
    tiny_tokenizer, kind, stop, valid
):
    """docs/security.md, outcome classes: the external agent's own doing is graded (0)."""

    class Breaking(FakeToolbox):
        async def call(self, name, arguments):
            if name == "submit":
                return ToolResult("Error: the sandbox failed", kind, submitted=True)
            return await super().call(name, arguments)

    episode, _, _ = _episode(tiny_tokenizer, [BASH_LS, "done"], toolbox_type=Breaking)
    assert episode.stop_reason is stop and episode.valid is valid
    assert episode.reward == (0.0 if valid else None)


def test_an_external_agents_oversized_command_is_refused_and_never_run():
    """The gateway's ``/exec`` takes commands not parsed from model text: they meet the same
    byte limit as a native call (``SamplingLimits.max_argument_bytes``) before the toolbox."""
    from sandpiper.collector.gateway.external import _exec_via

    sandbox = scripted_sandbox()
    toolbox = FakeToolbox(sandbox)
    run = _exec_via(toolbox, 100)
    refused = asyncio.run(run("echo " + "x" * 200, 5.0))
    assert refused["error_kind"] == str(ToolErrorKind.ARGUMENTS_TOO_LARGE)
    assert "100" in refused["output"] and refused["returncode"] == -1
    assert toolbox.calls == []
    ran = asyncio.run(run("echo hi", 5.0))
    assert ran["error_kind"] == str(ToolErrorKind.NONE) and toolbox.calls
