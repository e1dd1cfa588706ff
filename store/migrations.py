"""Schema migrations, registered by the version they produce and applied in one transaction.

Version 1 is the baseline: it creates every table of ``store/schema.py``. A later change to
the schema bumps ``schema.SCHEMA_VERSION`` and registers a function here that upgrades a
store from the previous version (``ALTER TABLE …`` written for both backends).
``sandpiper store migrate`` applies what is pending; opening a store of another version
raises :class:`SchemaVersionError` saying what to run.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import sqlalchemy as sa

from sandpiper.errors import SchemaVersionError
from sandpiper.store import schema

Migration = Callable[[sa.Connection], None]

MIGRATIONS: dict[int, Migration] = {}
"""version → function that upgrades a store at ``version - 1`` to ``version``."""


def migration(version: int) -> Callable[[Migration], Migration]:
    def register(fn: Migration) -> Migration:
        if version in MIGRATIONS:
            raise ValueError(f"migration {version} registered twice")
        MIGRATIONS[version] = fn
        return fn

    return register


@migration(1)
def _baseline(conn: sa.Connection) -> None:
    """Create every table (a fresh store)."""
    schema.metadata.create_all(conn)


@migration(2)
def _collectors_and_slots(conn: sa.Connection) -> None:
    """Collector registry and task slots (issue 13); ``groups.collector_id``; a store id.

    A no-op on a fresh store (version 1 already created the current schema)."""
    schema.collectors.create(conn, checkfirst=True)
    schema.task_slots.create(conn, checkfirst=True)
    if not _has_column(conn, "groups", "collector_id"):
        conn.execute(sa.text("ALTER TABLE groups ADD COLUMN collector_id VARCHAR"))
    _backfill_slots(conn)
    meta = schema.schema_meta
    has_id = conn.execute(sa.select(meta.c.value).where(meta.c.key == "store_id")).first()
    if has_id is None:  # labels sandboxes, so the janitor never judges another store's ones
        conn.execute(sa.insert(meta).values(key="store_id", value=uuid.uuid4().hex))


def _backfill_slots(conn: sa.Connection) -> None:
    """Groups stored before slots existed become ``done`` slots, so that new slots continue
    after their seqs instead of re-issuing ids the store already holds."""
    g, s = schema.groups, schema.task_slots
    if conn.execute(sa.select(sa.func.count()).select_from(s)).scalar_one():
        return
    rows = []
    for gid, run_id, task_id, split, at in conn.execute(
        sa.select(g.c.group_id, g.c.run_id, g.c.task_id, g.c.split, g.c.committed_at)
    ):
        head, _, seq = gid.rpartition("/")
        if head == f"{run_id}/{task_id}" and seq.isdigit():
            rows.append({"run_id": run_id, "task_id": task_id, "seq": int(seq), "split": split,
                         "rank": "", "status": "done", "collector_id": None, "lease": 1,
                         "leased_at": None, "done_at": at})  # fmt: skip
    for i in range(0, len(rows), 5000):
        conn.execute(sa.insert(s), rows[i : i + 5000])


def _has_column(conn: sa.Connection, table: str, column: str) -> bool:
    return bool(
        conn.execute(
            sa.text(
                "SELECT count(*) FROM information_schema.columns WHERE table_name = :t "
                "AND column_name = :c AND table_schema = current_schema()"
            ),
            {"t": table, "c": column},
        ).scalar_one()
    )


@migration(3)
def _learner_leases(conn: sa.Connection) -> None:
    """Learner leadership leases (issue 13). A no-op on a fresh store (version 1 created the
    current schema, this table included)."""
    schema.learner_leases.create(conn, checkfirst=True)


@migration(4)
def _packed_turns(conn: sa.Connection) -> None:
    """``turns``: INTEGER[] / REAL[] / per-token INTEGER[] → packed BLOBs and version runs.

    See ``store/schema.py`` for the layout and why. A no-op on a store created with the
    packed layout; otherwise the old table is renamed, the new one created, the rows copied
    (converted with Arrow, a few thousand episodes per round) and the old table dropped,
    all in the caller's transaction.
    """
    from sandpiper.store.turns_v3 import convert_turns

    convert_turns(conn)


@migration(5)
def _collector_policy_version(conn: sa.Connection) -> None:
    """``collectors.policy_version``: the version each collector serves or is loading, so
    that checkpoint retention never deletes it (issue 13). A no-op on a fresh store."""
    if not _has_column(conn, "collectors", "policy_version"):
        conn.execute(sa.text("ALTER TABLE collectors ADD COLUMN policy_version INTEGER"))


@migration(6)
def _duckdb_bulk_tables_without_keys(conn: sa.Connection) -> None:
    """DuckDB: ``turns`` and ``tool_calls`` without their primary keys, ``turns`` without
    ``ix_turns_group`` (why: ``store/schema.py``). DuckDB cannot drop a key, so each table
    is renamed, created again from the schema and refilled (zstd BLOBs are compressed
    anew), all in the caller's transaction. A no-op on PostgreSQL, which keeps the keys,
    and on a DuckDB store created without them."""
    if conn.dialect.name == "postgresql":
        return
    conn.exec_driver_sql("DROP INDEX IF EXISTS ix_turns_group")
    for table in (schema.turns, schema.tool_calls):
        keyed = conn.exec_driver_sql(
            "SELECT count(*) FROM duckdb_constraints() WHERE table_name = ? "
            "AND constraint_type = 'PRIMARY KEY' AND schema_name = current_schema()",
            (table.name,),
        ).scalar_one()
        if not keyed:
            continue
        old = f"{table.name}_v5"
        cols = ", ".join(f'"{c.name}"' for c in table.c)
        conn.exec_driver_sql(f'ALTER TABLE "{table.name}" RENAME TO "{old}"')
        table.create(conn)
        # in stored order (DuckDB keeps it): a group's rows stay together, which is what
        # lets the claim's scan skip row groups by their group_id ranges
        conn.exec_driver_sql(f'INSERT INTO "{table.name}" ({cols}) SELECT {cols} FROM "{old}"')
        conn.exec_driver_sql(f'DROP TABLE "{old}"')


@migration(7)
def _dead_groups(conn: sa.Connection) -> None:
    """``dead_groups``: groups set aside by a writer that could not commit them alone, or by
    a learner that could not read them (no poison pill). A no-op on a fresh store."""
    schema.dead_groups.create(conn, checkfirst=True)


def latest_version() -> int:
    return max(MIGRATIONS)


def read_version(conn: sa.Connection) -> int:
    """The store's schema version; 0 when the store has no schema yet."""
    # information_schema, not sa.inspect: reflection fails under duckdb-engine.
    exists = conn.execute(
        sa.text(
            "SELECT count(*) FROM information_schema.tables "
            "WHERE table_name = 'schema_meta' AND table_schema = current_schema()"
        )
    ).scalar_one()
    if not exists:
        return 0
    row = conn.execute(
        sa.select(schema.schema_meta.c.value).where(schema.schema_meta.c.key == "schema_version")
    ).one_or_none()  # fully fetched: DuckDB refuses other work on an unfinished result
    return int(row[0]) if row else 0


