"""Peers' data as a new user would run it: ``sandpiper tasks import`` on each peer's own files,
then ``sandpiper collect --eval`` (the real CLI, podman, DuckDB) against a scripted
OpenAI-compatible endpoint; the stored rewards are the peers' rewards for the same answers.

One eval run over seven tasks (LLM-in-Sandbox rllm JSON, the TRL example's own tasks, an Aviato
row, open-instruct dataset rows whose env_config image is the only local one). Cost: one
pool of one container, seven episodes; 87 s measured at load average 20-30 on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.conftest import REPO
from tests.fixtures.sandbox import run_containers
from tests.unit.collector.tasks.test_formats import LIS_ROWS, open_instruct_rows, rllm_record
from tests.unit.collector.tasks.test_formats_code import KADANE, PEER_TASKS, aviato_row

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


def _call(name: str, **arguments) -> dict:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": function}
    ]}  # fmt: skip


def _bash(command: str) -> dict:
    return _call("execute_bash", command=command)


def _serve(scripts: dict[str, list[dict]]) -> tuple[ThreadingHTTPServer, str]:
    """A chat-completions endpoint that plays the script whose key is in the user prompt."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = next(m["content"] for m in body["messages"] if m["role"] == "user")
            turn = sum(m["role"] == "assistant" for m in body["messages"])
            script = next(s for key, s in scripts.items() if key in prompt)
            message = script[turn] if turn < len(script) else {"role": "assistant", "content": "."}
            reply = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


