"""compose.yaml parses with podman-compose and wires the services the README promises."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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
    assert (REPO / "configs" / "gpu.toml").is_file()
