"""``sandpiper gateway`` as a user runs it: its own process in front of the real vLLM server
(the tiny model, greedy), writing a real DuckDB store. A stop string and top logprobs reach
vLLM; an episode left open when the gateway gets SIGTERM, and one past its time limit, are
found in the store with their stop reasons and calls.

Cost: the gateway's start (a tokenizer, a weight reload on the shared server) and 4 short
model calls, ~30 s on 2 cores besides the shared vLLM server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import sqlalchemy as sa

from tests.conftest import REPO
from tests.fixtures.vllm import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

USER = [{"role": "user", "content": "Count: one two three"}]


def _config(tmp_path: Path, vllm_server) -> Path:
    store = tmp_path / "store.duckdb"
    text = f"""name = "gw-alone"
runs_dir = {json.dumps(str(tmp_path / "runs"))}
[store]
url = {json.dumps(f"duckdb:///{store}")}
flush_interval_s = 0.2
[inference]
server_urls = [{json.dumps(vllm_server.url)}]
max_model_len = 2048
[learner]
model = {json.dumps(str(vllm_server.model_dir))}
algo = "sft"  # greedy replies for a deterministic test: GRPO refuses temperature 0
[collector]
temperature = 0.0
max_tokens_per_turn = 12
[tracking]
enabled = false
"""
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def _wait_up(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the gateway exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the gateway did not start: {log.read_text()[-2000:]}")


def test_sigterm_stores_the_open_episode_with_its_stop_reason(vllm_server, tmp_path):
    toml = _config(tmp_path, vllm_server)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "gateway.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "sandpiper.cli", "gateway", "-c", str(toml), "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    try:
        _wait_up(url, proc, log)
        base = httpx.post(url + "/episodes", json={"episode_id": "left-open"}).json()["base_url"]
        client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        whole = client.chat.completions.create(
            model="policy", messages=USER, logprobs=True, top_logprobs=2
        )
        tokens = whole.choices[0].logprobs.content
        assert len(tokens) == whole.usage.completion_tokens
        assert all(len(t.top_logprobs) == 2 for t in tokens)
        assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in tokens)

        # greedy: the same prompt samples the same text, so vLLM must stop at a string in it
        text = whole.choices[0].message.content
        stop = text[len(text) // 2 :][:3]
        assert stop.strip(), f"the tiny model's reply has no text to stop on: {text!r}"
        other = httpx.post(url + "/episodes", json={"episode_id": "stopped", "time_limit_s": 1})
        cut = openai.OpenAI(base_url=other.json()["base_url"], api_key="x", max_retries=0)
        r = cut.chat.completions.create(model="policy", messages=USER, stop=[stop])
        assert r.choices[0].message.content == text[: text.find(stop)]
        assert r.choices[0].finish_reason == "stop"
        time.sleep(2.5)  # "stopped" runs past its time limit of 1 s: closed by the gateway
        client.close()
        cut.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    from sandpiper.store import Store

    store = Store(f"duckdb:///{tmp_path / 'store.duckdb'}")
    with store.connect_readonly() as conn:
        rows = conn.execute(
            sa.text("SELECT episode_id, stop_reason, valid, error FROM episodes")
        ).all()
        turns = conn.execute(
            sa.text("SELECT episode_id, count(*) FROM turns GROUP BY episode_id")
        ).all()
    episodes = {r.episode_id: r for r in rows}
    assert set(episodes) == {"left-open", "stopped"}, log.read_text()[-2000:]
    assert episodes["left-open"].stop_reason == "cancelled" and not episodes["left-open"].valid
    assert episodes["stopped"].stop_reason == "time_limit" and episodes["stopped"].valid
    assert dict(turns) == {"left-open": 2, "stopped": 2}  # the prompt and the sampled reply