def _write_version(conn: sa.Connection, version: int) -> None:
    meta = schema.schema_meta
    conn.execute(sa.delete(meta).where(meta.c.key == "schema_version"))
    conn.execute(sa.insert(meta).values(key="schema_version", value=str(version)))


def apply(conn: sa.Connection, *, target: int | None = None) -> list[int]:
    """Apply pending migrations inside the caller's transaction; returns versions applied."""
    target = latest_version() if target is None else target
    current = read_version(conn)
    if current > target:
        raise SchemaVersionError(
            f"the store has schema version {current}, newer than this sandpiper "
            f"(knows up to {target}); upgrade sandpiper to open it"
        )
    applied = []
    for version in range(current + 1, target + 1):
        MIGRATIONS[version](conn)
        _write_version(conn, version)
        applied.append(version)
    return applied


def check(version: int, url: str) -> None:
    """Raise a :class:`SchemaVersionError` that says what to do unless ``version`` is current."""
    latest = latest_version()
    if version == latest:
        return
    if version == 0:
        raise SchemaVersionError(
            f"the store at {url} has no schema; run `sandpiper store init --url {url}`"
        )
    if version < latest:
        raise SchemaVersionError(
            f"the store at {url} has schema version {version}, this sandpiper needs {latest}; "
            f"run `sandpiper store migrate --url {url}` (back up the store first)"
        )
    raise SchemaVersionError(
        f"the store at {url} has schema version {version}, newer than this sandpiper "
        f"(knows up to {latest}); upgrade sandpiper to open it"
    )
