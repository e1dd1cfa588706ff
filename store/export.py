"""Export the store to Parquet for heavy analysis while collection keeps writing.

Layout (Hive partitions, readable by polars / DuckDB / pyarrow datasets)::

    DIR/runs.parquet, DIR/policies.parquet, DIR/tasks.parquet, DIR/learner_steps.parquet
    DIR/<table>/policy_version=<v>/part-0.parquet   for groups, episodes, turns, tool_calls

``policy_version`` is the group's oldest sampled version (-1 when nothing was sampled).
Turns are exported with list columns (``token_ids``, ``logprobs``, ``policy_versions``: one
value per token), not the store's packed layout: the Parquet file is for analysis tools.
Each partition is read in its own short read-only transaction (``read`` opens one), so a
DuckDB writer is never kept out for the whole export. Text the store keeps escaped (NUL,
lone surrogates: :mod:`sandpiper.store.text`) is written as people read it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import sqlalchemy as sa

from sandpiper.store import backends, schema, text, train_arrays

PARTITIONED = ("groups", "episodes", "turns", "tool_calls")
WHOLE = ("runs", "policies", "tasks", "learner_steps")


def export_parquet(
    read: Callable[[], AbstractContextManager[sa.Connection]], out_dir: str | Path
) -> dict[str, int]:
    """Write the store under ``out_dir``; returns rows written per table. ``read`` opens one
    short read-only connection (``Store.connect_readonly``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, int] = {}
    for name in WHOLE:
        with read() as conn:
            table = _readable(backends.fetch_arrow(conn, f'SELECT * FROM "{name}"'))
        pq.write_table(table, out / f"{name}.parquet", compression="zstd")
        rows[name] = table.num_rows
    with read() as conn:
        versions = [
            r[0]
            for r in conn.exec_driver_sql(
                "SELECT DISTINCT coalesce(min_policy_version, -1) FROM groups ORDER BY 1"
            )
        ]
    for name in PARTITIONED:
        rows[name] = 0
        columns = ", ".join(f't."{c.name}"' for c in schema.metadata.tables[name].c)
        if name == "groups":  # its own version, plus the status from group_states
            source = "groups t JOIN group_states s ON s.group_id = t.group_id"
            columns, version = columns + ", s.status", "t.min_policy_version"
        else:  # the version of the group the row belongs to
            source = f'"{name}" t JOIN groups g ON g.group_id = t.group_id'
            version = "g.min_policy_version"
        sql = f"SELECT {columns} FROM {source} WHERE coalesce({version}, -1) = ?"
        for v in versions:
            with read() as conn:
                table = _readable(backends.fetch_arrow(conn, sql, [v]))
            if name == "turns":
                table = train_arrays.turns_as_lists(table)
            part = out / name / f"policy_version={v}"
            part.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, part / "part-0.parquet", compression="zstd")
            rows[name] += table.num_rows
    return rows


def _readable(table: pa.Table) -> pa.Table:
    """``table`` with escaped text made readable (:func:`sandpiper.store.text.readable`); the
    usual table, with no escaped value, is returned as it is."""
    for i, field in enumerate(table.schema):
        if not pa.types.is_string(field.type) and not pa.types.is_large_string(field.type):
            continue
        col = table.column(i)
        if not pc.any(pc.starts_with(col, text.MARKER)).as_py():
            continue
        values = [text.readable(v) for v in col.to_pylist()]
        table = table.set_column(i, field, pa.array(values, field.type))
    return table
