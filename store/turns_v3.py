"""Migration 4's data conversion: ``turns`` rows of the list layout (schema versions 1–3)
rewritten in the packed layout of ``store/schema.py``.

Old layout: ``token_ids INTEGER[]``, ``logprobs REAL[]``, ``policy_versions INTEGER[]`` (one
version per token). New: ``token_ids`` / ``logprobs`` packed BLOBs, ``policy_version`` +
``policy_version_changes``. The other columns are unchanged.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import sqlalchemy as sa

from sandpiper.store import packed, schema
from sandpiper.store.backends import fetch_arrow, insert_arrow

OLD_TABLE = "turns_v3"
EPISODES_PER_ROUND = 2000
"""Episodes converted per round: bounds the memory the migration needs on a large store."""


def _columns(conn: sa.Connection, table: str) -> set[str]:
    rows = conn.execute(
        sa.text(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = :t AND table_schema = current_schema()"
        ),
        {"t": table},
    )
    return {r[0] for r in rows}


def _rows(col: pa.ChunkedArray, dtype: str) -> list[np.ndarray | None]:
    """A list column as one numpy array per row (None for a null row)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_null(arr.type):
        return [None] * len(arr)
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(dtype)
    parts = np.split(values, np.cumsum(lengths)[:-1]) if len(arr) else []
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    return [p if ok else None for p, ok in zip(parts, valid, strict=True)]


def convert(old: pa.Table) -> pa.Table:
    """Old-layout turn rows → a table in the new ``turns`` Arrow schema."""
    runs = [packed.version_runs(v) for v in _rows(old["policy_versions"], "<i4")]
    new_cols = {
        "token_ids": packed.pack(_rows(old["token_ids"], "<i4"), "<i4"),
        "logprobs": packed.pack(_rows(old["logprobs"], "<f4"), "<f4"),
        "policy_version": pa.array([r[0] for r in runs], pa.int32()),
        "policy_version_changes": pa.array([r[1] for r in runs], pa.list_(pa.int32())),
    }
    target = schema.arrow_schema(schema.turns)
    arrays = [new_cols[f.name] if f.name in new_cols else old[f.name].cast(f.type) for f in target]
    return pa.Table.from_arrays(arrays, schema=target)


def convert_turns(conn: sa.Connection) -> None:
    """Rewrite ``turns`` in the packed layout (no-op when it already is)."""
    if "policy_version_changes" in _columns(conn, "turns"):
        return
    conn.exec_driver_sql("DROP INDEX IF EXISTS ix_turns_group")
    conn.exec_driver_sql(f"ALTER TABLE turns RENAME TO {OLD_TABLE}")
    if conn.dialect.name == "postgresql":  # constraint names are per schema: free the name
        conn.exec_driver_sql(
            f"ALTER TABLE {OLD_TABLE} RENAME CONSTRAINT turns_pkey TO {OLD_TABLE}_pkey"
        )
    schema.turns.create(conn)
    ids = [r[0] for r in conn.exec_driver_sql(f"SELECT DISTINCT episode_id FROM {OLD_TABLE}")]
    ids.sort()
    for i in range(0, len(ids), EPISODES_PER_ROUND):
        lo, hi = ids[i], ids[min(i + EPISODES_PER_ROUND, len(ids)) - 1]
        old = fetch_arrow(
            conn,
            f"SELECT * FROM {OLD_TABLE} WHERE episode_id >= ? AND episode_id <= ?",
            [lo, hi],
        )
        if old.num_rows:
            insert_arrow(conn, "turns", convert(old))
    conn.exec_driver_sql(f"DROP TABLE {OLD_TABLE}")
