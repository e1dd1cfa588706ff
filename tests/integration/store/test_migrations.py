"""Migration 4 on a store written in the old layout (schema version 1: INTEGER[] / REAL[] /
per-token INTEGER[] turn columns), on a real DuckDB file and a real PostgreSQL database.

The old tables are built from the old declaration of ``turns`` (kept here, as it was in
``store/schema.py`` before migration 4) and filled the way the old writer did (Arrow bulk
insert of list columns); then ``Store.migrate`` runs and every turn and every learner array
must read back identically through the store API. Cost: ~5 s per backend.
"""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pytest
import sqlalchemy as sa

from sandpiper.errors import SchemaVersionError
from sandpiper.store import Store, backends, migrations, schema, to_arrow, train_arrays
from sandpiper.store.backends import fetch_arrow, insert_arrow
from sandpiper.testing import make_group
from tests.integration.store.test_store import _fresh_pg_db

pytestmark = pytest.mark.integration


def _old_metadata() -> tuple[sa.MetaData, sa.Table]:
    """Every table as today, except ``turns`` as schema versions 1–3 declared it."""
    old = sa.MetaData()
    for table in schema.metadata.sorted_tables:
        if table.name != "turns":
            table.to_metadata(old)
    turns = sa.Table(
        "turns",
        old,
        sa.Column("episode_id", sa.String, primary_key=True),
        sa.Column("turn_index", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("group_id", sa.String, nullable=False),
        sa.Column("role", sa.String, nullable=False),
        sa.Column("text", sa.String, nullable=False),
        sa.Column("token_ids", sa.ARRAY(sa.Integer), nullable=False),
        sa.Column("logprobs", sa.ARRAY(sa.REAL)),
        sa.Column("policy_versions", sa.ARRAY(sa.Integer)),
        sa.Column("trainable", sa.Boolean, nullable=False),
        sa.Column("n_tokens", sa.Integer, nullable=False),
        sa.Column("started_at", schema.Timestamp, nullable=False),
        sa.Column("duration_ms", sa.Double, nullable=False),
        sa.Index("ix_turns_group", "group_id"),
    )
    return old, turns


def _old_turn_rows(groups) -> pa.Table:
    """The ``turns`` Arrow table the old writer produced (list columns)."""
    rows = [(g, e, t) for g in groups for e in g.episodes for t in e.turns]

    def lists(values, pa_type):
        return pa.array([None if v is None else v.tolist() for v in values], pa.list_(pa_type))

    return pa.table(
        {
            "episode_id": [e.episode_id for _, e, _ in rows],
            "turn_index": pa.array([t.index for *_, t in rows], pa.int32()),
            "group_id": [g.group_id for g, *_ in rows],
            "role": [str(t.role) for *_, t in rows],
            "text": [t.text for *_, t in rows],
            "token_ids": lists([t.token_ids_T for *_, t in rows], pa.int32()),
            "logprobs": lists([t.logprobs_T for *_, t in rows], pa.float32()),
            "policy_versions": lists([t.policy_versions_T for *_, t in rows], pa.int32()),
            "trainable": [t.trainable for *_, t in rows],
            "n_tokens": pa.array([len(t.token_ids_T) for *_, t in rows], pa.int32()),
            "started_at": pa.array([t.started_at for *_, t in rows], pa.timestamp("us", "UTC")),
            "duration_ms": [t.duration_ms for *_, t in rows],
        }
    )


def _groups():
    groups = [make_group(f"g{i}", tokens_per_turn=9, policy_version=i % 2) for i in range(5)]
    groups.append(make_group("g-invalid", n_episodes=3, n_invalid=2))
    # a turn sampled across a weight update, and logprobs on a prompt turn (kept, not trained)
    sampled = groups[0].episodes[1].turns[1]
    object.__setattr__(sampled, "policy_versions_T", np.array([0] * 4 + [1] * 5, np.int32))
    prompt = groups[1].episodes[0].turns[0]
    object.__setattr__(prompt, "logprobs_T", np.full(9, -0.5, np.float32))
    object.__setattr__(prompt, "policy_versions_T", np.full(9, 7, np.int32))
    return groups


@pytest.fixture(params=["duckdb", "postgres"])
def store_url(request, tmp_path) -> str:
    if request.param == "duckdb":
        return f"duckdb:///{tmp_path / 'old.duckdb'}"
    return _fresh_pg_db(request.getfixturevalue("postgres_url"))


def _write_old_store(url: str, groups) -> None:
    store = Store(url, lock_timeout_s=10)
    store.backend.prepare()
    old, _ = _old_metadata()
    now = datetime.now(UTC)
    tables = to_arrow.groups_to_arrow(groups, now)
    tables["turns"] = _old_turn_rows(groups)
    with store.backend.write() as conn:
        old.create_all(conn)
        migrations._write_version(conn, 1)
        conn.execute(
            sa.insert(schema.runs).values(
                run_id="run", config_json="{}", code_version="old", created_at=now
            )
        )
        for name in ("groups", "group_states", "episodes", "turns", "tool_calls"):
            insert_arrow(conn, name, tables[name])
    store.close()


def _stored_turns(store: Store) -> list[tuple]:
    with store.connect_readonly() as conn:
        table = fetch_arrow(conn, "SELECT * FROM turns ORDER BY episode_id, turn_index")
    table = train_arrays.turns_as_lists(table)
    cols = ["episode_id", "turn_index", "role", "text", "trainable", "n_tokens"]
    return [
        (*(r[c] for c in cols), r["token_ids"], r["logprobs"], r["policy_versions"])
        for r in table.to_pylist()
    ]


def test_migration_4_converts_an_old_store_and_reads_back_identically(store_url, tmp_path):
    groups = _groups()
    _write_old_store(store_url, groups)
    store = Store(store_url, lock_timeout_s=10)
    with pytest.raises(SchemaVersionError, match="store migrate"):
        store.claims.group_counts("run")
    assert store.migrate() == list(range(2, migrations.latest_version() + 1))
    assert store.schema_version() == migrations.latest_version()

    want = sorted(
        (e.episode_id, t.index, str(t.role), t.text, t.trainable, len(t.token_ids_T),
         t.token_ids_T.tolist(),
         None if t.logprobs_T is None else t.logprobs_T.tolist(),
         # versions are kept where logprobs are (a sampled turn), as the old layout did
         None if t.logprobs_T is None else t.policy_versions_T.tolist())
        for g in groups for e in g.episodes for t in e.turns
    )  # fmt: skip
    assert _stored_turns(store) == want

    # the learner's arrays: what a store written with the new layout gives for the same groups
    got = _claim_like_a_fresh_store(store, groups, tmp_path)
    spanning = got.groups[0].episodes[1].policy_versions_T
    assert list(spanning[9:18]) == [0] * 4 + [1] * 5
    assert store.migrate() == []  # applied once
    store.close()


def _claim_like_a_fresh_store(store: Store, groups, tmp_path):
    """Claim every claimable group of ``store`` and of a fresh store given the same groups;
    the learner's arrays must be equal. Returns the migrated store's batch."""
    fresh = Store(f"duckdb:///{tmp_path / 'fresh.duckdb'}", lock_timeout_s=10)
    fresh.init()
    fresh.write_groups(groups)
    n = len(groups) - 1  # the invalid group is not claimable
    got = store.claims.claim(run_id="run", learner_id="L", n_groups=n, max_lag=10)
    ref = fresh.claims.claim(run_id="run", learner_id="L", n_groups=n, max_lag=10)
    fresh.close()
    assert got is not None and ref is not None and got.group_ids == ref.group_ids
    for g_got, g_ref in zip(got.groups, ref.groups, strict=True):
        for a, b in zip(g_got.episodes, g_ref.episodes, strict=True):
            assert (a.episode_id, a.reward, a.valid) == (b.episode_id, b.reward, b.valid)
            for name in ("token_ids_T", "loss_mask_T", "behaviour_logprobs_T", "policy_versions_T"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    return got


KEYS_V5 = {"turns": ("episode_id", "turn_index"),
           "tool_calls": ("episode_id", "turn_index", "call_index")}  # fmt: skip


def _v5_metadata() -> sa.MetaData:
    """Every table as schema version 5 declared it: ``turns`` and ``tool_calls`` with their
    primary keys, and ``ix_turns_group``, on both backends."""
    v5 = sa.MetaData()
    for table in schema.metadata.sorted_tables:
        if table.name not in KEYS_V5:
            table.to_metadata(v5)
    for name, key in KEYS_V5.items():
        columns = [
            sa.Column(c.name, c.type, nullable=c.nullable) for c in schema.metadata.tables[name].c
        ]
        sa.Table(name, v5, *columns, sa.PrimaryKeyConstraint(*key))
    sa.Index("ix_turns_group", v5.tables["turns"].c.group_id)
    return v5


def _rows(store: Store, sql: str) -> list[dict]:
    with store.backend.write() as conn:  # whatever the schema version
        return fetch_arrow(conn, sql).to_pylist()


def test_migration_6_drops_the_duckdb_turn_keys_and_keeps_every_row(store_url, tmp_path):
    """A store written at version 5 (keys on ``turns`` / ``tool_calls``, ``ix_turns_group``)
    by today's insert path: after ``migrate`` DuckDB has neither key nor index, PostgreSQL
    keeps all three, and every row, claim and later write is as before."""
    groups = _groups()
    store = Store(store_url, lock_timeout_s=10)
    store.backend.prepare()
    with store.backend.write() as conn:
        _v5_metadata().create_all(conn)
        migrations._write_version(conn, 5)
        conn.execute(sa.insert(schema.runs).values(run_id="run", config_json="{}",
                                                   code_version="v5", created_at=datetime.now(UTC)))  # fmt: skip
        backends.insert_new(conn, to_arrow.groups_to_arrow(groups, datetime.now(UTC)))
    turns_sql = "SELECT * FROM turns ORDER BY episode_id, turn_index"
    calls_sql = "SELECT * FROM tool_calls ORDER BY episode_id, turn_index, call_index"
    before = _rows(store, turns_sql), _rows(store, calls_sql)
    assert len(before[0]) > 0 and len(before[1]) > 0
    store.close()

    store = Store(store_url, lock_timeout_s=10)
    with pytest.raises(SchemaVersionError, match="store migrate"):
        store.claims.group_counts("run")
    assert store.migrate() == [6, 7]
    assert (_rows(store, turns_sql), _rows(store, calls_sql)) == before
    with store.connect_readonly() as conn:
        if conn.dialect.name == "duckdb":
            keyed = (
                conn.exec_driver_sql(
                    "SELECT table_name FROM duckdb_constraints() WHERE constraint_type = 'PRIMARY KEY'"
                )
                .scalars()
                .all()
            )
            indexes = (
                conn.exec_driver_sql("SELECT index_name FROM duckdb_indexes()").scalars().all()
            )
            codecs = (
                conn.exec_driver_sql(
                    "SELECT DISTINCT compression FROM pragma_storage_info('turns') "
                    "WHERE column_name = 'token_ids' AND segment_type = 'BLOB'"
                )
                .scalars()
                .all()
            )
            assert not {"turns", "tool_calls"} & set(keyed) and {"groups", "episodes"} <= set(keyed)
            assert "ix_turns_group" not in indexes
            assert codecs == ["ZSTD"]  # the refilled table keeps its codec
        else:
            indexes = (
                conn.exec_driver_sql(
                    "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"
                )
                .scalars()
                .all()
            )
            assert {"turns_pkey", "tool_calls_pkey", "ix_turns_group"} <= set(indexes)

    # claims read what a fresh store gives, writes go on, a re-sent group is a no-op
    _claim_like_a_fresh_store(store, groups, tmp_path)
    assert store.write_groups([make_group("g-after", tokens_per_turn=9)]) == 1
    assert store.write_groups(groups[:1]) == 0
    assert store.migrate() == []
    store.close()
