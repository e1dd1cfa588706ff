"""The episode loop with a scripted policy and a fake sandbox: token-in/token-out, stops,
malformed calls as observations, infra failures as invalid episodes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sandpiper.collector.episode.loop import SYSTEM_PROMPT, run_episode
from sandpiper.collector.episode.policy import TokenPolicy
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.tasks.model import Task
from sandpiper.config import SamplingLimits
from sandpiper.errors import InferenceError, SandboxError, SandboxLostError
from sandpiper.store.records import Role, StopReason, ToolErrorKind
from sandpiper.testing import (
    FAKE_TOOL_SCHEMAS,
    FakePool,
    FakeSandbox,
    FakeToolbox,
    ScriptedPolicy,
    scripted_sandbox,
)

BASH_LS = '<tool_call>\n{"name": "execute_bash", "arguments": {"command": "ls"}}\n</tool_call>'
SUBMIT_42 = '<tool_call>\n{"name": "submit", "arguments": {"answer": "42"}}\n</tool_call>'
MATH = Task("t1", "What is 6*7?", {"reward": "math", "answer": "42"}, "unit", "jsonl_math")


def _run(tokenizer, replies, *, task=MATH, limits=SamplingLimits(), sandbox=None, test_reward=None):
    policy = ScriptedPolicy(tokenizer, replies, version=3)
    sandbox = sandbox or scripted_sandbox()
    toolbox = FakeToolbox(sandbox, test_reward=test_reward)
    renderer = ChatRenderer(tokenizer, FAKE_TOOL_SCHEMAS)
    episode = asyncio.run(
        run_episode(
            episode_id="e1",
            sample_index=0,
            task=task,
            policy=TokenPolicy(policy, renderer),
            sandbox=sandbox,
            toolbox=toolbox,
            limits=limits,
        )
    )
    return episode, policy, toolbox, renderer


def test_submit_episode_is_token_in_token_out(tiny_tokenizer):
    replies = [
        "Look first.\n" + BASH_LS,
        '<tool_call>\n{"name": "execute_bash", "arguments": {"command": "ls"\n</tool_call>',
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        SUBMIT_42,
    ]
    episode, policy, toolbox, renderer = _run(tiny_tokenizer, replies)
    assert episode.stop_reason is StopReason.SUBMITTED and episode.valid
    assert episode.reward == 1.0 and episode.reward_breakdown["math"] == 1.0
    roles = [t.role for t in episode.turns]
    assert roles == [Role.USER] + [Role.ASSISTANT, Role.TOOL] * 3 + [Role.ASSISTANT]
    # every request is exactly the concatenation of the stored segments before it
    for k, prompt in enumerate(policy.prompts):
        upto = 1 + 2 * k
        stored = np.concatenate([t.token_ids_T for t in episode.turns[:upto]])
        assert prompt == stored.tolist()
    # the first prompt is the chat template rendered once, with the tool schemas
    first = renderer.decode(policy.prompts[0])
    assert "<tools>" in first and '"execute_bash"' in first and first.endswith("assistant\n")
    # tool segments are not trainable, sampled segments carry logprobs and versions
    for turn in episode.turns:
        assert turn.trainable is (turn.role is Role.ASSISTANT)
        if turn.trainable:
            assert len(turn.logprobs_T) == len(turn.token_ids_T) == len(turn.policy_versions_T)
            assert set(turn.policy_versions_T.tolist()) == {3}
        else:
            assert turn.logprobs_T is None and turn.policy_versions_T is None
    assert episode.policy_version_range == (3, 3)
    # the malformed and unknown calls became observations, not crashes
    kinds = [t.tool_calls[0].error_kind for t in episode.turns if t.role is Role.ASSISTANT]
    assert kinds == [
        ToolErrorKind.NONE,
        ToolErrorKind.BAD_JSON,
        ToolErrorKind.UNKNOWN_TOOL,
        ToolErrorKind.NONE,
    ]
    assert "malformed tool call" in episode.turns[4].text
    # a tool that was not offered never reaches the toolbox: it is an error observation
    assert toolbox.calls == [("execute_bash", {"command": "ls"}), ("submit", {"answer": "42"})]
    unknown = [c for t in episode.turns for c in t.tool_calls if c.name == "rm_rf"]
    assert [c.error_kind for c in unknown] == [ToolErrorKind.UNKNOWN_TOOL]
    assert "unknown tool" in unknown[0].output
    assert "<tool_response>\nran: ls\n\n</tool_response>" in episode.turns[2].text


def test_tool_delta_after_eos_matches_a_full_render(tiny_tokenizer):
    """Appending sampled ids + delta gives the same text as rendering the conversation."""
    _, policy, _, renderer = _run(tiny_tokenizer, [BASH_LS, SUBMIT_42])
    text = renderer.decode(policy.prompts[1])
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": MATH.instruction},
        {"role": "assistant", "content": BASH_LS},
        {"role": "tool", "name": "execute_bash", "content": "ran: ls\n"},
    ]
    assert text == renderer.render(messages, add_generation_prompt=True)


def test_wrong_answer_scores_zero_but_is_valid(tiny_tokenizer):
    wrong = SUBMIT_42.replace("42", "41")
    episode, *_ = _run(tiny_tokenizer, [wrong])
    assert episode.valid and episode.reward == 0.0


def test_tests_reward_and_answer_file(tiny_tokenizer, tmp_path):
    task = Task("t2", "fix it", {"reward": "tests"}, "unit", "folder", test_command="true")
    episode, *_ = _run(
        tiny_tokenizer,
        ['<tool_call>{"name": "submit", "arguments": {}}</tool_call>'],
        task=task,
        test_reward=0.5,
    )
    assert episode.reward == 0.5 and episode.reward_breakdown["test_details"]["total"] == 1
    sandbox = scripted_sandbox()
    sandbox.files["/workspace/answer.txt"] = b"42\n"
    lis = Task(
        "t3",
        "q",
        {"reward": "exact", "answer": "42", "answer_file": "/workspace/answer.txt"},
        "u",
        "llm_in_sandbox",
    )
    episode, *_ = _run(
        tiny_tokenizer,
        ['<tool_call>{"name": "submit", "arguments": {}}</tool_call>'],
        task=lis,
        sandbox=sandbox,
    )
    assert episode.reward == 1.0


def test_no_tool_call_answer_is_scored(tiny_tokenizer):
    episode, *_ = _run(tiny_tokenizer, ["The answer is $42$."])
    assert episode.stop_reason is StopReason.NO_TOOL_CALL and episode.reward == 1.0


def test_max_turns(tiny_tokenizer):
    episode, policy, *_ = _run(tiny_tokenizer, [BASH_LS] * 5, limits=SamplingLimits(max_turns=3))
    assert episode.stop_reason is StopReason.MAX_TURNS and episode.valid
    assert episode.reward == 0.0 and len(policy.prompts) == 3


def test_max_episode_tokens_truncates(tiny_tokenizer):
    limits = SamplingLimits(max_episode_tokens=30)
    episode, policy, *_ = _run(tiny_tokenizer, [BASH_LS] * 5, limits=limits)
    assert episode.stop_reason is StopReason.MAX_TOKENS and episode.valid
    assert episode.completion_tokens <= 30
    assert all(p.max_tokens <= 30 for p in policy.params)


def test_context_limit(tiny_tokenizer):
    renderer = ChatRenderer(tiny_tokenizer, FAKE_TOOL_SCHEMAS)
    prompt_len = len(
        renderer.prompt_ids(
            [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": MATH.instruction},
            ]
        )
    )
    limits = SamplingLimits(context_limit=prompt_len + 40)
    episode, policy, *_ = _run(tiny_tokenizer, [BASH_LS] * 5, limits=limits)
    assert episode.stop_reason is StopReason.CONTEXT_EXCEEDED and episode.valid
    assert all(len(p) < limits.context_limit for p in policy.prompts)
    assert episode.total_tokens <= limits.context_limit + 40  # at most one tool delta over


@pytest.mark.parametrize(
    ("error", "stop", "valid"),
    [
        (SandboxError("the agent broke its shell"), StopReason.SANDBOX_DIED, True),
        (SandboxLostError("the host removed it"), StopReason.SANDBOX_LOST, False),
    ],
)
def test_a_sandbox_broken_by_the_agent_is_graded_a_lost_one_invalid(
    tiny_tokenizer, error, stop, valid
):
    """docs/security.md, outcome classes: what the agent's commands do to its sandbox is its
    outcome (graded, here 0: no answer); only a container lost to the host is invalid."""
    sandbox = scripted_sandbox()

    class Dying(FakeToolbox):
        async def call(self, name, arguments):
            raise error

    policy = ScriptedPolicy(tiny_tokenizer, [BASH_LS, SUBMIT_42])
    episode = asyncio.run(
        run_episode(
            episode_id="e",
            sample_index=1,
            task=MATH,
            policy=TokenPolicy(policy, ChatRenderer(tiny_tokenizer, FAKE_TOOL_SCHEMAS)),
            sandbox=sandbox,
            toolbox=Dying(sandbox),
            limits=SamplingLimits(),
        )
    )
    assert episode.stop_reason is stop and "sandbox" in episode.error
    assert episode.valid is valid and episode.reward == (0.0 if valid else None)
    assert episode.turns[-1].role is Role.ASSISTANT  # the sampled turn is still stored


def test_dead_sandbox_before_start_and_model_errors_are_invalid(tiny_tokenizer, tmp_path):
    (tmp_path / "files").mkdir()
    (tmp_path / "instruction.md").write_text("x")
    task = Task("t4", "x", {"reward": "exact", "answer": "1"}, "u", "folder", data_dir=tmp_path)
    dead = scripted_sandbox()
    dead.die()
    episode, *_ = _run(tiny_tokenizer, [SUBMIT_42], task=task, sandbox=dead)
    # before the agent acted: not its doing
    assert episode.stop_reason is StopReason.SANDBOX_LOST and episode.reward is None
    episode, *_ = _run(tiny_tokenizer, [InferenceError("server down")])
    assert episode.stop_reason is StopReason.MODEL_ERROR and not episode.valid
    assert episode.reward is None and "server down" in episode.error


@pytest.mark.parametrize("fmt", ["qwen3_coder"])
def test_xml_tool_format(tiny_tokenizer, fmt):
    xml = "<tool_call>\n<function=submit>\n<parameter=answer>\n42\n</parameter>\n</function>\n</tool_call>"
    episode, _, toolbox, _ = _run(tiny_tokenizer, [xml], limits=SamplingLimits(tool_format=fmt))
    assert toolbox.calls == [("submit", {"answer": "42"})] and episode.reward == 1.0


def test_seed_files_and_setup_script_run_first_and_a_broken_setup_is_a_task_error(
    tiny_tokenizer, tmp_path
):
    from sandpiper.collector.sandbox.base import ExecOutcome, ExecResult

    (tmp_path / "files").mkdir()
    (tmp_path / "setup.sh").write_text("exit 3\n")
    task = Task("t5", "x", {"reward": "exact", "answer": "1"}, "u", "folder", data_dir=tmp_path)

    class FailingSetup(FakeSandbox):
        async def exec(self, command, **kwargs):
            if "sandpiper_setup" in command:
                self.commands.append(command)
                return ExecResult("", "boom", 3, ExecOutcome.OK, 1.0, 0, 4)
            return await super().exec(command, **kwargs)

    ok_box = scripted_sandbox()
    episode, *_ = _run(tiny_tokenizer, [SUBMIT_42], task=task, sandbox=ok_box)
    assert ok_box.copied == [(tmp_path / "files", "/workspace")]
    assert ok_box.files["/tmp/sandpiper_setup.sh"] == b"exit 3\n" and episode.valid
    broken = FailingSetup(scripted=True)
    episode, policy, *_ = _run(tiny_tokenizer, [SUBMIT_42], task=task, sandbox=broken)
    assert episode.stop_reason is StopReason.TASK_ERROR and not episode.valid
    assert episode.reward is None
    assert "setup.sh" in episode.error and policy.prompts == []


def test_real_toolbox_turns_bad_calls_into_observations(tiny_tokenizer):
    """Unknown tools, wrong argument types and huge arguments through the real Toolbox."""
    from sandpiper.collector.episode.tools import TOOL_SCHEMAS, Toolbox

    replies = [
        '<tool_call>\n{"name": "execute_bash", "arguments": {"command": 42}}\n</tool_call>',
        '<tool_call>\n{"name": "launch_missiles", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "execute_bash", "arguments": {"command": "'
        + "y" * 70_000
        + '"}}\n</tool_call>',
        "I give up.",
    ]
    sandbox = scripted_sandbox()
    toolbox = Toolbox(
        sandbox, tests_dir=None, test_command=None, test_timeout_s=5, exec_timeout_s=5
    )
    episode = asyncio.run(
        run_episode(
            episode_id="e", sample_index=0, task=MATH,
            policy=TokenPolicy(ScriptedPolicy(tiny_tokenizer, replies),
                               ChatRenderer(tiny_tokenizer, TOOL_SCHEMAS)), sandbox=sandbox,
            toolbox=toolbox, limits=SamplingLimits(max_turns=5, context_limit=100_000,
                                                  max_episode_tokens=100_000,
                                                  max_tokens_per_turn=100_000),
        )
    )  # fmt: skip
    kinds = [c.error_kind for t in episode.turns for c in t.tool_calls]
    assert kinds == [
        ToolErrorKind.BAD_ARGUMENTS,
        ToolErrorKind.UNKNOWN_TOOL,
        ToolErrorKind.ARGUMENTS_TOO_LARGE,
    ]
    assert episode.stop_reason is StopReason.NO_TOOL_CALL and episode.valid
    assert sandbox.commands == []  # nothing malformed reached the sandbox


def test_a_collector_bug_in_one_episode_is_its_recorded_error_with_a_traceback(
    tiny_tokenizer, caplog
):
    """A genuine bug stays visible (logged with its traceback, recorded as the episode's
    error) but ends only its own episode, which is invalid (the policy did not cause it)."""
    sandbox = scripted_sandbox()

    class Buggy(FakeToolbox):
        async def call(self, name, arguments):
            return {}["no such key"]

    policy = ScriptedPolicy(tiny_tokenizer, [BASH_LS, SUBMIT_42])
    with caplog.at_level("ERROR", logger="sandpiper.collector.episode.loop"):
        episode = asyncio.run(
            run_episode(
                episode_id="e",
                sample_index=0,
                task=MATH,
                policy=TokenPolicy(policy, ChatRenderer(tiny_tokenizer, FAKE_TOOL_SCHEMAS)),
                sandbox=sandbox,
                toolbox=Buggy(sandbox),
                limits=SamplingLimits(),
            )
        )
    assert episode.stop_reason is StopReason.INFRA_ERROR and not episode.valid
    assert episode.error.startswith("collector bug: KeyError")
    assert [r.exc_info[0] for r in caplog.records] == [KeyError]  # with its traceback
    assert len(episode.turns) == 2  # the prompt and the sampled turn are kept


def test_run_pooled_episode_contains_an_exception_of_the_episode_and_replaces_its_sandbox(
    tiny_tokenizer,
):
    from sandpiper.collector.episode.loop import run_pooled_episode

    pool = FakePool()

    async def exploding_run(**_):
        raise RuntimeError("boom")

    episode = asyncio.run(
        run_pooled_episode(
            pool,
            episode_id="e",
            sample_index=3,
            task=MATH,
            policy=TokenPolicy(
                ScriptedPolicy(tiny_tokenizer, []), ChatRenderer(tiny_tokenizer, FAKE_TOOL_SCHEMAS)
            ),
            make_toolbox=lambda box, task: FakeToolbox(box),
            limits=SamplingLimits(),
            run=exploding_run,
        )
    )
    assert episode.stop_reason is StopReason.INFRA_ERROR and episode.reward is None
    assert episode.error == "collector bug: RuntimeError: boom" and episode.sample_index == 3
    assert episode.sandbox_id == "box-1" and pool.released == [("box-1", True)]


@pytest.mark.parametrize("error", [OSError("reset op failed"), KeyError("bug")])
def test_a_failing_reset_replaces_the_sandbox_instead_of_losing_a_pool_slot(error):
    """Whatever an episode left that makes the reset fail, the container is replaced: an
    escaped exception used to kill the recycling task and shrink the pool for good."""
    from sandpiper.collector.sandbox.pool import SandboxPool
    from sandpiper.config import SandboxConfig

    class Box:
        id, alive, closed = "box-x", True, False

        async def reset(self):
            raise error

        async def close(self):
            self.closed = True

    pool = SandboxPool(SandboxConfig(), labels={})
    started = []
    pool._total, pool._spawn_start = 1, lambda: started.append(1)  # no real container
    box = Box()
    asyncio.run(pool._recycle(box, broken=False))
    assert box.closed and pool._total == 0 and pool.idle_count == 0 and started == [1]
