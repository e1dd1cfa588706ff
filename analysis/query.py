"""Read-only SQL against the store, returned as polars DataFrames.

Every read is one short read-only connection from :meth:`sandpiper.store.Store.connect_readonly`
(on DuckDB: a read-only open under the store's cross-process lock, so it works while the
collector writes; on PostgreSQL: a ``READ ONLY`` transaction). :func:`reader` makes sure
the analysis views exist first (see :func:`ensure_views`).

:func:`run_sql` is what ``sandpiper sql`` runs: it refuses anything but one reading
statement before the database sees it, and the read-only connection refuses the rest.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sandpiper.errors import StoreError, StoreLockTimeout

if TYPE_CHECKING:
    import polars as pl
    import sqlalchemy as sa

    from sandpiper.store import Store

# fmt: off
WRITE_KEYWORDS = frozenset([
    "insert", "update", "delete", "merge", "upsert", "create", "drop", "alter", "truncate",
    "copy", "attach", "detach", "install", "load", "set", "reset", "pragma", "vacuum",
    "checkpoint", "analyze", "grant", "revoke", "call", "export", "import", "begin", "commit",
    "rollback", "use", "comment", "refresh", "lock",
])
# fmt: on
"""First keywords ``sandpiper sql`` refuses up front with a clear message; anything else
goes to the read-only connection, which rejects what slips through (and bad SQL)."""

_COMMENTS = re.compile(r"(--[^\n]*|/\*.*?\*/)", re.DOTALL)


_VIEWS_LOCK_KEY = 0x5A4E_D71E
"""PostgreSQL advisory-lock key held while (re)creating the analysis views."""


class QueryError(StoreError, ValueError):
    """A query was refused (not read-only, several statements) or the database rejected it."""


def open_store(store: Store | str) -> Store:
    """``store`` itself, or a :class:`sandpiper.store.Store` for a URL (handy in notebooks)."""
    if isinstance(store, str):
        from sandpiper.store import Store

        return Store(store)
    return store


def _dialect(conn: sa.Connection) -> str:
    return conn.dialect.name


def ensure_views(store: Store) -> bool:
    """Create or refresh the analysis views when missing or older than this code.

    A cheap read-only check first; only when needed, one short write transaction (on
    DuckDB that takes the store lock once, like any writer). Returns True if it wrote.
    """
    import sqlalchemy as sa

    from sandpiper.analysis.views import VIEWS_VERSION, create_views, views_version

    with store.connect_readonly() as conn:
        if views_version(conn) == VIEWS_VERSION:
            return False
    with store.backend.write() as conn:
        if _dialect(conn) == "postgresql":
            # Two readers of a fresh database must not run the DDL at the same time
            # (PostgreSQL's concurrent CREATE OR REPLACE VIEW can fail); DuckDB's file lock
            # already serialises writers.
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _VIEWS_LOCK_KEY})
        if views_version(conn) == VIEWS_VERSION:
            return False  # another reader created them while we waited
        create_views(conn, _dialect(conn))
    return True


@contextmanager
def reader(store: Store | str) -> Iterator[sa.Connection]:
    """One short read-only connection with the analysis views available.

    Usually a single read-only open; the first read of a store (or of a store written by
    older analysis code) also creates the views, see :func:`ensure_views`. Without write
    access a DuckDB reader defines them as session-local views instead.
    """
    import sqlalchemy as sa

    from sandpiper.analysis.views import VIEWS_VERSION, create_views, views_version

    store = open_store(store)
    with store.connect_readonly() as conn:
        if views_version(conn) == VIEWS_VERSION:
            yield conn
            return
    try:
        ensure_views(store)
    except (sa.exc.DBAPIError, StoreLockTimeout) as e:
        with store.connect_readonly() as conn:
            if _dialect(conn) != "duckdb":
                raise StoreError(
                    f"the analysis views are missing in {store.url} and could not be created "
                    f"({db_error_line(e)}); run `sandpiper sql` once with a role that may "
                    "CREATE VIEW"
                ) from None
            create_views(conn, "duckdb", temporary=True)
            yield conn
            return
    with store.connect_readonly() as conn:
        yield conn


def _jsonable(value: Any) -> Any:
    # JSON columns come back as text from DuckDB and as dicts from PostgreSQL (JSONB):
    # make them text on both so that a DataFrame never mixes structs and strings.
    return json.dumps(value, sort_keys=True) if isinstance(value, dict) else value


PACKED_COLUMNS = {"token_ids": "<i4", "logprobs": "<f4"}
"""Result columns of these names that hold packed bytes (``turns``, see store.schema) are
shown as lists of numbers: people and DataFrames want the values, not the storage."""


def _unpacked(name: str, values: list) -> list:
    from sandpiper.store.packed import unpack_one

    dtype = PACKED_COLUMNS.get(name)
    if dtype is None or not any(isinstance(v, bytes | memoryview) for v in values):
        return values
    return [unpack_one(bytes(v), dtype) if v is not None else None for v in values]


# PostgreSQL type OIDs and DuckDB type names -> polars type names, for typing the columns of
# an empty result (with no rows to infer from, they would all be Null).
_PG_OIDS = {16: "Boolean", 20: "Int64", 21: "Int64", 23: "Int64", 700: "Float64",
            701: "Float64", 1700: "Float64", 25: "String", 1043: "String", 1184: "Datetime",
            1114: "Datetime", 3802: "String", 114: "String"}  # fmt: skip
_DUCK_PREFIXES = (("BOOLEAN", "Boolean"), ("TIMESTAMP", "Datetime"), ("DOUBLE", "Float64"),
                  ("FLOAT", "Float64"), ("DECIMAL", "Float64"), ("VARCHAR", "String"),
                  ("JSON", "String"), ("BIGINT", "Int64"), ("INTEGER", "Int64"),
                  ("SMALLINT", "Int64"), ("HUGEINT", "Int64"))  # fmt: skip


def _empty_dtype(type_code: Any) -> Any:
    import polars as pl

    if isinstance(type_code, int):
        name = _PG_OIDS.get(type_code)
    else:
        text = str(type_code).upper()
        name = (
            None
            if text.endswith("]")
            else next((n for prefix, n in _DUCK_PREFIXES if text.startswith(prefix)), None)
        )
    if name == "Datetime":
        return pl.Datetime("us", "UTC")
    return getattr(pl, name) if name else pl.Null


def frame(result: sa.CursorResult) -> pl.DataFrame:
    """A SQLAlchemy result as a polars DataFrame (every row; columns in result order)."""
    import polars as pl

    names = list(result.keys())
    # Read before fetching: SQLAlchemy releases the cursor once the rows are exhausted.
    description = result.cursor.description if result.cursor is not None else None
    rows = [tuple(_jsonable(v) for v in row) for row in result]
    if not rows:
        types = [_empty_dtype(d[1]) for d in description] if description else [pl.Null] * len(names)
        return pl.DataFrame(schema=dict(zip(names, types, strict=True)))
    columns = {n: _unpacked(n, [r[i] for r in rows]) for i, n in enumerate(names)}
    return pl.DataFrame(columns, strict=False)


def fetch(conn: sa.Connection, sql: str, params: dict[str, Any] | None = None) -> pl.DataFrame:
    """Run one statement on an open connection and return its rows as a DataFrame."""
    import sqlalchemy as sa

    return frame(conn.execute(sa.text(sql), params or {}))


def check_read_only(sql: str) -> str:
    """``sql`` without trailing semicolons if it is one reading statement, else QueryError."""
    body = _COMMENTS.sub(" ", sql).strip().rstrip(";").strip()
    if not body:
        raise QueryError("empty query")
    if ";" in _strip_strings(body):
        raise QueryError("one statement at a time, please (found ';' between statements)")
    keyword = body.split(None, 1)[0].lower().lstrip("(")
    if keyword in WRITE_KEYWORDS:
        raise QueryError(
            f"sandpiper sql is read-only: {keyword.upper()} statements are refused "
            "(use SELECT, WITH, EXPLAIN, DESCRIBE, ...)"
        )
    return sql.strip().rstrip(";").strip()


def _strip_strings(sql: str) -> str:
    """``sql`` with quoted literals and identifiers blanked, so ``';'`` inside them is fine."""
    return re.sub(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"", "''", sql)


def db_error_line(error: Exception) -> str:
    """The first line of the database's own message (DuckDB or PostgreSQL)."""
    original = getattr(error, "orig", None) or error
    text = str(original).strip()
    return text.splitlines()[0] if text else type(original).__name__


def run_sql(store: Store | str, sql: str, params: dict[str, Any] | None = None) -> pl.DataFrame:
    """Run one read-only statement and return its rows; :class:`QueryError` if refused."""
    import sqlalchemy as sa

    statement = check_read_only(sql)
    with reader(store) as conn:
        try:
            return fetch(conn, statement, params)
        except sa.exc.DBAPIError as e:
            raise QueryError(f"the database rejected the query: {db_error_line(e)}") from None
        except sa.exc.ResourceClosedError:
            raise QueryError("the statement returned no rows (is it a query?)") from None
