"""DuckDB transactions attach the store file to one long-lived in-memory database per
backend and detach it again: the file must be free for other processes after every
transaction, failed ones included, and no DuckDB database is created per transaction."""

from __future__ import annotations

import subprocess
import sys

import duckdb
import pytest
import sqlalchemy as sa

from sandpiper.store import Store
from sandpiper.store.records import RunRecord

OPEN_ELSEWHERE = """
import sys, duckdb
conn = duckdb.connect(sys.argv[1])  # read-write: fails while another process has it open
print(conn.execute("SELECT count(*) FROM runs").fetchone()[0])
"""


def _rows_seen_by_another_process(path) -> int:
    out = subprocess.run(
        [sys.executable, "-c", OPEN_ELSEWHERE, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(out.stdout)


def _attached(store: Store) -> list[str]:
    host = store.backend._database()
    rows = host.execute("SELECT database_name FROM duckdb_databases() WHERE NOT internal")
    return [name for (name,) in rows.fetchall() if name != "memory"]


@pytest.fixture
def store(tmp_path):
    s = Store(f"duckdb:///{tmp_path / 's.duckdb'}", lock_timeout_s=10)
    s.init()
    yield s
    s.close()


def test_file_is_detached_and_checkpointed_after_each_transaction(store, tmp_path):
    host = store.backend._database()
    store.ensure_run(RunRecord("r1", "{}", "test"))
    assert _attached(store) == []
    assert not (tmp_path / "s.duckdb.wal").exists()  # detaching checkpointed the commit
    assert _rows_seen_by_another_process(tmp_path / "s.duckdb") == 1
    assert store.stats()["rows"]["runs"] == 1  # a read-only transaction
    assert _attached(store) == []
    assert store.backend._database() is host  # one database for every transaction


def test_failed_transactions_detach_too(store, tmp_path):
    with pytest.raises(sa.exc.DBAPIError), store.backend.write() as conn:
        conn.execute(sa.text("INSERT INTO runs (run_id) VALUES ('incomplete')"))
    with pytest.raises(sa.exc.DBAPIError), store.connect_readonly() as conn:
        conn.execute(sa.text("DELETE FROM runs"))
    with pytest.raises(RuntimeError), store.backend.write() as conn:
        conn.execute(sa.text("DELETE FROM runs"))
        raise RuntimeError("the caller fails mid-transaction: rolled back")
    assert _attached(store) == []
    assert _rows_seen_by_another_process(tmp_path / "s.duckdb") == 0
    store.ensure_run(RunRecord("r1", "{}", "test"))
    assert store.stats()["rows"]["runs"] == 1


def test_a_failed_detach_closes_the_host_database(store, monkeypatch, tmp_path):
    """If DETACH itself fails, the file must still be released: the host database (and the
    file with it) is closed, and the next transaction starts a new one."""
    host = store.backend._database()

    class FailingDetach:
        def __init__(self, conn):
            self._conn = conn

        def execute(self, sql, *args):
            if sql.startswith("DETACH"):
                raise duckdb.IOException("simulated failure to detach")
            return self._conn.execute(sql, *args)

        def __getattr__(self, name):
            return getattr(self._conn, name)

    real_cursor = host.cursor
    proxy = _HostProxy(host, lambda: FailingDetach(real_cursor()))
    monkeypatch.setattr(store.backend, "_host", proxy)
    with pytest.raises(duckdb.IOException):
        store.ensure_run(RunRecord("r1", "{}", "test"))
    assert store.backend._host is None
    assert _rows_seen_by_another_process(tmp_path / "s.duckdb") == 1  # committed, released
    assert store.backend._database() is not host
    store.ensure_run(RunRecord("r2", "{}", "test"))
    assert store.stats()["rows"]["runs"] == 2


class _HostProxy:
    """The host database with its ``cursor`` replaced (DuckDB's own objects are immutable)."""

    def __init__(self, host, cursor):
        self._host, self.cursor = host, cursor

    def __getattr__(self, name):
        return getattr(self._host, name)
