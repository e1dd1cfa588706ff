"""The DuckDB cross-process lock: bounded wait naming the holder, writers not starved."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from sandpiper.errors import StoreLockTimeout
from sandpiper.store.locking import DuckDBFileLock

HOLD = """
import sys, time
from sandpiper.store.locking import DuckDBFileLock
lock = DuckDBFileLock(sys.argv[1], timeout_s=5)
with lock.hold(write=True):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_timeout_names_the_holding_process(tmp_path):
    db = tmp_path / "s.duckdb"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(db), "30"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = DuckDBFileLock(db, timeout_s=0.3)
        start = time.monotonic()
        with (
            pytest.raises(StoreLockTimeout, match=rf"pid {holder.pid} \(write\)") as err,
            lock.hold(write=False),
        ):
            pass
        assert 0.25 < time.monotonic() - start < 5
        assert isinstance(err.value, TimeoutError)
    finally:
        holder.kill()
        holder.wait()


def test_released_lock_is_free_again(tmp_path):
    a = DuckDBFileLock(tmp_path / "s.duckdb", timeout_s=0.2)
    b = DuckDBFileLock(tmp_path / "s.duckdb", timeout_s=0.2)
    with a.hold(write=True):
        pass
    with b.hold(write=True):
        pass


def test_waiting_writer_goes_before_readers_that_arrive_later(tmp_path):
    db = tmp_path / "s.duckdb"
    order: list[str] = []
    first = DuckDBFileLock(db, timeout_s=5)

    def take(name: str, write: bool) -> None:
        with DuckDBFileLock(db, timeout_s=5).hold(write=write):
            order.append(name)
            time.sleep(0.05)

    with first.hold(write=False):
        writer = threading.Thread(target=take, args=("writer", True))
        writer.start()
        time.sleep(0.3)  # the writer now waits, holding the turnstile
        readers = [threading.Thread(target=take, args=(f"r{i}", False)) for i in range(3)]
        for r in readers:
            r.start()
        time.sleep(0.3)
    for t in [writer, *readers]:
        t.join(timeout=10)
    assert order[0] == "writer", order
    assert sorted(order[1:]) == ["r0", "r1", "r2"]
