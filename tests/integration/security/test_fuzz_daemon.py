"""No model output crashes the collector (issue 14, deliverable 4): the REAL collector daemon
(``collector.daemon.launch.collect``: the single rollout loop, parser, toolbox, podman sandboxes, a
DuckDB store) runs with a scripted policy whose every turn is hostile
(:class:`tests.fixtures.fuzz.HostileTurns`: malformed JSON, surrogates and bad UTF-8, huge and
deeply nested arguments, non-finite numbers, FIFOs, devices, /proc, huge folders and files,
pre-created answer and test paths of every kind, chmod 000, kill -9 -1, SIGSTOP of every
process, calls to tools not offered, ...).

Runs on DuckDB and on PostgreSQL (which refuses NUL in text: the store escapes it).
Asserted: the daemon returns normally (0 crashes) after at least ``FUZZ_TURNS`` sampled
turns (then it is stopped, and the groups in flight finish); every class of hostile turn
came; every episode that started is stored (first turns seen by the policy == episodes in the
store == stored groups x group size) and every sampled turn too; every episode is valid (a
hostile turn is the policy's outcome, never an infra failure, and never a collector bug); the
tests-graded task, whose wrong solution the fuzz never fixes, pays 0 everywhere; no container
is left.

Volume: ``make test`` samples 2,000 turns on DuckDB and 1,000 on PostgreSQL (each class of
turn dozens of times, ``submit`` and the rarest few about 10 times in 2,000). ``make
test-long``, which CI runs as well, samples 10,000 and 5,000 (``SANDPIPER_FUZZ_TURNS`` sets any size):
the long tail of random combinations, ~180 s of test time kept out of the everyday command.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa

from sandpiper.config import RunConfig
from tests.conftest import REPO, volume
from tests.fixtures.fuzz import FuzzPolicy
from tests.fixtures.sandbox import run_containers

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.volume,
    pytest.mark.timeout(1200),
]

FUZZ_TURNS = int(os.environ.get("SANDPIPER_FUZZ_TURNS", volume(2_000, 10_000)))
GROUP_SIZE = 2
RUN = "fuzz"
"""Run-name prefix; each backend's run is ``fuzz-<backend>`` (the two may run at once on two
workers, and each checks that no container of its own run is left)."""
GOOD = "def add(a, b):\n    return a - b\n"
TESTS = r"""
cd "$WORKSPACE"
python3 -I - <<'EOF'
import json, os, sys
sys.path.append(os.environ["WORKSPACE"])
result = {"passed": 0, "total": 1}
try:
    import sol
    result["passed"] = int(sol.add(2, 3) == 5)
except BaseException:
    pass
with open(os.environ["SANDPIPER_RESULT_FILE"], "w") as f:
    json.dump(result, f)
