"""Cross-process access to one DuckDB file: an exclusive lock with a writer turnstile.

DuckDB lets one process open a file read-write and blocks every other open (even read-only)
meanwhile, so every process takes ``<db>.lock`` for one short open→transaction→close.

- **Bounded wait, named holder.** The holder writes ``pid``, its command line and the mode
  into ``<db>.lock.holder``; a waiter that times out raises :class:`StoreLockTimeout` with
  that text, so the user sees who is in the way.
- **No writer starvation.** Every process first takes a turnstile lock ``<db>.lock.intent``
  and keeps it while it waits for the main lock. So only one process at a time waits on the
  main lock, and a reader that arrives while a writer waits queues behind that writer
  instead of overtaking it again and again (and a looping writer cannot shut readers out).
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
        self.base = str(db_path)
        self.timeout_s = timeout_s
        self.holder_path = Path(self.base + ".lock.holder")

    def holder(self) -> str:
        """Who holds (or last held) the lock, as written by that process."""
        try:
            return self.holder_path.read_text().strip() or "unknown process"
        except FileNotFoundError:
            return "unknown process"

    def _timeout(self, mode: str, waited_s: float) -> StoreLockTimeout:
        return StoreLockTimeout(
            f"waited {waited_s:.1f} s for the store lock ({mode}) on "
            f"{self.base}.lock; it is held by {self.holder()}. "
            "Wait for that process, or stop it if it is stuck (raise store.lock_timeout_s "
            "to wait longer)."
        )

    @contextmanager
    def hold(self, *, write: bool) -> Iterator[None]:
        """Hold the lock for one short open→transaction→close; ``write`` picks the queue."""
        mode = "write" if write else "read"
        start = time.monotonic()
        # Fresh lock objects per hold: FileLock objects are re-entrant, so sharing one between
        # the writer thread and the caller's thread would let both in at once.
        main = FileLock(self.base + ".lock", thread_local=False)
        intent = FileLock(self.base + ".lock.intent", thread_local=False)
        try:
            # Everyone waits for the main lock while holding the turnstile, so at most one
            # process is in line behind the holder and the line itself is not ordered by
            # kind: a stream of readers cannot keep a writer out, nor a writer loop readers.
            with intent.acquire(timeout=self.timeout_s):
                left = max(0.0, self.timeout_s - (time.monotonic() - start))
                main.acquire(timeout=left)
        except Timeout:
            raise self._timeout(mode, time.monotonic() - start) from None
        try:
            cmd = " ".join(sys.argv)[:200]
            self.holder_path.write_text(f"pid {os.getpid()} ({mode}) running: {cmd}\n")
            yield
        finally:
            main.release()
