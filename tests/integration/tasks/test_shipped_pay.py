"""Every shipped task pays: its reference solution scores 1 and a wrong answer 0, through the
real episode loop, toolbox, podman sandbox and grader (``collector/sandbox/supervisor/grader.py``),
rewards and scoring — as a user's run would grade them.

The tasks: everything under ``tasks/`` (each source read the way docs/tasks.md says to read
it) and the folders the demo writes. Where each solution lives: ``tests/fixtures/solutions.py``
and docs/tasks.md (Reference solutions). A source added under ``tasks/`` without an entry in
:data:`SOURCES`, or a task without a solution, fails here.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from sandpiper.collector.episode.loop import default_toolbox_factory, run_episode
from sandpiper.collector.episode.policy import TokenPolicy
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.episode.tools import TOOL_SCHEMAS
from sandpiper.collector.tasks.importer import import_tasks
from sandpiper.collector.tasks.loading import load_task_folder, load_tasks
from sandpiper.config import SamplingLimits
from sandpiper.testing import ScriptedPolicy
from tests.conftest import REPO
from tests.fixtures.solutions import WRONG, Solution, folder_solution, solutions_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

TASKS = REPO / "tasks"
SOURCES = {
    # path under tasks/: how a user reads it (docs/tasks.md)
    "demo.jsonl": "load",
    "folders": "load",
    "llm_in_sandbox_sample.jsonl": "import llm_in_sandbox",
    "peers/aviato_trl_grpo.jsonl": "import",
    "peers/chat_prompts.jsonl": "import",
    "peers/llm_in_sandbox_rl.jsonl": "import",
    "peers/trl_daytona.jsonl": "import",
    "peers/open_instruct/swerl_rows.jsonl": "import",
    "peers/open_instruct/fix-add": "folder",
}
DEMO_TASKS_RUN = 3
"""Demo folders graded here (all are written from one template; every one written is
checked to carry its solution)."""


def _shipped_sources() -> set[str]:
    """Every task source under tasks/: JSONL files and task folders (outermost)."""
    found = set()
    for path in TASKS.rglob("*"):
        rel = path.relative_to(TASKS)
        if path.suffix == ".jsonl" or (path / "instruction.md").is_file():
            parent_is_folder = any(
                (TASKS / p / "instruction.md").is_file() for p in rel.parents if p != Path(".")
            )
            if not parent_is_folder:
                found.add(str(rel))
    return found


def test_every_shipped_source_is_listed():
    listed = set(SOURCES)
    covered = {
        s for s in _shipped_sources() if any(s == k or s.startswith(k + "/") for k in listed)
    }
    assert covered == _shipped_sources(), sorted(_shipped_sources() - covered)


def _load(source: str, how: str, out: Path) -> list:
    path = TASKS / source
    if how == "load":
        return load_tasks(path)
    if how == "folder":
        return [load_task_folder(path)]
    fmt = how.split()[1] if " " in how else "auto"
    return import_tasks(path, out / source.replace("/", "_"), fmt=fmt)


def _plays(tmp_path: Path) -> list[tuple[str, object, Solution, float]]:
    """(label, task, solution, expected reward) for every shipped task and a few demo ones."""
    from sandpiper.demo.tasks import write_demo_tasks

    plays, missing = [], []
    for source, how in SOURCES.items():
        for task in _load(source, how, tmp_path):
            pair = solutions_for(source, task)
            if pair is None:
                missing.append(f"{source}: {task.task_id}")
                continue
            plays += [(f"{source}:{task.task_id}", task, pair[0], 1.0)]
            plays += [(f"{source}:{task.task_id} (wrong)", task, pair[1], 0.0)]
    assert not missing, f"tasks without a reference solution: {missing}"
    demo = write_demo_tasks(tmp_path / "demo", 12, seed=5)
    folders = sorted(p for p in demo.iterdir() if p.is_dir())
    assert folders and all(folder_solution(p) for p in folders)  # every one written
    for folder in folders[:DEMO_TASKS_RUN]:
        task = load_task_folder(folder)
        own = folder_solution(folder)
        assert own is not None
        plays += [(f"demo:{task.task_id}", task, own, 1.0)]
        plays += [(f"demo:{task.task_id} (wrong)", task, WRONG, 0.0)]
    return plays


def _call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _replies(solution: Solution) -> list[str]:
    replies = [_call("execute_bash", command=c) for c in solution.commands]
    submit = {} if solution.answer is None else {"answer": solution.answer}
    return [*replies, _call("submit", **submit)]


def test_every_shipped_task_pays_its_solution_and_not_a_wrong_answer(
    sandbox_pool, tiny_tokenizer, tmp_path
):
    plays = _plays(tmp_path)
    make_toolbox = default_toolbox_factory(exec_timeout_s=20, test_timeout_s=60)
    renderer = ChatRenderer(tiny_tokenizer, TOOL_SCHEMAS)
    limits = SamplingLimits(
        context_limit=100_000, max_episode_tokens=100_000, max_tokens_per_turn=4096, max_turns=8
    )

    async def run_all():
        episodes = []
        async with sandbox_pool(pool_size=2) as pool:
            for i, (_, task, solution, _) in enumerate(plays):
                async with pool.session(episode_id=f"e{i}", task_id=task.task_id) as box:
                    episodes.append(
                        await run_episode(
                            episode_id=f"e{i}", sample_index=0, task=task,
                            policy=TokenPolicy(
                                ScriptedPolicy(tiny_tokenizer, _replies(solution)), renderer
                            ),
                            sandbox=box, toolbox=make_toolbox(box, task), limits=limits,
                        )
                    )  # fmt: skip
        return episodes

    failures = []
    for (label, _, _, want), episode in zip(plays, asyncio.run(run_all()), strict=True):
        if not episode.valid or episode.reward != want:
            failures.append((label, want, episode.reward, episode.error, episode.reward_breakdown))
    assert not failures, "\n".join(map(str, failures))
