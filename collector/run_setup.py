"""What every process of a run sets up the same way on a collector host (``sandpiper
collect``, ``sandpiper gateway``, ``sandpiper eval``): the run's store and its local vLLM
servers."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from sandpiper.config import CollectorSettings
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
    return await start_servers(config.inference, config.model, stack, log_dir=config.run_dir)
