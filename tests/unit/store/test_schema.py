"""Schema drift: DDL, Arrow schemas and the writer's Arrow tables all come from schema.py."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pytest
import sqlalchemy as sa

from sandpiper.errors import SchemaVersionError, StoreError
from sandpiper.store import migrations, packed, schema, to_arrow, train_arrays
from sandpiper.store.records import GroupStatus
from sandpiper.testing import expected_tokens, make_group

ARROW_TO_DUCKDB = {
    pa.string(): "VARCHAR",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float64(): "DOUBLE",
    pa.float32(): "FLOAT",
    pa.bool_(): "BOOLEAN",
    pa.timestamp("us", tz="UTC"): "TIMESTAMP WITH TIME ZONE",
    pa.list_(pa.int32()): "INTEGER[]",
    pa.list_(pa.float32()): "FLOAT[]",
    pa.large_binary(): "BLOB",
}


def test_every_table_has_an_arrow_schema_with_the_same_columns():
    for table in schema.metadata.sorted_tables:
        arrow = schema.arrow_schema(table)
        assert arrow.names == [c.name for c in table.c], table.name


def test_duckdb_ddl_matches_arrow_schema(tmp_path):
    """Create the tables in DuckDB and compare its column types with the derived Arrow types."""
    engine = sa.create_engine(f"duckdb:///{tmp_path / 's.duckdb'}", poolclass=sa.pool.NullPool)
    schema.metadata.create_all(engine)
    with engine.connect() as conn:
        for table in schema.metadata.sorted_tables:
            described = conn.exec_driver_sql(f'DESCRIBE "{table.name}"').all()
            arrow = schema.arrow_schema(table)
            for (name, sql_type, *_), field in zip(described, arrow, strict=True):
                assert name == field.name
                json_col = isinstance(table.c[name].type, schema.Json)
                assert sql_type == ("JSON" if json_col else ARROW_TO_DUCKDB[field.type]), name
    engine.dispose()


def test_token_columns_are_packed_not_json():
    types = {c.name: c.type for c in schema.turns.c}
    for name in ("token_ids", "logprobs"):
        assert isinstance(types[name], sa.LargeBinary), name
    assert isinstance(types["policy_version"], sa.Integer)
    assert isinstance(types["policy_version_changes"], sa.ARRAY)
    assert isinstance(schema.episodes.c.reward.type, sa.Double)
    ddl = str(sa.schema.CreateTable(schema.turns).compile(dialect=_duckdb_dialect()))
    assert "token_ids BLOB USING COMPRESSION ZSTD NOT NULL" in ddl


def _duckdb_dialect():
    from duckdb_engine import Dialect

    return Dialect()


@pytest.mark.parametrize(
    "versions",
    [[], [3], [3, 3, 3], [3, 3, 4, 4, 4], [1, 2, 3], [5, 5, 4]],
)
def test_policy_versions_roundtrip_through_runs(versions):
    first, changes = packed.version_runs(np.array(versions, np.int32))
    if len(set(versions)) <= 1:
        assert changes is None  # the usual turn: one scalar, nothing else stored
    got = packed.expand_versions(first, changes, len(versions))
    np.testing.assert_array_equal(got, np.array(versions, np.int32))


def test_unpack_skips_nulls_and_honours_slices():
    rows = [np.array([1, 2], np.int32), None, np.array([], np.int32), np.array([7], np.int32)]
    col = packed.pack(rows, "<i4")
    assert col.null_count == 1
    np.testing.assert_array_equal(packed.unpack(col, "<i4"), [1, 2, 7])
    np.testing.assert_array_equal(packed.packed_lengths(col, "<i4"), [2, 0, 0, 1])
    chunked = pa.chunked_array([col.slice(2), col.slice(0, 1)])
    np.testing.assert_array_equal(packed.unpack(chunked, "<i4"), [7, 1, 2])
    np.testing.assert_array_equal(packed.packed_lengths(chunked, "<i4"), [0, 1, 2])
    assert packed.unpack_one(col[3].as_py(), "<i4") == [7]


def test_a_turn_sampled_across_a_weight_update_keeps_its_versions():
    group = make_group("g", n_turns=2, tokens_per_turn=6, policy_version=2)
    sampled = group.episodes[0].turns[1]
    spans = np.array([2, 2, 2, 3, 3, 3], np.int32)
    object.__setattr__(sampled, "policy_versions_T", spans)
    turns = to_arrow.groups_to_arrow([group], datetime.now(UTC))["turns"]
    meta = {e.episode_id: (e.reward, e.valid) for e in group.episodes}
    eps = train_arrays.train_episodes(turns.select(list(train_arrays.TRAIN_TURN_COLUMNS)), meta)
    np.testing.assert_array_equal(eps[0].policy_versions_T, np.r_[np.full(6, -1), spans])
    np.testing.assert_array_equal(eps[1].policy_versions_T, np.r_[np.full(6, -1), np.full(6, 2)])


def test_writer_tables_match_derived_schemas():
    tables = to_arrow.groups_to_arrow([make_group("g1"), make_group("g2")], datetime.now(UTC))
    for table in schema.BULK_TABLES:
        assert tables[table.name].schema == schema.arrow_schema(table), table.name
    assert tables["episodes"].num_rows == 8
    assert tables["turns"].num_rows == 24
    assert tables["tool_calls"].num_rows == 8  # one per sampled turn


def test_turn_arrays_roundtrip_through_arrow():
    group = make_group("g1", n_turns=4, tokens_per_turn=7, policy_version=3)
    turns = to_arrow.groups_to_arrow([group], datetime.now(UTC))["turns"]
    meta = {e.episode_id: (e.reward, e.valid) for e in group.episodes}
    episodes = train_arrays.train_episodes(
        turns.select(list(train_arrays.TRAIN_TURN_COLUMNS)), meta
    )
    assert [e.episode_id for e in episodes] == [e.episode_id for e in group.episodes]
    ep = episodes[1]
    want = np.concatenate([expected_tokens("g1", 1, t, 7) for t in range(4)])
    np.testing.assert_array_equal(ep.token_ids_T, want)
    assert ep.token_ids_T.dtype == np.int32 and isinstance(ep.loss_mask_T, np.ndarray)
    np.testing.assert_array_equal(ep.loss_mask_T, np.repeat([False, True, False, True], 7))
    assert np.isnan(ep.behaviour_logprobs_T[~ep.loss_mask_T]).all()
    assert np.isfinite(ep.behaviour_logprobs_T[ep.loss_mask_T]).all()
    np.testing.assert_array_equal(ep.policy_versions_T, np.where(ep.loss_mask_T, 3, -1))


def _train_arrays(episodes) -> dict[str, tuple]:
    return {
        e.episode_id: (e.token_ids_T, e.loss_mask_T, e.behaviour_logprobs_T, e.policy_versions_T)
        for e in episodes
    }


def test_turn_rows_in_any_order_give_the_same_episodes():
    """The reader fetches turns without ORDER BY: chunks and rows may come in any order."""
    groups = [make_group(f"g{i}", n_turns=5, tokens_per_turn=6, policy_version=i) for i in (1, 2)]
    turns = to_arrow.groups_to_arrow(groups, datetime.now(UTC))["turns"]
    turns = turns.select(list(train_arrays.TRAIN_TURN_COLUMNS))
    meta = {e.episode_id: (e.reward, e.valid) for g in groups for e in g.episodes}
    want = _train_arrays(train_arrays.train_episodes(turns, meta))
    rotated = pa.Table.from_batches(turns.to_batches(max_chunksize=7)[::-1])  # batch order only
    shuffled = turns.take(np.random.default_rng(0).permutation(turns.num_rows))
    for table in (rotated, shuffled):
        got = _train_arrays(train_arrays.train_episodes(table, meta))
        assert list(got) == sorted(want)
        for episode_id, arrays in want.items():
            for a, b in zip(arrays, got[episode_id], strict=True):
                np.testing.assert_array_equal(a, b)


def test_logprobs_on_a_non_trainable_turn_stay_out_of_the_arrays():
    group = make_group("g", n_turns=3, tokens_per_turn=4, policy_version=5)
    prompt = group.episodes[0].turns[0]
    object.__setattr__(prompt, "logprobs_T", np.zeros(4, np.float32))
    object.__setattr__(prompt, "policy_versions_T", np.full(4, 9, np.int32))
    turns = to_arrow.groups_to_arrow([group], datetime.now(UTC))["turns"]
    meta = {e.episode_id: (e.reward, e.valid) for e in group.episodes}
    ep = train_arrays.train_episodes(turns.select(list(train_arrays.TRAIN_TURN_COLUMNS)), meta)[0]
    np.testing.assert_array_equal(ep.loss_mask_T, np.repeat([False, True, False], 4))
    np.testing.assert_array_equal(ep.policy_versions_T, np.repeat([-1, 5, -1], 4))
    assert np.isnan(ep.behaviour_logprobs_T[:4]).all()


def test_group_with_too_few_valid_episodes_is_invalid():
    assert to_arrow.group_status(make_group("g", n_episodes=2, n_invalid=1)) == GroupStatus.INVALID
    assert to_arrow.group_status(make_group("g", n_episodes=3, n_invalid=1)) == GroupStatus.READY


def test_the_store_and_the_learner_share_one_valid_episode_rule(monkeypatch):
    """``MIN_VALID_EPISODES`` decides both the stored status and the learner's skip."""
    from sandpiper.store import records
    from sandpiper.trainer import advantages

    for n in (2, 3):
        monkeypatch.setattr(records, "MIN_VALID_EPISODES", n)
        monkeypatch.setattr(to_arrow, "MIN_VALID_EPISODES", n)
        monkeypatch.setattr(advantages, "MIN_VALID_EPISODES", n)
        for n_valid in (n - 1, n):
            g = make_group("g", n_episodes=n_valid + 1, n_invalid=1)
            rewards = [float(i) for i in range(n_valid)] + [None]
            adv = advantages.group_advantages(rewards, [True] * n_valid + [False])
            status = to_arrow.group_status(g)
            assert (status is GroupStatus.READY) == (adv is not None), (n, n_valid)


