"""What differs between the two store backends: opening connections and bulk Arrow I/O.

- :class:`DuckDBBackend`: one file; every transaction takes the cross-process lock,
  attaches the file to a long-lived in-memory DuckDB (read-write with small row groups, see
  ``ROW_GROUP_ROWS``; or read-only), runs, detaches. Bulk inserts register Arrow tables and ``INSERT … SELECT``
  from them; reads fetch Arrow directly.
- :class:`PostgresBackend`: a pooled engine; bulk inserts stream rows with ``COPY``; claims
  use ``FOR UPDATE SKIP LOCKED`` so that concurrent learners never take the same group.

Both insert only groups whose ``group_id`` is not stored yet (idempotent ingest).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import sqlalchemy as sa

from sandpiper.errors import StoreError
from sandpiper.store import schema
from sandpiper.store.locking import DuckDBFileLock

_DUCKDB_CONFIG: dict[str, Any] = {"autoinstall_known_extensions": False}
"""Only bundled extensions exist offline; never try to download one."""

ROW_GROUP_ROWS = 8_192
"""Row-group size of the read-write attach (DuckDB's default is 122,880 rows).

Why smaller: an INSERT of at least one row group is written straight into the database
file, compressed ("optimistic write"), instead of into the WAL and then again by the
checkpoint at close; a writer batch of 2,000 trajectories is ~40,000 turn rows, well under
the default. And the learner's claim reads 64 groups' turns, which zone maps then find at
8k-row granularity instead of decompressing a whole 122,880-row group of token lists.
Measured (2,000 trajectories × 20 turns × 500 tokens per commit): default ~1.7 s per
commit; 16,384 rows ~1.0 s but every other close re-checkpointed for +1.1 s; 8,192 rows
~1.0 s steadily. DuckDB does not persist this option in the file: every read-write open
attaches with it.
"""


class Connections(Protocol):
    """What the store's rooms (``store.slots``, ``store.claims``, ``store.policy_versions``,
    ``store.leases``, ``store.dead_letters``) need of the ``Store`` that composes them: its
    transactions (``store.Store`` provides them)."""

    def transaction(self) -> AbstractContextManager[sa.Connection]:
        """One write transaction (schema checked), committed on a clean exit."""
        ...

    def connect_readonly(self) -> AbstractContextManager[sa.Connection]:
        """One read-only connection (schema checked)."""
        ...


def _raw(conn: sa.Connection) -> Any:
    """The driver's own connection (duckdb / psycopg), for Arrow registration and COPY."""
    return conn.connection.dbapi_connection


def _keep_new(tables: dict[str, pa.Table], new_ids: pa.Array) -> dict[str, pa.Table]:
    """Only the rows of groups in ``new_ids``; the tables themselves when all are new."""
    if len(new_ids) == tables["groups"].num_rows:  # the usual case: skip copying every array
        return tables
    return {n: t.filter(pc.is_in(t["group_id"], value_set=new_ids)) for n, t in tables.items()}


