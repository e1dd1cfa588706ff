"""Peers' tasks in real podman sandboxes, through the real loop and toolbox.

An open-instruct task folder, written as open-instruct writes it, runs unchanged: its seeds
land in /workspace, its setup.sh runs, its test.sh finds /tests and writes
/logs/verifier/reward.txt, and that file is the reward (no exit-status fallback: the script
exits 0 for a wrong answer too). Cost: one pool of one container, two episodes, ~10 s.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from sandpiper.collector.episode.loop import default_toolbox_factory, run_episode
from sandpiper.collector.episode.policy import TokenPolicy
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.episode.tools import TOOL_SCHEMAS
from sandpiper.collector.sandbox.images import podman_image_exists
from sandpiper.collector.tasks.importer import import_tasks
from sandpiper.collector.tasks.loading import load_task_folder
from sandpiper.config import SamplingLimits
from sandpiper.store.records import StopReason
from sandpiper.testing import ScriptedPolicy
from tests.unit.collector.tasks.test_formats import open_instruct_task

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FIX = (
    '<tool_call>\n{"name": "execute_bash", "arguments": {"command": '
    '"sed -i s/-/+/ /workspace/calc.py && cat /workspace/.ready /workspace/pkg/util.py"}}'
    "\n</tool_call>"
)
SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>'


def test_open_instruct_task_runs_unchanged(sandbox_pool, sandbox_image, tiny_tokenizer, tmp_path):
    folder = open_instruct_task(tmp_path)
    (folder / "image.txt").write_text(sandbox_image + "\n")
    task = load_task_folder(folder)
    assert task.image == sandbox_image
    make_toolbox = default_toolbox_factory(exec_timeout_s=10, test_timeout_s=30)
    renderer = ChatRenderer(tiny_tokenizer, TOOL_SCHEMAS)
    limits = SamplingLimits(context_limit=100_000, max_episode_tokens=100_000)

    async def episode(replies: list[str]):
        async with (
            sandbox_pool(pool_size=1) as pool,
            pool.session(episode_id="e", task_id=task.task_id) as box,
        ):
            return await run_episode(
                episode_id="e", sample_index=0, task=task,
                policy=TokenPolicy(ScriptedPolicy(tiny_tokenizer, replies), renderer),
                sandbox=box, toolbox=make_toolbox(box, task), limits=limits,
            )  # fmt: skip

    fixed = asyncio.run(episode([FIX, SUBMIT]))
    assert fixed.stop_reason is StopReason.SUBMITTED and fixed.valid, fixed.error
    (bash,) = fixed.turns[1].tool_calls
    assert "ready" in bash.output and "X = 1" in bash.output  # seeds + setup.sh
    fixed.turns[-1].tool_calls[0]
    assert fixed.reward == 1.0, fixed.reward_breakdown
    assert fixed.reward_breakdown["test_details"]["format"] == "reward_file"
    wrong = asyncio.run(episode([SUBMIT]))
    assert wrong.valid and wrong.reward == 0.0  # test.sh exited 0, but wrote 0
    assert wrong.reward_breakdown["test_details"]["exit_code"] == 0
    assert asyncio.run(podman_image_exists(sandbox_image))
    assert not asyncio.run(podman_image_exists("localhost/sandpiper-no-such-image:0"))


def _call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_code_and_document_rows_run_in_podman(sandbox_pool, tiny_tokenizer, tmp_path):
    """TRL + Daytona (the example's own max_subarray task), Aviato and LLM-in-Sandbox rows,
    imported as the peers write them, graded by their harnesses inside the sandbox under the
    grader's uid. Cost: one container, four episodes, ~15 s."""
    from tests.unit.collector.tasks.test_formats import LIS_ROWS, rllm_record
    from tests.unit.collector.tasks.test_formats_code import KADANE, PEER_TASKS, aviato_row

    src = tmp_path / "rows.jsonl"
    trl = [json.loads(line) for line in PEER_TASKS.read_text().splitlines()][1]
    aviato = {**aviato_row("Print 2 + 3.", "5"), "id": "aviato-add"}
    lis = rllm_record({**LIS_ROWS[1], "input_files": {"q.txt": "Options: A) x B) y"}})
    lis["extra_info"].pop("docker_image")
    src.write_text("".join(json.dumps(r) + "\n" for r in (trl, aviato, lis)))
    tasks = {t.task_id: t for t in import_tasks(src, tmp_path / "out")}
    make_toolbox = default_toolbox_factory(exec_timeout_s=10, test_timeout_s=30)
    renderer = ChatRenderer(tiny_tokenizer, TOOL_SCHEMAS)
    limits = SamplingLimits(
        context_limit=100_000, max_episode_tokens=100_000, max_tokens_per_turn=4096
    )
    solution = trl["prompt"] + KADANE
    plays = [
        ("max_subarray", [_call("execute_bash", command=f"cat > /workspace/solution.py <<'EOF'\n{solution}EOF"), SUBMIT], 1.0),
        ("aviato-add", [_call("submit", answer="<answer>print(2 + 3)</answer>")], 1.0),
        ("aviato-add", [_call("submit", answer="<answer>raise SystemExit(2)</answer>")], 0.0),
        ("bio-7", [_call("execute_bash", command="cat /workspace/documents/q.txt && echo 'Answer: b' > /workspace/answer.txt"), SUBMIT], 1.0),
    ]  # fmt: skip

    async def run_all():
        episodes = []
        async with sandbox_pool(pool_size=1) as pool:
            for i, (task_id, replies, _) in enumerate(plays):
                task = tasks[task_id]
                async with pool.session(episode_id=f"e{i}", task_id=task_id) as box:
                    episodes.append(
                        await run_episode(
                            episode_id=f"e{i}", sample_index=0, task=task,
                            policy=TokenPolicy(ScriptedPolicy(tiny_tokenizer, replies), renderer),
                            sandbox=box, toolbox=make_toolbox(box, task), limits=limits,
                        )
                    )  # fmt: skip
        return episodes

    for (task_id, _, reward), episode in zip(plays, asyncio.run(run_all()), strict=True):
        assert episode.valid, (task_id, episode.error)
        assert episode.reward == reward, (task_id, episode.reward_breakdown)