def test_trainable_turn_without_logprobs_is_rejected():
    group = make_group("g", n_turns=2)
    bad_turn = group.episodes[0].turns[1]
    object.__setattr__(bad_turn, "logprobs_T", None)
    with pytest.raises(StoreError, match="without logprobs_T"):
        to_arrow.groups_to_arrow([group], datetime.now(UTC))


def test_schema_version_messages_say_what_to_run():
    latest = migrations.latest_version()
    migrations.check(latest, "duckdb:///x")
    with pytest.raises(SchemaVersionError, match="store init"):
        migrations.check(0, "duckdb:///x")
    with pytest.raises(SchemaVersionError, match="upgrade sandpiper"):
        migrations.check(latest + 1, "duckdb:///x")


def test_schema_version_is_the_latest_migration():
    """Spool files carry ``SCHEMA_VERSION``; it was left at 4 while migrations reached 6."""
    from sandpiper.store import schema

    assert migrations.latest_version() == schema.SCHEMA_VERSION


def test_batch_version_columns_equal_the_per_record_definitions():
    """groups_to_arrow computes version scalars, change points and version ranges on one
    buffer for the whole batch; they must equal version_runs / policy_version_range of each
    record, including empty turns, -1 (unknown) versions, changes inside a turn, a change
    right at a turn boundary, float versions and episodes without turns."""
    rng = np.random.default_rng(7)
    groups = [make_group(f"g{i}", n_turns=6, tokens_per_turn=5, policy_version=i) for i in range(4)]
    turns = [t for g in groups for e in g.episodes for t in e.turns]
    for t in turns:
        if t.policy_versions_T is None:
            continue
        kind = rng.integers(5)
        n = len(t.policy_versions_T)
        if kind == 0:
            object.__setattr__(t, "policy_versions_T", np.r_[[3, 3], np.full(n - 2, 4)])
        elif kind == 1:
            object.__setattr__(t, "policy_versions_T", np.full(n, -1, np.int32))
        elif kind == 2:
            object.__setattr__(t, "policy_versions_T", np.full(n, 2.0))
        elif kind == 3:
            empty = np.zeros(0, np.int32)
            object.__setattr__(t, "token_ids_T", empty)
            object.__setattr__(t, "logprobs_T", np.zeros(0, np.float32))
            object.__setattr__(t, "policy_versions_T", empty)
    object.__setattr__(groups[0].episodes[1], "turns", ())
    tables = to_arrow.groups_to_arrow(groups, datetime.now(UTC))
    rows = [(e, t) for g in groups for e in g.episodes for t in e.turns]
    want = [packed.version_runs(t.policy_versions_T) for _, t in rows]
    assert any(w[1] for w in want) and any(w[0] == -1 for w in want)
    assert tables["turns"]["policy_version"].to_pylist() == [w[0] for w in want]
    assert tables["turns"]["policy_version_changes"].to_pylist() == [w[1] for w in want]
    episodes = [e for g in groups for e in g.episodes]
    ranges = [e.policy_version_range for e in episodes]
    assert any(r is None for r in ranges) and any(r is not None for r in ranges)
    got = tables["episodes"].select(["min_policy_version", "max_policy_version"]).to_pylist()
    assert [(r["min_policy_version"], r["max_policy_version"]) for r in got] == [
        (None, None) if r is None else r for r in ranges
    ]
    for g, row in zip(groups, tables["groups"].to_pylist(), strict=True):
        spans = [r for e in g.episodes if (r := e.policy_version_range) is not None]
        assert row["min_policy_version"] == min((r[0] for r in spans), default=None)
        assert row["max_policy_version"] == max((r[1] for r in spans), default=None)
    assert tables["tool_calls"]["group_id"].to_pylist()[0] == "g0"