EOF
"""


def _tasks(root: Path) -> Path:
    tests = root / "tests-task"
    (tests / "files").mkdir(parents=True)
    (tests / "tests").mkdir()
    (tests / "instruction.md").write_text("Fix add() in /workspace/sol.py, then submit.")
    (tests / "files" / "sol.py").write_text(GOOD)  # wrong: the fuzz never fixes it
    (tests / "tests" / "run.sh").write_text(TESTS)
    (tests / "task.toml").write_text('result_format = "result_file"\n')
    answer = root / "answer-task"
    answer.mkdir()
    (answer / "instruction.md").write_text("Write 6*7 to /workspace/answer.txt, then submit.")
    (answer / "task.toml").write_text(
        'reward = "exact"\nanswer = "42"\nanswer_file = "/workspace/answer.txt"\n'
    )
    return root


def _run_name(store_url: str) -> str:
    return f"{RUN}-{store_url.split(':')[0].split('+')[0]}"


def _config(tmp_path: Path, store_url: str) -> RunConfig:
    return RunConfig.model_validate({
        "name": _run_name(store_url),
        "runs_dir": str(tmp_path / "runs"),
        "store": {"url": store_url, "flush_interval_s": 0.5},
        "sandbox": {"pool_size": 6, "memory_mb": 256, "workspace_size_mb": 64,
                    "exec_timeout_s": 5.0, "output_cap_bytes": 1024},
        "inference": {"max_model_len": 10_000_000},
        "learner": {"model": str(REPO / "runs" / "tiny-model"), "micro_batch_tokens": 10_000_000},
        "collector": {
            "tasks": str(_tasks(tmp_path / "tasks")), "group_size": GROUP_SIZE,
            "max_turns": 100, "max_tokens_per_turn": 1_000_000,
            "max_episode_tokens": 10_000_000, "max_concurrent_episodes": 6,
            "max_unconsumed_groups": 100_000, "status_interval_s": 60.0,
            "policy_poll_s": 1.0, "test_timeout_s": 20.0, "drain_timeout_s": 120.0,
        },
    })  # fmt: skip


def _rows(url: str, sql: str) -> list[tuple]:
    from sandpiper.store import Store

    with Store(url).connect_readonly() as conn:
        return [tuple(r) for r in conn.execute(sa.text(sql))]


@pytest.fixture(params=["duckdb", "postgres"])
def store_url(request, tmp_path) -> str:
    """Both backends: PostgreSQL refuses what DuckDB stores (a NUL byte in tool output halted
    every collector on PostgreSQL while this test ran on DuckDB only)."""
    if request.param == "duckdb":
        return f"duckdb:///{tmp_path / 'store.duckdb'}"
    from tests.integration.store.test_store import _fresh_pg_db

    return _fresh_pg_db(request.getfixturevalue("postgres_url"))


def test_hostile_turns_never_crash_the_daemon_and_every_episode_is_stored(
    sandbox_image, tmp_path, store_url
):
    from transformers import AutoTokenizer

    from sandpiper.collector.daemon.launch import collect

    config = _config(tmp_path, store_url)
    tokenizer = AutoTokenizer.from_pretrained(config.learner.model)
    # PostgreSQL: half the turns (the hostile kinds all come round within the first few
    # hundred; the second backend need not repeat the long tail)
    turns = FUZZ_TURNS if store_url.startswith("duckdb") else max(FUZZ_TURNS // 2, 1)

    async def run():
        stop = asyncio.Event()  # set at `turns` sampled turns; groups in flight finish
        policy = FuzzPolicy(tokenizer, seed=14, submit_every=200, stop_after=(turns, stop))
        return policy, await collect(
            config.for_collector(), stop=stop, live_status=False, client=policy
        )

    started = time.monotonic()
    policy, metrics = asyncio.run(run())
    elapsed_s = time.monotonic() - started

    url = config.store.url
    episodes = _rows(url, "SELECT e.stop_reason, e.valid, e.reward, e.error, g.task_id "
                          "FROM episodes e JOIN groups g USING (group_id)")  # fmt: skip
    n_turns = _rows(url, "SELECT count(*) FROM turns WHERE role = 'assistant'")[0][0]
    n_calls = _rows(url, "SELECT count(*) FROM tool_calls")[0][0]
    stops = Counter(stop for stop, *_ in episodes)
    print(f"\nfuzz: {policy.calls} turns sampled, {n_turns} stored, {n_calls} tool calls, "
          f"{len(episodes)} episodes in {elapsed_s:.0f} s; stops {dict(stops)}; "
          f"turn kinds {dict(policy.turns.kinds)}")  # fmt: skip

    # 0 daemon crashes (collect returned), and everything scheduled and sampled is stored
    assert policy.calls >= turns and n_turns == policy.calls
    missing = [k for k in policy.turns.kind_names if not policy.turns.kinds[k]]
    assert not missing, f"classes of hostile turn never sampled at this volume: {missing}"
    assert len(episodes) == policy.episodes_started == metrics.episodes_total
    assert metrics.groups_total * GROUP_SIZE == len(episodes) and metrics.groups_rejected == 0
    assert metrics.groups_dead == 0  # every byte the fuzz produced was storable
    bugs = [e for e in episodes if (e[3] or "").startswith("collector bug")]
    assert not bugs, bugs[:3]
    assert all(valid for _, valid, *_ in episodes), [e for e in episodes if not e[1]][:5]
    assert not set(stops) - {"submitted", "max_turns", "no_tool_call", "sandbox_died"}, stops
    paid = [e for e in episodes if e[4] == "tests-task" and e[2] != 0.0]
    assert not paid, paid[:3]  # no hostile turn forged a reward for the wrong solution
    assert run_containers(_run_name(store_url), url) == []
