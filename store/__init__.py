"""The trajectory store: schema, batched writer, learner reader, DuckDB and PostgreSQL.

``Store(url)`` is the entry point; ``Store.writer()`` returns a :class:`GroupWriter`.
Importing ``store`` is cheap (SQLAlchemy and pyarrow, no duckdb/psycopg until a Store opens).
"""

from sandpiper.store.store import Store
from sandpiper.store.writer import GroupWriter

__all__ = ["GroupWriter", "Store"]