def _with_turn_indexes(group, indexes):
    ep = group.episodes[0]
    turns = tuple(dataclasses.replace(t, index=i) for t, i in zip(ep.turns, indexes, strict=True))
    episodes = (dataclasses.replace(ep, turns=turns), *group.episodes[1:])
    return dataclasses.replace(group, episodes=episodes)


def test_a_repeated_turn_or_call_index_is_refused_out_of_order_ones_are_not():
    """``turns`` and ``tool_calls`` have no key in DuckDB (schema.py says why): the
    conversion makes the check the key made, and names the episode."""
    group = make_group("g", n_turns=4)
    with pytest.raises(StoreError, match=r"g/.*: a turn index repeats \(\[0, 1, 1, 3\]\)"):
        to_arrow.groups_to_arrow([_with_turn_indexes(group, [0, 1, 1, 3])], datetime.now(UTC))
    with pytest.raises(StoreError, match="a turn index repeats"):
        to_arrow.groups_to_arrow([_with_turn_indexes(group, [3, 0, 2, 0])], datetime.now(UTC))
    shuffled = to_arrow.groups_to_arrow(
        [_with_turn_indexes(group, [3, 0, 2, 1])], datetime.now(UTC)
    )
    assert shuffled["turns"]["turn_index"].to_pylist()[:4] == [3, 0, 2, 1]
    # the same index in two episodes, or after an episode without turns, is no repeat
    empty = dataclasses.replace(group.episodes[1], turns=())
    fine = dataclasses.replace(group, episodes=(group.episodes[0], empty, *group.episodes[2:]))
    assert to_arrow.groups_to_arrow([fine], datetime.now(UTC))["turns"].num_rows > 0

    turn = next(t for t in group.episodes[2].turns if t.tool_calls)
    call = turn.tool_calls[0]
    twice = dataclasses.replace(turn, tool_calls=(call, dataclasses.replace(call)))
    ep = group.episodes[2]
    ep = dataclasses.replace(ep, turns=tuple(twice if t is turn else t for t in ep.turns))
    bad = dataclasses.replace(group, episodes=(*group.episodes[:2], ep, *group.episodes[3:]))
    with pytest.raises(StoreError, match=rf"turn {turn.index}: a tool call index repeats"):
        to_arrow.groups_to_arrow([bad], datetime.now(UTC))


