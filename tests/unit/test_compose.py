"""compose.yaml parses with podman-compose and wires the services the README promises."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PODMAN_COMPOSE = Path(sys.executable).parent / "podman-compose"


def _resolved() -> dict:
    exe = str(PODMAN_COMPOSE) if PODMAN_COMPOSE.exists() else shutil.which("podman-compose")
    assert exe, "podman-compose is a dev dependency and must be installed"
    out = subprocess.run(
        [exe, "-f", str(REPO / "compose.yaml"), "config"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_compose_config_resolves_with_every_service() -> None:
    services = _resolved()["services"]
    assert {"vllm", "collector", "learner", "mlflow"} <= set(services)


def test_postgres_is_optional() -> None:
    raw = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert raw["services"]["postgres"]["profiles"] == ["postgres"]


def test_collector_gets_the_podman_socket_and_nothing_else_does() -> None:
    services = _resolved()["services"]
    with_socket = [
        name
        for name, svc in services.items()
        if any("podman.sock" in str(v) for v in svc.get("volumes", []))
    ]
    assert with_socket == ["collector"]


def test_files_referenced_by_compose_exist() -> None:
    assert (REPO / "Containerfile").is_file()
    assert (REPO / "configs" / "gpu-8xh100-qwen2.5-7b.toml").is_file()


def test_gpus_are_reserved_by_id_and_disjoint() -> None:
    """`count: 1` maps to GPU 0 for every service that asks; device_ids per service, disjoint."""
    services = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    taken: list[str] = []
    for name in ("vllm", "learner"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in device and device["device_ids"], name
        taken += device["device_ids"]
    assert len(taken) == len(set(taken))


def test_vllm_is_pinned_and_waited_for_long_enough() -> None:
    vllm = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["vllm"]
    assert vllm["image"].endswith(":v0.32.0}")
    assert "latest" not in vllm["image"]
    start = vllm["healthcheck"]["start_period"]
    assert int(start.rstrip("s")) >= 600  # a 7 B model's load and graph capture
    assert all("restart" in svc for n, svc in _resolved()["services"].items() if n != "postgres")


def test_collector_scales_without_colliding_state() -> None:
    """`--scale collector=N`: nothing fixed per container that replicas would share or clash
    on (name, host ports, host name); each replica spools into its own folder (by host name)
    on a volume that survives it, so a replacement commits what it left behind."""
    collector = _resolved()["services"]["collector"]
    assert not {"container_name", "ports", "hostname"} & set(collector)
    command = collector["command"]
    spool = command[command.index("--store.spool_dir") + 1]
    mounts = [str(v) for v in collector["volumes"]]
    assert any(m.split(":")[1] == spool for m in mounts if m.startswith("collector-spool:")), mounts
    assert "collector-spool" in _resolved()["volumes"]


def test_the_project_image_needs_no_registry() -> None:
    """No machine here can pull docker.io: the image starts from the local rootfs image."""
    froms = [line for line in (REPO / "Containerfile").read_text().splitlines()
             if line.startswith(("FROM", "ARG BASE_IMAGE"))]  # fmt: skip
    assert froms == ["ARG BASE_IMAGE=localhost/sandpiper-sandbox:latest", "FROM ${BASE_IMAGE}"]


def test_collector_bind_sources_resolve_on_the_host() -> None:
    """The collector drives the HOST's podman, which resolves bind sources on the host: its
    ``sandbox.host_state_dir`` (where every bind source lies) is in a folder mounted at the
    same path inside and outside, and passes the config's own check."""
    from sandpiper.config import SandboxConfig

    collector = _resolved()["services"]["collector"]
    command = collector["command"]
    state_dir = command[command.index("--sandbox.host_state_dir") + 1]
    SandboxConfig(host_state_dir=state_dir)
    same_path = [
        source
        for source, target, *_ in (str(v).split(":") for v in collector["volumes"])
        if source == target
    ]
    assert any(state_dir.startswith(f"{source.rstrip('/')}/") for source in same_path), (
        state_dir,
        collector["volumes"],
    )
    assert collector["environment"]["CONTAINER_HOST"] == "unix:///run/podman/podman.sock"


def test_the_learner_ranks_take_the_containers_own_gpu_numbers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The learner container is given host GPUs 4-7, which CUDA inside it numbers 0-3: its
    launch line (`sandpiper learn --dry-run` on compose's own command) includes exactly those,
    where the config's host ids would make DeepSpeed's launcher fail ("No slot '4'")."""
    from typer.testing import CliRunner

    from sandpiper.cli import app

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the NVIDIA runtime sets none
    learner = _resolved()["services"]["learner"]
    (device,) = learner["deploy"]["resources"]["reservations"]["devices"]
    inside = ",".join(str(i) for i in range(len(device["device_ids"])))
    command = learner["command"]
    assert command[:2] == ["sandpiper", "learn"]
    monkeypatch.chdir(REPO)  # the service's working directory holds configs/ as REPO does
    out = CliRunner().invoke(app, [*command[1:], "--dry-run"])
    assert out.exit_code == 0, out.output
    (rank_launcher,) = json.loads(out.output)["processes"]
    argv = rank_launcher["argv"]
    assert argv[argv.index("--include") + 1] == f"localhost:{inside}"


def test_vllm_reads_the_checkpoints_where_the_learner_registers_them() -> None:
    """A version is registered as /app/runs/<run>/policies/vN (the learner's working folder is
    /app): the vLLM service must see ./runs at that path, or the first reload fails."""
    services = _resolved()["services"]
    learner_runs = [v for v in services["learner"]["volumes"] if str(v).endswith(":/app/runs")]
    assert learner_runs, services["learner"]["volumes"]
    source = learner_runs[0].split(":")[0]
    assert f"{source}:/app/runs:ro" in services["vllm"]["volumes"], services["vllm"]["volumes"]
