"""Checks a command runs before it starts anything: the mistakes users make, caught while
they are cheap to name (a missing model folder is one line here, 80 lines of Hugging Face
traceback once transformers tries it as a repo id).

Each check raises :class:`~sandpiper.errors.SetupError` with one line that names the setting
and says what to do. None of them imports a heavy library.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sandpiper.config import RunConfig
from sandpiper.config.checks import redact
from sandpiper.errors import SetupError, StoreError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""A Hugging Face repo id (``org/name``): such a ``learner.model`` is accepted when no local
folder ``org`` exists and the Hugging Face cache holds it (nothing is downloaded here)."""

RUN_IDENTITY = (
    ("collector", "tasks"),
    ("collector", "group_size"),
    ("collector", "tools"),
    ("collector", "tool_parser"),
)
"""Settings a run keeps for life: a restart with another value would mix two experiments
under one name. (Other settings may change on a restart: the learner rate, the pool size,
the servers, ``learner.model`` (which a resumed run no longer reads), and ``learner.algo``:
an SFT warm start followed by GRPO is one run.)"""


def check_model(path: str, field: str = "learner.model") -> None:
    """``path`` is a model folder (``config.json`` in it), or a cached Hugging Face repo id."""
    folder = Path(path)
    if folder.is_dir():
        missing = [
            what
            for what, found in (
                ("config.json", (folder / "config.json").is_file()),
                ("weights", any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))),
            )
            if not found
        ]
        if missing:
            raise SetupError(
                f"{field} = {path!r} is not a model folder (no {' and no '.join(missing)} in "
                "it): give the folder `sandpiper model import` or `sandpiper model init-tiny` wrote"
            )
        return
    if folder.exists():
        raise SetupError(
            f"{field} = {path!r} is a file, not a model folder: for a .gguf file run "
            f"`sandpiper model import {path} OUT_DIR` and give OUT_DIR"
        )
    if REPO_ID.fullmatch(path) and not folder.parent.is_dir() and _cached(path):
        return
    raise SetupError(
        f"{field} = {path!r}: no such model folder; create one (`sandpiper model init-tiny "
        f"{path}` for the tiny test model, `sandpiper model import SRC {path}` for a GGUF or "
        "Hugging Face model) or fix the path"
    )


def _cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


TASKS_HINT = (
    "give a JSONL file or a folder of task folders (`sandpiper tasks import SRC --out DIR`)"
)
"""What to give ``collector.tasks``: what the collector reads, or what the import writes."""

SOURCE_HINT = (
    "give a JSONL or JSON file of task rows, a task folder or a folder of them "
    "(docs/tasks.md lists the formats)"
)
"""What to give ``sandpiper tasks import`` / ``list``: any peer's format."""


def check_tasks(source: str, field: str = "collector.tasks", hint: str = TASKS_HINT) -> None:
    """The task source exists and is not empty (its records are checked when loaded)."""
    path = Path(source)
    if not path.exists():
        raise SetupError(f"{field} = {source!r}: no such file or folder; {hint}")
    empty = (
        not any(path.iterdir()) if path.is_dir() else not path.read_text(errors="replace").strip()
    )
    if empty:
        raise SetupError(f"{field} = {source!r} is empty: no tasks to run; {hint}")


def check_port_free(
    port: int, *, host: str = "127.0.0.1", field: str, zero_means_any: bool = True
) -> None:
    """Nothing listens on ``host:port`` (0 = any free port: always fine).

    ``zero_means_any`` is False for a field that refuses 0 (``inference.base_port``): the
    message then does not offer 0, which the config would refuse next."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise SetupError(
                f"{field} = {port}: port {port} on {host} is in use ({e.strerror}): stop what "
                f"holds it (`ss -ltnp 'sport = :{port}'`) or pick another"
                + (" (0 = any free port)" if zero_means_any else "")
            ) from None


def check_endpoint(url: str, field: str = "--endpoint", timeout_s: float = 5.0) -> None:
    """Something accepts connections at ``url``'s host and port. Without this check an
    evaluation against a server that is not running "succeeds": every episode is stored as a
    model_error and the command exits 0."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SetupError(f"{field} = {url!r}: give an http(s) URL, e.g. http://127.0.0.1:8000/v1")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        raise SetupError(
            f"{field} = {url!r}: nothing answers at {parts.hostname}:{port} "
            f"({e.strerror or e}); is the model server running and the URL right?"
        ) from None