class DuckDBBackend:
    """Short, lock-protected connections to one DuckDB file."""

    def __init__(self, url: str, *, lock_timeout_s: float) -> None:
        self.url = url
        self.path = Path(sa.make_url(url).database or "")
        if not self.path.name or str(self.path) == ":memory:":
            raise StoreError(f"DuckDB store needs a file path, got {url!r}")
        self.lock = DuckDBFileLock(self.path, timeout_s=lock_timeout_s)
        self._host: Any = None  # the in-memory DuckDB the file is attached to, see _attach
        self._host_pid = 0
        self._host_lock = threading.Lock()
        pool = sa.pool.NullPool  # each checkout attaches the file, each release detaches it
        self._rw = sa.create_engine(url, poolclass=pool, creator=self._connect_rw)
        self._ro = sa.create_engine(url, poolclass=pool, creator=self._connect_ro)

    def _connect_rw(self) -> Any:
        # only ATTACH takes ROW_GROUP_SIZE (not persisted in the file: every open sets it)
        return self._attach(f"ROW_GROUP_SIZE {ROW_GROUP_ROWS}")

    def _connect_ro(self) -> Any:
        return self._attach("READ_ONLY")

    def _attach(self, options: str) -> Any:
        """A connection to this process's in-memory DuckDB with the file attached as the
        default catalog; :meth:`_session` detaches it after the connection is closed.

        Why not a new ``duckdb.connect`` per transaction: creating a DuckDB database costs
        ~20 ms CPU (measured, DuckDB 2.0), an ATTACH + DETACH on a live one ~2 ms, and every
        store transaction (each claim, commit and read) opens the file once. The in-memory
        database holds nothing between transactions: under the file lock only one
        connection of this backend has the file attached, and a connection's registered
        Arrow tables and temporary views close with it.
        """
        from duckdb_engine import ConnectionWrapper

        conn = self._database().cursor()
        try:
            path = str(self.path).replace("'", "''")
            conn.execute(f"ATTACH '{path}' AS {_ALIAS} ({options})")
            conn.execute(f"USE {_ALIAS}")
        except BaseException:
            conn.close()
            raise
        return ConnectionWrapper(conn)

    def _database(self) -> Any:
        """The in-memory host database, created on first use (and again in a forked child:
        a DuckDB database's threads do not survive ``fork``)."""
        import duckdb

        with self._host_lock:
            if self._host is None or self._host_pid != os.getpid():
                self._host = duckdb.connect(":memory:", config=_DUCKDB_CONFIG)
                self._host_pid = os.getpid()
            return self._host

    def _detach(self) -> None:
        """Detach the file, which checkpoints and releases it as closing a database does
        (DuckDB's own file lock would otherwise shut every other process out). If that
        fails, the whole host database is closed, and with it the file."""
        import duckdb

        with self._host_lock:
            host = self._host if self._host_pid == os.getpid() else None
        if host is None:
            return
        try:
            conn = host.cursor()
            try:
                conn.execute(f"DETACH DATABASE IF EXISTS {_ALIAS}")
            finally:
                conn.close()
        except duckdb.Error:
            self._drop_database()
            raise

    def _drop_database(self) -> None:
        with self._host_lock:
            host, self._host = self._host, None
        if host is not None and self._host_pid == os.getpid():
            host.close()

    @contextmanager
    def _session(self, *, write: bool) -> Iterator[sa.Connection]:
        """Lock, attach, one transaction (write) or reads, close, detach, unlock."""
        connect = self._rw.begin if write else self._ro.connect
        with self.lock.hold(write=write):
            try:
                with connect() as conn:
                    yield conn
            finally:
                self._detach()

    def prepare(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def lock_schema(self, conn: sa.Connection) -> None:
        """Nothing to do: the file lock already serialises every writer."""

    @contextmanager
    def write(self) -> Iterator[sa.Connection]:
        """Lock, open read-write, one transaction, close."""
        with self._session(write=True) as conn:
            yield conn

    @contextmanager
    def read(self) -> Iterator[sa.Connection]:
        """Lock briefly, open read-only, close."""
        if not self.path.exists():
            raise StoreError(
                f"no store at {self.path}; run `sandpiper store init --url {self.url}`"
            )
        with self._session(write=False) as conn:
            yield conn

    def dispose(self) -> None:
        self._rw.dispose()
        self._ro.dispose()
        self._drop_database()


_ALIAS = "store"
"""The attached file's catalog name (``USE store``: SQL names its tables unqualified)."""


SCHEMA_LOCK_KEY = 0x53414E44  # "SAND": PostgreSQL advisory lock key of schema changes


class PostgresBackend:
    """A pooled engine; COPY for bulk rows; SKIP LOCKED claims."""

    def __init__(self, url: str, *, lock_timeout_s: float) -> None:
        self.url = url
        ms = int(lock_timeout_s * 1000)
        self._engine = sa.create_engine(
            url,
            pool_pre_ping=True,
            connect_args={"options": f"-c lock_timeout={ms} -c statement_timeout=0"},
        )
        sa.event.listen(self._engine, "rollback", _forget_temp_tables)

    def prepare(self) -> None:
        pass

    def lock_schema(self, conn: sa.Connection) -> None:
        """Serialise schema creation and migrations between processes for the rest of
        ``conn``'s transaction (a transaction-level advisory lock). Two collectors starting
        at once on a fresh database would otherwise both see version 0 and both run the
        ``CREATE TABLE``s; the second waits here, then finds the schema made."""
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK_KEY})

    @contextmanager
    def write(self) -> Iterator[sa.Connection]:
        with self._engine.begin() as conn:
            yield conn

    @contextmanager
    def read(self) -> Iterator[sa.Connection]:
        with self._engine.connect() as conn:
            conn.exec_driver_sql("SET TRANSACTION READ ONLY")
            try:
                yield conn
            finally:
                conn.rollback()

    def dispose(self) -> None:
        self._engine.dispose()


def _forget_temp_tables(conn: sa.Connection) -> None:
    """A rolled-back transaction takes the temp tables it created with it: forget them, so
    that the next write on this pooled connection creates them again (the first failed
    commit used to leave every later one failing with ``relation "_in_groups" does not
    exist``)."""
    # a connection that is gone raises here; its replacement starts without temp tables
    with contextlib.suppress(sa.exc.SQLAlchemyError):
        conn.connection.info.pop("_in_groups", None)


