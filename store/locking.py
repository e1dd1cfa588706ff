"""Cross-process access to one DuckDB file: an exclusive lock with a writer turnstile.

DuckDB lets one process open a file read-write and blocks every other open (even read-only)
meanwhile, so every process takes ``<db>.lock`` for one short open→transaction→close.

- **Bounded wait, named holder.** The holder writes ``pid``, its command line and the mode
  into ``<db>.lock.holder``; a waiter that times out raises :class:`StoreLockTimeout` with
  that text, so the user sees who is in the way.
- **No writer starvation.** Writers first take a turnstile lock ``<db>.lock.intent`` and keep
  it while they wait for the main lock. Readers pass through the same turnstile (take and
  release it at once) before waiting for the main lock, so a reader that arrives while a
  writer waits queues behind that writer instead of overtaking it again and again.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from sandpiper.errors import StoreLockTimeout


class DuckDBFileLock:
    """Exclusive, fair-to-writers lock around one DuckDB file (see module docstring)."""

    def __init__(self, db_path: str | Path, *, timeout_s: float) -> None:
        base = str(db_path)
        self.timeout_s = timeout_s
        self.holder_path = Path(base + ".lock.holder")
        # thread_local=False: one Store may be used from the writer thread and the caller.
        self._main = FileLock(base + ".lock", thread_local=False)
        self._intent = FileLock(base + ".lock.intent", thread_local=False)

    def holder(self) -> str:
        """Who holds (or last held) the lock, as written by that process."""
        try:
            return self.holder_path.read_text().strip() or "unknown process"
        except FileNotFoundError:
            return "unknown process"

    def _timeout(self, mode: str, waited_s: float) -> StoreLockTimeout:
        return StoreLockTimeout(
            f"waited {waited_s:.1f} s for the store lock ({mode}) on "
            f"{self._main.lock_file}; it is held by {self.holder()}. "
            "Wait for that process, or stop it if it is stuck (raise store.lock_timeout_s "
            "to wait longer)."
        )

    @contextmanager
    def hold(self, *, write: bool) -> Iterator[None]:
        """Hold the lock for one short open→transaction→close; ``write`` picks the queue."""
        mode = "write" if write else "read"
        start = time.monotonic()
        try:
            if write:
                with self._intent.acquire(timeout=self.timeout_s):
                    left = max(0.0, self.timeout_s - (time.monotonic() - start))
                    self._main.acquire(timeout=left)
            else:
                with self._intent.acquire(timeout=self.timeout_s):
                    pass
                left = max(0.0, self.timeout_s - (time.monotonic() - start))
                self._main.acquire(timeout=left)
        except Timeout:
            raise self._timeout(mode, time.monotonic() - start) from None
        try:
            cmd = " ".join(sys.argv)[:200]
            self.holder_path.write_text(f"pid {os.getpid()} ({mode}) running: {cmd}\n")
            yield
        finally:
            self._main.release()