def check_server_ports(cfg: RunConfig) -> None:
    """The ports the collector launches its vLLM servers and gateway on are free."""
    inf = cfg.inference
    if not inf.server_urls:
        for i in range(inf.num_servers):
            check_port_free(
                inf.base_port + i, field=f"inference.base_port + {i}", zero_means_any=False
            )
    check_port_free(cfg.collector.gateway_port, field="collector.gateway_port")


def check_podman(image: str | None = None) -> None:
    """podman is installed and, if given, ``image`` exists on this host."""
    if shutil.which("podman") is None:
        raise SetupError(
            "podman is not installed (or not on PATH): install it (apt-get install podman; "
            "see scripts/setup.sh), then `sandpiper sandbox check`"
        )
    if image is None:
        return
    found = subprocess.run(
        ["podman", "image", "exists", image], capture_output=True, text=True, timeout=60
    )
    if found.returncode == 1:
        raise SetupError(
            f"sandbox.image = {image!r} is not on this host: build it with `sandpiper sandbox "
            "build-image` (or set sandbox.image to one `podman images` lists)"
        )


def check_writable(folder: Path, field: str) -> None:
    """``folder`` exists (it is created) and a file can be written in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".sandpiper-write-check-"):
            pass
    except OSError as e:
        raise SetupError(
            f"{field} = {str(folder)!r} is not a folder this process can write "
            f"({e.strerror or e}): choose another or fix its permissions"
        ) from None


def check_run_identity(cfg: RunConfig) -> None:
    """A run of this name in the store was started with the same :data:`RUN_IDENTITY`."""
    stored = _stored_config(cfg)
    if not isinstance(stored, dict):
        return
    for section, field in RUN_IDENTITY:
        old = (stored.get(section) or {}).get(field)
        new = getattr(getattr(cfg, section), field)
        if old is None or _same(field, old, new):
            continue
        raise SetupError(
            f"run {cfg.name!r} already exists in {redact(cfg.store.url)} with {section}.{field}"
            f" = {json.dumps(old)} (this config: {json.dumps(new)}): give this run a new "
            f"--name, or resume it with {section}.{field} = {json.dumps(old)}"
        )


def _same(field: str, old: Any, new: Any) -> bool:
    if field == "tasks":
        return Path(old).resolve() == Path(new).resolve()
    return bool(old == new)


def _stored_config(cfg: RunConfig) -> Any:
    """The stored config of run ``cfg.name``; None when there is no store or no such run."""
    url = cfg.store.url
    if url.startswith("duckdb:///") and not Path(url.removeprefix("duckdb:///")).is_file():
        return None
    import sqlalchemy as sa

    from sandpiper.store import Store
    from sandpiper.store import schema as T

    store = Store(url, lock_timeout_s=cfg.store.lock_timeout_s)
    try:
        with store.connect_readonly() as conn:
            stored = conn.execute(
                sa.select(T.runs.c.config_json).where(T.runs.c.run_id == cfg.name)
            ).scalar()
    except StoreError:
        return None  # no schema yet (or an older one): the part itself says what to do
    return json.loads(stored) if isinstance(stored, str) else stored


def collector_ready(cfg: RunConfig, *, launch_servers: bool) -> None:
    """What ``sandpiper collect`` needs before it starts: tasks, the model (when it launches
    servers), free ports, podman and the image, a writable run folder, and a run name that is
    new or was started with the same settings."""
    check_tasks(cfg.collector.tasks)
    if launch_servers:
        check_model(cfg.learner.model)
        check_server_ports(cfg)
    check_podman(cfg.sandbox.image)
    check_writable(cfg.run_dir, "runs_dir / name")
    check_run_identity(cfg)


def learner_ready(cfg: RunConfig) -> None:
    """What ``sandpiper learn`` needs before it starts: the initial model, a checkpoint
    folder it can write, and a run name that is new or was started with the same settings."""
    check_model(cfg.learner.model)
    checkpoints = cfg.learner.checkpoint_dir
    if checkpoints:
        check_writable(Path(checkpoints), "learner.checkpoint_dir")
    else:
        check_writable(cfg.run_dir / "policies", "runs_dir / name (its policies/ folder)")
    check_run_identity(cfg)


def check_memory(cfg: RunConfig, *, role: str, nproc: int | None = None) -> None:
    """On a host with a CUDA device, the memory planner says this config's ``role`` GPUs
    (``learner`` or ``inference``) can hold it; else the planner's table is the error."""
    from sandpiper.commands._plan import check_fits

    check_fits(cfg, role=role, nproc=nproc)