def _import(source: Path, out: Path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "sandpiper.cli", "tasks", "import", str(source), "--out", str(out)]
    done = subprocess.run([*cmd, *extra], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_peer_data_imported_and_evaluated_through_the_cli(sandbox_image, tmp_path):
    peers = tmp_path / "peers"
    peers.mkdir()
    # LLM-in-Sandbox: the rllm JSON of the peer's converter
    lis = [rllm_record({**r, "docker_image": None}) for r in LIS_ROWS]
    (peers / "train_verl.json").write_text(json.dumps(lis, indent=2))
    # TRL + Daytona: the example's own TASKS; Aviato: its toy dataset rows
    aviato = peers / "aviato.jsonl"
    aviato.write_text(json.dumps(aviato_row("Write code that adds 2 and 3.", "5")) + "\n")
    # open-instruct: dataset rows + task data; only the rows' images exist locally
    rows_file = open_instruct_rows(peers)
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    rows[0]["env_config"]["image"] = sandbox_image
    rows[1]["env_config"]["env_configs"][1]["image"] = sandbox_image
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = peers / "task-data.tar.gz.extracted"
    for task_id in ("tmax-001", "tmax-002"):  # the converter's test.sh, python3 for pytest
        test_sh = (data / task_id / "tests" / "test.sh").read_text()
        test_sh = test_sh.replace("python3 -m pytest /tmp/test_final_state.py -x --tb=short", "python3 -c 'import sys; sys.path.insert(0, \"/tmp\"); import test_final_state as t; t.test_done()'")  # fmt: skip
        (data / task_id / "tests" / "test.sh").write_text(test_sh)
        (data / task_id / "setup.sh").write_text("#!/bin/bash\nset -e\necho ready > .ready\n")

    imported = tmp_path / "imported"
    imported.mkdir()
    _import(peers / "train_verl.json", imported / "lis")
    _import(PEER_TASKS, imported / "trl")
    _import(aviato, imported / "aviato")
    _import(rows_file, imported / "oi", "--task-data-dir", str(data))
    index = []
    for part in ("lis", "trl", "aviato", "oi"):
        for line in (imported / part / "tasks.jsonl").read_text().splitlines():
            row = json.loads(line)
            index.append({**row, "data_dir": f"{part}/{row['data_dir']}"})
    (imported / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in index))

    trl = {json.loads(line)["name"]: json.loads(line) for line in PEER_TASKS.read_text().splitlines()}  # fmt: skip
    write = "cat > /workspace/solution.py <<'EOF'\n{}EOF"
    scripts = {
        "When was the budget approved?": [
            _bash("echo March > /workspace/answer.txt"),
            _call("submit"),
        ],
        "Which option?": [
            _bash("ls /workspace/documents; echo 'Answer: b' > /workspace/answer.txt"),
            _call("submit"),
        ],
        "def max_subarray_sum": [
            _bash(write.format(trl["max_subarray"]["prompt"] + KADANE)),
            _call("submit"),
        ],
        "def sort_numbers": [
            _bash(write.format(trl["sorting"]["prompt"] + "    return list(xs)\n")),
            _call("submit"),
        ],
        "adds 2 and 3": [_call("submit", answer="<answer>print(2 + 3)</answer>")],
        "(tmax-001)": [_bash("cat .ready && echo ok > /workspace/out.txt"), _call("submit")],
        "(tmax-002)": [_bash("echo no > /workspace/out.txt"), _call("submit")],
    }
    # the peers' rewards for these answers (tests/unit/collector/rewards/test_llm_in_sandbox_scores.py,
    # tests/unit/collector/tasks/test_formats_code.py; open-instruct: reward.txt written by test.sh)
    expected = {
        "lc-001": 0.25, "bio-7": 1.0, "max_subarray": 1.0, "sorting": 0.2,
        "tmax-001": 1.0, "tmax-002": 0.0,
    }  # fmt: skip
    server, url = _serve(scripts)
    name = "it-peers"
    done = collect_eval(
        tmp_path, name=name, tasks=imported, url=url, server=server,
        store=tmp_path / "store.duckdb", pool_size=1, max_concurrent=2,
    )  # fmt: skip
    assert "evaluated 7 tasks" in done.stdout
    engine = sa.create_engine(f"duckdb:///{tmp_path / 'store.duckdb'}")
    with engine.connect() as conn:
        got = conn.execute(
            sa.text("SELECT task_id, valid, stop_reason, reward, error FROM episodes")
        ).all()
    engine.dispose()
    by_task = {task_id: (valid, stop, reward, error) for task_id, valid, stop, reward, error in got}
    aviato_id = next(t for t in by_task if t.startswith("t-"))
    expected[aviato_id] = 1.0
    assert sorted(by_task) == sorted(expected)
    for task_id, reward in expected.items():
        valid, stop, got_reward, error = by_task[task_id]
        assert valid and stop == "submitted", (task_id, stop, error)
        assert got_reward == pytest.approx(reward), (task_id, got_reward)
    assert run_containers(name, f"duckdb:///{tmp_path / 'store.duckdb'}") == []


def collect_eval(
    tmp_path: Path,
    *,
    name: str,
    tasks: Path,
    url: str,
    server,
    store: Path,
    pool_size: int,
    max_concurrent: int,
) -> subprocess.CompletedProcess:
    """`sandpiper collect --eval` on ``tasks`` against the scripted endpoint at ``url`` (shut
    down after the run), storing into the DuckDB file ``store``; fails the test on an error."""
    config = tmp_path / "eval.toml"
    config.write_text(
        f'name = "{name}"\nruns_dir = "{tmp_path / "runs"}"\n'
        f'[store]\nurl = "duckdb:///{store}"\nflush_interval_s = 0.2\n'
        f"[sandbox]\npool_size = {pool_size}\nmemory_mb = 256\nworkspace_size_mb = 64\n"
        f'[collector]\ntasks = "{tasks}"\nvalidation_group_size = 1\nmax_turns = 4\n'
        f"max_tokens_per_turn = 2048\nmax_concurrent_episodes = {max_concurrent}\n"
    )  # fmt: skip
    try:
        cmd = [sys.executable, "-m", "sandpiper.cli", "collect", "--config", str(config),
               "--eval", "--endpoint", url, "--model", "scripted"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=500)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done
