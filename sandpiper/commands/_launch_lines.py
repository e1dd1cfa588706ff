"""The vLLM command lines ``sandpiper config check`` validates: those of the servers a run
config launches, and the vLLM service of a compose file."""

from __future__ import annotations

import re
from pathlib import Path

from sandpiper.config import RunConfig
from sandpiper.errors import ConfigError

_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def config_vllm_args(cfg: RunConfig, label: str) -> dict[str, list[str]]:
    """``{"<label>: server <port>": flags}`` of every local server of ``cfg`` (none when it
    uses ``inference.server_urls``: those are launched elsewhere, e.g. by compose)."""
    from sandpiper.collector.inference.vllm_server import VLLMServer

    inf = cfg.inference
    if inf.server_urls:
        return {}
    out = {}
    for i in range(inf.num_servers):
        server = VLLMServer.from_config(inf, cfg.learner.model, index=i)
        out[f"{label}: server {server.port}"] = server.command()[3:]  # after python -m MODULE
    return out


def compose_vllm_args(path: Path) -> list[str]:
    """The ``vllm`` service's command of a compose file, ``${VAR:-default}`` as its default."""
    import yaml

    try:
        service = yaml.safe_load(Path(path).read_text())["services"]["vllm"]
    except (OSError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: no services.vllm to check ({e})") from None
    command = service.get("command") or []
    if isinstance(command, str):
        command = command.split()
    return [_VAR.sub(lambda m: m.group(2) or "", str(arg)) for arg in command]
