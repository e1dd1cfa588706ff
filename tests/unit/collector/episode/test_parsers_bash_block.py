"""The bash_block action format (mini-swe-agent's protocol): parsing, observations as user
turns, format errors as observations, and submission by the sentinel's output."""

from __future__ import annotations

import asyncio

import pytest

from sandpiper.collector.episode.loop import run_episode
from sandpiper.collector.episode.parsers import (
    SUBMIT_SENTINEL,
    parse_tool_calls,
    submission_answer,
    system_prompt_for,
)
from sandpiper.collector.episode.policy import TokenPolicy
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.sandbox.base import ExecOutcome, ExecResult
from sandpiper.collector.tasks.model import Task
from sandpiper.config import SamplingLimits
from sandpiper.store.records import Role, StopReason, ToolErrorKind
from sandpiper.testing import (
    FAKE_TOOL_SCHEMAS,
    FakeSandbox,
    FakeToolbox,
    ScriptedPolicy,
)

MATH = Task("t1", "What is 6*7?", {"reward": "math", "answer": "42"}, "unit", "jsonl_math")


class EchoSandbox(FakeSandbox):
    """``echo WORDS`` prints its words (the fake runs nothing else)."""

    async def exec(self, command, **kwargs) -> ExecResult:
        if command.startswith("echo "):
            self.commands.append(command)
            out = command.removeprefix("echo ").replace(" && echo ", "\n") + "\n"
            return ExecResult(out, "", 0, ExecOutcome.OK, 0.1, len(out), 0)
        return await super().exec(command, **kwargs)


def test_one_block_is_one_execute_bash_call_with_the_thought_as_content():
    text = "THOUGHT: list the files.\n\n```bash\nls -la &&\n  cat a.txt\n```\n"
    parsed = parse_tool_calls(text, "bash_block")
    assert parsed.content == "THOUGHT: list the files."
    (call,) = parsed.tool_calls
    assert call.ok and call.name == "execute_bash"
    assert call.arguments == {"command": "ls -la &&\n  cat a.txt"}


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("The answer is 42.", 0),
        ("```python\nprint(1)\n```", 0),
        ("```bash\nls\n```\nthen\n```bash\npwd\n```", 2),
    ],
)
def test_no_block_or_several_is_a_format_error_the_agent_sees(text, found):
    (call,) = parse_tool_calls(text, "bash_block").tool_calls
    assert call.error_kind is ToolErrorKind.FORMAT_ERROR and not call.ok
    assert f"found {found}" in call.error and SUBMIT_SENTINEL in call.error


def test_an_oversized_block_is_refused():
    (call,) = parse_tool_calls(
        "```bash\n" + "x" * 100 + "\n```", "bash_block", max_argument_bytes=50
    ).tool_calls
    assert call.error_kind is ToolErrorKind.ARGUMENTS_TOO_LARGE


def test_submission_is_recognised_by_the_first_output_line_only():
    assert submission_answer(f"{SUBMIT_SENTINEL}\n") == ""
    assert submission_answer(f"  {SUBMIT_SENTINEL}\n42\n") == "42"
    assert submission_answer(f"ok\n{SUBMIT_SENTINEL}\n") is None
    assert submission_answer("") is None


def test_the_protocol_is_appended_to_the_system_prompt_only_for_bash_block():
    assert system_prompt_for("hermes", "Be brief.") == "Be brief."
    prompt = system_prompt_for("bash_block", "Be brief.")
    assert prompt.startswith("Be brief.\n\n") and f"echo {SUBMIT_SENTINEL}" in prompt


def _episode(tokenizer, replies, sandbox):
    policy = ScriptedPolicy(tokenizer, replies, version=1)
    toolbox = FakeToolbox(sandbox)
    renderer = ChatRenderer(tokenizer, FAKE_TOOL_SCHEMAS, action_format="bash_block")
    episode = asyncio.run(
        run_episode(
            episode_id="e1",
            sample_index=0,
            task=MATH,
            policy=TokenPolicy(policy, renderer),
            sandbox=sandbox,
            toolbox=toolbox,
            limits=SamplingLimits(tool_format="bash_block", max_turns=5),
        )
    )
    return episode, policy, toolbox, renderer


