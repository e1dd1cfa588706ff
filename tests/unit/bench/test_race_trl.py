"""TRL's side of the race (bench/race_trl.py): its environment runs Sandpiper's sandbox
runtime and reward on the race's tasks (the demo's and imported reasoning-gym items), and
each step's log carries the CPU seconds of its two phases."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import race_setup as setup
import race_suites as suites
import race_trl


@pytest.fixture
def suite(tmp_path: Path):
    settings = setup.RaceSettings(train_tasks=6, heldout_tasks=3)
    train, _ = suites.prepare_suite(settings, tmp_path / "tasks")
    sp = setup.sandpiper_config(settings, start=tmp_path, tasks=train, runs_dir=tmp_path, name="r")
    return train, sp


class _FakePool:
    """Hands out FakeSandboxes (a temp folder each); counts what is held."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.acquired = 0

    async def acquire(self, *, episode_id: str, task_id: str, image: str | None = None):
        from sandpiper.testing.sandbox import FakeSandbox

        box = FakeSandbox()
        self.held.add(id(box))
        self.acquired += 1
        return box

    async def release(self, sandbox, *, broken: bool = False) -> None:
        self.held.remove(id(sandbox))

    async def close(self) -> None:
        pass


def test_sandbox_env_runs_the_task_with_sandpipers_toolbox_and_reward(suite) -> None:
    """TRL's view of an episode: reset, tool calls, get_reward; the sandbox is prepared with
    the task's files, given back after the reward, and the reward is the task's."""
    from sandpiper.collector.tasks.loading import load_tasks
    from sandpiper.demo.tasks import COMPUTE_COMMAND

    train, sp = suite
    pool = _FakePool()
    runtime = race_trl.SandboxRuntime(sp, pool_size=1, pool=pool)
    race_trl.RUNTIME = runtime
    race_trl.TASKS.update({t.task_id: t for t in load_tasks(train)})
    try:
        task_id = suites.task_ids(train)[0]
        solved, guessed, silent = (
            race_trl.SandboxEnv(),
            race_trl.SandboxEnv(),
            race_trl.SandboxEnv(),
        )
        for env in (solved, guessed, silent):
            env.reset(task_id=task_id, prompt=[])
        race_trl.STEP_REWARDS.clear()
        solved.execute_bash(COMPUTE_COMMAND)
        solved.submit()
        assert solved.execute_bash("ls") == race_trl.ENDED  # the episode ended at submit
        guessed.execute_bash("echo 42 > answer.txt")
        assert (solved.get_reward(), guessed.get_reward(), silent.get_reward()) == (1.0, 0.0, 0.0)
        assert race_trl._mean_reward() == pytest.approx(1 / 3) and not race_trl.STEP_REWARDS
        assert pool.acquired == 3 and not pool.held
    finally:
        runtime.close()
        race_trl.RUNTIME = None


def test_trl_side_scores_an_imported_reasoning_gym_task_with_its_scorer(tmp_path: Path) -> None:
    """An imported reasoning-gym item reaches TRL's side as it reaches the collector (its
    prompt in the dataset row, its files in the sandbox) and is scored by the family's own
    scorer through the task's reward (``finish_episode``)."""
    from warm_start import products_command

    from sandpiper.collector.tasks.loading import load_tasks

    settings = setup.RaceSettings(suite="reasoning-gym:products", train_tasks=3, heldout_tasks=1)
    train, _ = suites.prepare_suite(settings, tmp_path / "tasks")
    sp = setup.sandpiper_config(settings, start=tmp_path, tasks=train, runs_dir=tmp_path, name="r")
    tasks = load_tasks(train)
    task = tasks[0]
    assert type(task.reference).__name__ == "ReasoningGymReference"
    row = next(r for r in race_trl.dataset_rows(sp, tasks, seed=0) if r["task_id"] == task.task_id)
    assert row["prompt"][1] == {"role": "user", "content": task.instruction}
    pool = _FakePool()
    runtime = race_trl.SandboxRuntime(sp, pool_size=1, pool=pool)
    race_trl.RUNTIME = runtime
    race_trl.TASKS.update({t.task_id: t for t in tasks})
    try:
        solved, wrong = race_trl.SandboxEnv(), race_trl.SandboxEnv()
        for env in (solved, wrong):
            env.reset(task_id=task.task_id, prompt=row["prompt"])
        solved.execute_bash(products_command(task.instruction))
        solved.submit()
        wrong.execute_bash("echo 7 > answer.txt")
        assert solved.get_reward() == 1.0
        assert wrong.get_reward() < 1.0
        assert not pool.held
    finally:
        runtime.close()
        race_trl.RUNTIME = None
        race_trl.STEP_REWARDS.clear()


def test_trl_steps_record_the_cpu_seconds_of_each_phase() -> None:
    """Generation's CPU seconds (the process's, taken at the phase's boundaries) beside its
    wall seconds; the step log's training CPU is the step's rest."""
    pytest.importorskip("transformers")
    import time

    def burn(inputs):
        t = time.process_time()
        while time.process_time() - t < 0.2:
            pass
        return {"completion_mask": _Sum(3), "prompt_mask": _Sum(4)}

    trainer = SimpleNamespace(_generate_and_score_completions=burn)
    timer = {"gen_s": 0.0, "gen_cpu_s": 0.0}
    race_trl.instrument(trainer, timer)
    trainer._generate_and_score_completions([1, 2])
    assert timer["gen_cpu_s"] >= 0.18 and timer["gen_s"] >= timer["gen_cpu_s"] * 0.5  # 10 ms ticks
    assert (timer["tokens"], timer["samples"]) == (7, 2)


class _Sum:
    def __init__(self, n: int) -> None:
        self.n = n

    def sum(self) -> int:
        return self.n