def test_turn_and_call_keys_exist_on_postgresql_only():
    from sqlalchemy.dialects import postgresql
    from sqlalchemy.schema import CreateIndex, CreateTable

    duck = sa.create_engine("duckdb:///:memory:").dialect
    for table in (schema.turns, schema.tool_calls):
        assert "PRIMARY KEY" not in str(CreateTable(table).compile(dialect=duck)), table.name
        assert "PRIMARY KEY" in str(CreateTable(table).compile(dialect=postgresql.dialect()))
    engine = sa.create_engine("duckdb:///:memory:", poolclass=sa.pool.StaticPool)
    schema.metadata.create_all(engine)
    with engine.connect() as conn:
        indexes = conn.exec_driver_sql("SELECT index_name FROM duckdb_indexes()").scalars().all()
        keys = (
            conn.exec_driver_sql(
                "SELECT table_name FROM duckdb_constraints() WHERE constraint_type = 'PRIMARY KEY'"
            )
            .scalars()
            .all()
        )
        assert "ix_turns_group" not in set(indexes)
        assert {"episodes", "groups"} <= (keys := set(keys)) and not {"turns", "tool_calls"} & keys
    (ix,) = schema.turns.indexes  # PostgreSQL's: tests/integration/store/test_migrations.py
    assert "CREATE INDEX ix_turns_group" in str(
        CreateIndex(ix).compile(dialect=postgresql.dialect())
    )
