"""Logging that a person can read: Sandpiper's own INFO lines, other libraries' warnings.

:func:`setup_logging` is called once per process by the CLI (``sandpiper.cli``):

- one handler on the root logger, ``HH:MM:SS LEVEL name: message``;
- third-party loggers that speak at INFO for routine work (httpx logs every HTTP request,
  mlflow, DeepSpeed, transformers, vLLM's client side, ...) are raised to WARNING, unless
  ``--verbose`` (or ``SANDPIPER_VERBOSE=1``, which child processes inherit);
- progress bars (transformers' "Loading weights" / "Writing model shards", huggingface_hub's
  downloads, any tqdm) are turned off when stderr is not a terminal, where they would turn
  a log file into carriage-return soup. They are switched off through environment variables
  read at import, so they also reach the processes Sandpiper starts (learner, vLLM).

This module imports only the standard library: it runs before anything heavy is imported.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TextIO

VERBOSE_ENV = "SANDPIPER_VERBOSE"
"""``1`` = show third-party INFO logs (set by ``--verbose``, inherited by child processes)."""

QUIET_LOGGERS = (
    "httpx",
    "httpcore",
    "urllib3",
    "openai",
    "transformers",
    "huggingface_hub",
    "filelock",
    "vllm",
    "mlflow",
    "alembic",
    "DeepSpeed",
    "deepspeed",
    "torch.distributed",
    "matplotlib",
    "PIL",
    "asyncio",
)
"""Loggers held at WARNING unless verbose: each logs routine work at INFO."""

PROGRESS_BAR_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
"""Read at import by huggingface_hub / transformers (progress bars) and tqdm (>= 4.66)."""

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_format() -> str:
    """:data:`FORMAT`, with the rank in processes of a multi-process learner (the DeepSpeed
    launcher and torchrun set ``RANK`` / ``WORLD_SIZE``), whose lines share one stream."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return f"%(asctime)s %(levelname)s rank {os.environ.get('RANK', '?')} %(name)s: %(message)s"
    return FORMAT


def is_verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0", "false")


class _RootHandler(logging.StreamHandler):
    """The one handler :func:`setup_logging` puts on the root logger (found again by type).

    Without a stream of its own it writes to whatever ``sys.stderr`` is at each record, not
    the one of the moment it was made: a stream replaced since (a test's capture, closed
    after the test) would fail every later record with "I/O operation on closed file"."""

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__(stream)
        self._follow_stderr = stream is None

    def emit(self, record: logging.LogRecord) -> None:
        if self._follow_stderr:
            self.stream = sys.stderr  # the handler's lock is held here
        super().emit(record)


def setup_logging(
    *, verbose: bool | None = None, stream: TextIO | None = None, level: int = logging.INFO
) -> None:
    """Configure the root logger once (calling it again only changes the levels)."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    verbose = is_verbose()
    root = logging.getLogger()
    if not any(isinstance(h, _RootHandler) for h in root.handlers):
        handler = _RootHandler(stream)  # None: sys.stderr as it is at each record
        handler.setFormatter(logging.Formatter(log_format(), datefmt="%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(level)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)
    # mlflow sets its own logger's level when imported, from this variable.
    os.environ["MLFLOW_LOGGING_LEVEL"] = "INFO" if verbose else "WARNING"
    if not _is_tty(stream or sys.stderr):
        disable_progress_bars()


def disable_progress_bars() -> None:
    """Turn progress bars off here and in child processes (env), and in libraries already
    imported (their switches are read at import)."""
    for key, value in PROGRESS_BAR_ENV.items():
        os.environ.setdefault(key, value)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars as hub_disable

        hub_disable()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def file_tail(path: str | Path | None, n_bytes: int = 4000) -> str:
    """The last ``n_bytes`` of a log file as text, for an error message ("(no log)" when
    there is none); read from the end, so a large log costs nothing more."""
    try:
        with open(path or "", "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - n_bytes))
            return f.read().decode("utf-8", errors="replace").strip() or "(empty)"
    except OSError:
        return "(no log)"
