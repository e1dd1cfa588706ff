"""The library failures a user's setup causes, as one line that says what to do.

A full disk, a folder that cannot be written, a port in use, a store server that does not
answer, podman not installed: these reach the CLI as exceptions of the standard library,
SQLAlchemy, DuckDB or psycopg, whose tracebacks say little to someone who only ran a command.
:func:`explain` recognises them (by errno, or by class name, so that nothing heavy is imported
here) and returns the line; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import re

from sandpiper.config.checks import redact

NO_SPACE = "No space left on device"

RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)(?::\s*(\S.*))?")
"""How polars (Rust) words an ``OSError`` it raises without ``errno`` or ``filename``:
``Read-only file system (os error 30): /path/x.parquet``."""


def _chain(exc: BaseException):
    """``exc`` and its causes (``raise ... from``, or the exception it happened during)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]


def _os_error(exc: OSError) -> tuple[int | None, str | None]:
    """``exc``'s errno and file name, read from its message when a Rust library left the
    attributes empty."""
    if exc.errno is not None:
        return exc.errno, exc.filename
    found = RUST_OS_ERROR.search(str(exc))
    if found is None:
        return None, exc.filename
    return int(found.group(1)), exc.filename or found.group(2)


def _where(filename: str | None) -> str:
    return f" ({filename})" if filename else ""


def explain(exc: BaseException, *, store_url: str | None = None) -> str | None:
    """One line for a failure of the user's setup, or None for anything else."""
    for e in _chain(exc):
        line = _explain_one(e, store_url)
        if line:
            return line
    return None


def _explain_one(e: BaseException, store_url: str | None) -> str | None:
    code, filename = _os_error(e) if isinstance(e, OSError) else (None, None)
    if code == errno.ENOSPC or NO_SPACE in str(e):
        where = _where(filename)
        return (
            f"no space left on the device{where}: free some space, or point runs_dir, "
            "learner.checkpoint_dir or --out at a disk with room, then run the command again "
            "(the store and the spool keep what was committed)"
        )
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (
            f"permission denied{_where(filename)}: {os.strerror(code)}; choose a folder you can write "
            "(runs_dir, learner.checkpoint_dir, --out) or fix its permissions"
        )
    if code == errno.EADDRINUSE:
        return (
            "a port this command needs is in use: stop what holds it (`ss -ltnp` shows it) or "
            "pick another (--port, inference.base_port, collector.gateway_port; 0 = any free)"
        )
    if isinstance(e, FileNotFoundError) and e.filename == "podman":
        return "podman is not installed (or not on PATH): install it (apt-get install podman)"
    name, module = type(e).__name__, type(e).__module__
    if name == "OperationalError" and module.startswith(("sqlalchemy", "psycopg")):
        reason = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
        where = f" {redact(store_url)}" if store_url else ""
        return (
            f"cannot reach the store{where}: {redact(reason)}; is the server running and "
            "store.url right?"
        )
    return None
