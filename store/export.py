"""Export the store to Parquet for heavy analysis while collection keeps writing.

Layout (Hive partitions, readable by polars / DuckDB / pyarrow datasets)::

    DIR/runs.parquet, DIR/policies.parquet, DIR/tasks.parquet, DIR/learner_steps.parquet
    DIR/<table>/policy_version=<v>/part-0.parquet   for groups, episodes, turns, tool_calls

``policy_version`` is the group's oldest sampled version (-1 when nothing was sampled).
Turns are exported with list columns (``token_ids``, ``logprobs``, ``policy_versions``: one
value per token), not the store's packed layout: the Parquet file is for analysis tools.
Each partition is read in its own short read-only transaction, so a DuckDB writer is never
kept out for the whole export.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from sandpiper.store import arrow_io, schema

PARTITIONED = ("groups", "episodes", "turns", "tool_calls")
WHOLE = ("runs", "policies", "tasks", "learner_steps")


def export_parquet(store, out_dir: str | Path) -> dict[str, int]:
    """Write the store under ``out_dir``; returns rows written per table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, int] = {}
    for name in WHOLE:
        with store.connect_readonly() as conn:
            table = store.backend.fetch_arrow(conn, f'SELECT * FROM "{name}"')
        pq.write_table(table, out / f"{name}.parquet", compression="zstd")
        rows[name] = table.num_rows
    with store.connect_readonly() as conn:
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
            with store.connect_readonly() as conn:
                table = store.backend.fetch_arrow(conn, sql, [v])
            if name == "turns":
                table = arrow_io.turns_as_lists(table)
            part = out / name / f"policy_version={v}"
            part.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, part / "part-0.parquet", compression="zstd")
            rows[name] += table.num_rows
    return rows