def test_episode_runs_blocks_reports_format_errors_and_submits_by_sentinel(tiny_tokenizer):
    replies = [
        "Look.\n```bash\nls\n```",
        "I think the answer is 42.",  # no block: told the protocol, not the end
        f"```bash\necho {SUBMIT_SENTINEL} && echo 42\n```",
    ]
    episode, policy, toolbox, renderer = _episode(
        tiny_tokenizer, replies, EchoSandbox(scripted=True)
    )
    assert episode.stop_reason is StopReason.SUBMITTED
    assert episode.reward == 1.0  # the sentinel's remaining output is the answer
    assert [t.role for t in episode.turns] == [Role.USER] + [Role.ASSISTANT, Role.TOOL] * 2 + [
        Role.ASSISTANT
    ]
    calls = [c for t in episode.turns for c in t.tool_calls]
    assert [(c.name, c.error_kind) for c in calls] == [
        ("execute_bash", ToolErrorKind.NONE),
        ("", ToolErrorKind.FORMAT_ERROR),
        ("submit", ToolErrorKind.NONE),
    ]
    assert toolbox.calls[-1] == ("submit", {"answer": "42"})
    first = renderer.decode(policy.prompts[0])
    assert "<tools>" not in first and "```bash" in first  # the protocol, not the schemas
    # observations come back as user turns in mini-swe-agent's layout
    assert episode.turns[2].text == (
        "\n<|im_start|>user\n<returncode>0</returncode>\n<output>\nran: ls\n\n</output>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "EXACTLY ONE action" in episode.turns[4].text
    for k, prompt in enumerate(policy.prompts):  # token-in/token-out: stored segments, as sent
        assert prompt == [i for t in episode.turns[: 1 + 2 * k] for i in t.token_ids_T.tolist()]


def test_a_bare_sentinel_submits_without_an_answer(tiny_tokenizer):
    episode, _, toolbox, _ = _episode(
        tiny_tokenizer, [f"```bash\necho {SUBMIT_SENTINEL}\n```"], EchoSandbox(scripted=True)
    )
    assert episode.stop_reason is StopReason.SUBMITTED
    assert toolbox.calls == [
        ("execute_bash", {"command": f"echo {SUBMIT_SENTINEL}"}),
        ("submit", {}),
    ]


def test_the_demo_teacher_answers_in_bash_blocks(tiny_tokenizer):
    from sandpiper.demo.run import Demonstrator
    from sandpiper.demo.tasks import COMPUTE_COMMAND, INSTRUCTION

    teacher = Demonstrator(tiny_tokenizer, compute_fraction=1.0, action_format="bash_block")
    episode, _, toolbox, _ = _episode_with(tiny_tokenizer, teacher, INSTRUCTION)
    assert [name for name, _ in toolbox.calls] == ["execute_bash", "execute_bash", "submit"]
    assert toolbox.calls[0][1] == {"command": COMPUTE_COMMAND}
    assert episode.stop_reason is StopReason.SUBMITTED


def _episode_with(tokenizer, client, instruction):
    task = Task("d1", instruction, {"reward": "exact", "answer": "1"}, "unit", "jsonl_math")
    sandbox = EchoSandbox(scripted=True)
    toolbox = FakeToolbox(sandbox)
    renderer = ChatRenderer(tokenizer, FAKE_TOOL_SCHEMAS, action_format="bash_block")
    episode = asyncio.run(
        run_episode(
            episode_id="e1", sample_index=0, task=task, policy=TokenPolicy(client, renderer),
            sandbox=sandbox, toolbox=toolbox,
            limits=SamplingLimits(tool_format="bash_block", max_turns=3, max_tokens_per_turn=128),
        )
    )  # fmt: skip
    return episode, client, toolbox, renderer