def copy_arrow(conn: sa.Connection, name: str, table: pa.Table) -> None:
    """COPY ``table`` into PostgreSQL table ``name`` as text rows formatted by Arrow compute.

    Why not ``copy.write_row``: without psycopg's C extension its array dumper runs in
    Python per element (a regex per number) — measured ~80 % of a writer's time, which
    made concurrent writers CPU-bound on the client instead of on the server."""
    cols = ", ".join(f'"{c}"' for c in table.column_names)
    cursor = _raw(conn).cursor()
    with cursor.copy(f'COPY "{name}" ({cols}) FROM STDIN') as copy:
        for batch in table.to_batches(max_chunksize=4096):
            copy.write(_copy_text(batch))


def insert_arrow(conn: sa.Connection, name: str, table: pa.Table) -> None:
    """Append ``table``'s rows to table ``name`` on either backend (bulk)."""
    if conn.dialect.name == "postgresql":
        copy_arrow(conn, name, table)
        return
    _duckdb_insert(_raw(conn), name, table)


def _duckdb_insert(raw: Any, name: str, table: pa.Table) -> None:
    """``INSERT … SELECT`` from ``table`` registered with DuckDB, handed over in record
    batches of one row group each (slices: no copy).

    Why batches: DuckDB scans a registered Arrow table one record batch per thread, and the
    writer's tables arrive as one batch each, so the insert (and the zstd of the turns'
    packed arrays) ran on one core. Measured (2,000 trajectories × 20 turns × 500 tokens,
    2 cores, quiet machine): the turns insert 0.23 → 0.12 s wall (CPU unchanged), the file
    no larger; order is kept (``preserve_insertion_order``, DuckDB's default)."""
    batches = table.to_batches(max_chunksize=ROW_GROUP_ROWS)
    cols = ", ".join(f'"{c}"' for c in table.column_names)
    raw.register("_in_rows", pa.Table.from_batches(batches, table.schema))
    try:
        raw.execute(f'INSERT INTO "{name}" ({cols}) SELECT {cols} FROM _in_rows')
    finally:
        _unregister(raw, "_in_rows")


def _unregister(raw: Any, name: str) -> None:
    """Unregister an Arrow view. After a failed statement DuckDB refuses this too ("current
    transaction is aborted"); that refusal must not hide the error that failed the insert
    (the view goes with the connection anyway)."""
    import duckdb

    with contextlib.suppress(duckdb.Error):
        raw.unregister(name)


def fetch_arrow(conn: sa.Connection, sql: str, params: list | None = None) -> pa.Table:
    """Rows of ``sql`` (``?`` placeholders) as Arrow on either backend."""
    if conn.dialect.name != "postgresql":
        return _raw(conn).sql(sql, params=params or None).to_arrow_table()
    # psycopg has no Arrow fetch: rows → Arrow, types inferred from the values
    cursor = _raw(conn).cursor()
    cursor.execute(sql.replace("?", "%s"), params or [])
    names = [d[0] for d in cursor.description]
    rows = cursor.fetchall()
    return pa.table({n: [r[i] for r in rows] for i, n in enumerate(names)})


_COPY_ESCAPES = (("\\", "\\\\"), ("\t", "\\t"), ("\n", "\\n"), ("\r", "\\r"))
"""PostgreSQL text COPY escapes (backslash first), applied to string columns."""


def _copy_field(col: pa.Array) -> pa.Array:
    """One column as COPY text fields: escaped strings, ``{a,b}`` arrays, ``\\N`` for NULL."""
    if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
        text = _bytea_hex(col)
    elif pa.types.is_list(col.type):
        joined = pc.binary_join(pc.cast(col, pa.list_(pa.string())), ",")
        text = pc.binary_join_element_wise("{", joined, "}", "")
    elif pa.types.is_string(col.type):
        text = col
        for raw, escaped in _COPY_ESCAPES:
            text = pc.replace_substring(text, raw, escaped)
    else:  # numbers (shortest round-trip text), booleans, UTC timestamps ("...Z")
        text = pc.cast(col, pa.string())
    return pc.fill_null(text, "\\N")


def _bytea_hex(col: pa.Array) -> pa.Array:
    """Binary values as text COPY bytea fields (``\\\\x`` + hex; the backslash escaped for
    COPY): the whole values buffer hex-encoded in one call, then cut by the offsets, instead
    of a Python ``bytes.hex()`` per value."""
    col = pc.cast(col, pa.large_binary())
    n = len(col)
    offsets = np.frombuffer(col.buffers()[1], np.int64, n + 1, col.offset * 8)
    start, stop = int(offsets[0]), int(offsets[-1])
    data = col.buffers()[2]
    hex_digits = memoryview(data)[start:stop].hex().encode() if data is not None else b""
    validity = pc.is_valid(col).buffers()[1] if col.null_count else None  # offset 0, as ours
    digits = pa.LargeStringArray.from_buffers(
        n, pa.py_buffer(2 * (offsets - start)), pa.py_buffer(hex_digits), validity, col.null_count
    )
    digits = pc.cast(digits, pa.string())
    return pc.binary_join_element_wise("\\\\x", digits, "")


