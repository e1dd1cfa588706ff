"""What every process of a run sets up the same way on a collector host (``sandpiper
collect``, ``sandpiper gateway``, ``sandpiper eval``): the run's store and its local vLLM
servers."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandpiper.config import CollectorSettings
from sandpiper.errors import ConfigError
from sandpiper.version import code_version

if TYPE_CHECKING:
    from sandpiper.store import Store


def open_store(config: CollectorSettings) -> Store:
    """The run's store, initialised, with this run registered (its config and code version)."""
    from sandpiper.store import Store
    from sandpiper.store.records import RunRecord

    store = Store(config.store.url, lock_timeout_s=config.store.lock_timeout_s)
    store.init()
    run = RunRecord(config.name, config.resolved_json, code_version())
    store.ensure_run(run)
    return store


async def start_run_servers(
    config: CollectorSettings, stack: contextlib.AsyncExitStack
) -> list[Any]:
    """The run's local servers on version 0 (none when ``inference.server_urls`` is given),
    logging to ``inference.log_dir`` or else the run's folder."""
    from sandpiper.collector.inference.vllm_server import start_servers

    if config.inference.server_urls:
        return []
    return await start_servers(
        config.inference, served_model(config.model), stack, log_dir=config.run_dir
    )


def served_model(model: str) -> str:
    """What a server is sent for version 0: the absolute path of ``learner.model`` when it is
    a folder here (a server has its own working directory), else the name as given (a hub
    id). A folder whose ``config.json`` ties the output layer to the embedding is refused:
    vLLM would then hold one matrix for both, and after the first in-place reload of an
    (untied) learner checkpoint its output layer would silently differ from the learner's."""
    path = Path(model)
    if not path.is_dir():
        return model
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    tied = cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings"))
    if tied:
        raise ConfigError(
            f"learner.model {model} ties its output layer to its embedding "
            "(tie_word_embeddings = true), which vLLM cannot reload in place: write an untied "
            f"copy once with `sandpiper model import {model} DIR` (add `--dtype bfloat16` for "
            "a GPU) and set learner.model = DIR"
        )
    return str(path.resolve())