def _copy_text(batch: pa.RecordBatch) -> memoryview:
    """A record batch as PostgreSQL text COPY data (tab-separated, one line per row).

    The lines are joined by Arrow; their concatenation is the string array's own values
    buffer, handed to COPY without a copy (a Python string per row was a third of the time)."""
    if batch.num_rows == 0:
        return memoryview(b"")
    fields = [_copy_field(c) for c in batch.columns]
    rows = pc.binary_join_element_wise(*fields, "\t")
    lines = pc.cast(pc.binary_join_element_wise(rows, "\n", ""), pa.large_string())
    offsets = np.frombuffer(lines.buffers()[1], np.int64, len(lines) + 1, lines.offset * 8)
    return memoryview(lines.buffers()[2])[int(offsets[0]) : int(offsets[-1])]


def _duckdb_insert_new(conn: sa.Connection, tables: dict[str, pa.Table]) -> pa.Array:
    raw = _raw(conn)
    raw.register("_in_groups_ids", tables["groups"].select(["group_id"]))
    try:
        new = raw.sql(
            "SELECT group_id FROM _in_groups_ids WHERE group_id NOT IN "
            "(SELECT group_id FROM groups)"
        ).to_arrow_table()["group_id"]
    finally:
        _unregister(raw, "_in_groups_ids")
    new = new.combine_chunks()
    if len(new) == 0:
        return new
    for name, table in _keep_new(tables, new).items():
        if table.num_rows:
            _duckdb_insert(raw, name, table)
    return new


def _pg_insert_new(conn: sa.Connection, tables: dict[str, pa.Table]) -> pa.Array:
    """COPY groups into a temp table, keep those ``ON CONFLICT DO NOTHING`` inserted."""
    info = conn.connection.info  # lives as long as the pooled connection (and its session)
    if not info.get("_in_groups"):  # a round trip per commit saved
        conn.exec_driver_sql(
            "CREATE TEMP TABLE IF NOT EXISTS _in_groups (LIKE groups) ON COMMIT DELETE ROWS"
        )
        info["_in_groups"] = True
    copy_arrow(conn, "_in_groups", tables["groups"])
    new = conn.exec_driver_sql(
        "INSERT INTO groups SELECT * FROM _in_groups ON CONFLICT (group_id) DO NOTHING "
        "RETURNING group_id"
    ).scalars()
    new_ids = pa.array(list(new), pa.string())
    if len(new_ids) == 0:
        return new_ids
    for name, table in _keep_new(tables, new_ids).items():
        if name != "groups" and table.num_rows:
            copy_arrow(conn, name, table)
    return new_ids


def is_postgres(conn: sa.Connection) -> bool:
    """PostgreSQL: claims pick with ``FOR UPDATE SKIP LOCKED``, inserts race other processes.
    DuckDB: the cross-process file lock serialises every writer."""
    return conn.dialect.name == "postgresql"


def in_list(conn: sa.Connection, column: str, values: list[str]) -> tuple[str, list]:
    """A WHERE fragment ``column IN values`` for :func:`fetch_arrow` on ``conn``'s backend."""
    if is_postgres(conn):
        return f"{column} = ANY(?)", [list(values)]
    # One placeholder per value: DuckDB prunes the scan with a constant IN list, which it
    # does not do for IN (SELECT unnest(?)) (measured ~1.5x faster on a 64-group claim).
    return f"{column} IN ({', '.join('?' * len(values))})", list(values)


def insert_new(conn: sa.Connection, tables: dict[str, pa.Table]) -> pa.Array:
    """Insert the groups of ``tables`` whose id is not stored yet (all their rows), on
    ``conn``'s backend; returns their ids."""
    if is_postgres(conn):
        return _pg_insert_new(conn, tables)
    return _duckdb_insert_new(conn, tables)


def make_backend(url: str, *, lock_timeout_s: float) -> DuckDBBackend | PostgresBackend:
    scheme = sa.make_url(url).get_backend_name()
    if scheme == "duckdb":
        return DuckDBBackend(url, lock_timeout_s=lock_timeout_s)
    if scheme == "postgresql":
        return PostgresBackend(url, lock_timeout_s=lock_timeout_s)
    raise StoreError(f"unsupported store URL {url!r}: use duckdb:///path or postgresql+psycopg://")


__all__ = ["DuckDBBackend", "PostgresBackend", "make_backend", "schema"]
