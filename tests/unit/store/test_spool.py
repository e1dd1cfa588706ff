"""The writer's spool format (store/spool.py): Arrow IPC in the store's schema, every field
round-trips, the previous release's pickles still commit, unreadable files are quarantined."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import sqlalchemy as sa

from sandpiper.errors import StoreError
from sandpiper.store import Store, schema, spool, to_arrow
from sandpiper.store.records import (
    EpisodeRecord,
    GroupRecord,
    GroupSampling,
    Role,
    RunRecord,
    Split,
    StopReason,
    ToolCallRecord,
    ToolErrorKind,
    TurnRecord,
    WriteOutcome,
)
from sandpiper.store.slots import task_rank
from sandpiper.store.validation import check_group
from sandpiper.testing import make_group

pytestmark = pytest.mark.timeout(120)  # a group that cannot commit keeps a writer retrying


@pytest.fixture
def store(tmp_path):
    s = Store(f"duckdb:///{tmp_path / 'store.duckdb'}")
    s.init()
    s.ensure_run(RunRecord("run", "{}", "test"))
    yield s
    s.close()


def _name(group_id: str) -> str:
    return hashlib.sha1(group_id.encode()).hexdigest()


T0 = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def rich_group(group_id: str = "run/task/7", *, slot_lease: int | None = 3) -> GroupRecord:
    """A group with every kind of field and value the spool must keep."""
    n = 6
    sampled = TurnRecord(
        index=1,
        role=Role.ASSISTANT,
        text="I'll run ünïcödé `ls` \x00 and\nmore",
        token_ids_T=np.array([5, 150_000, 0, 2**31 - 1, 7, 8], np.int32),
        logprobs_T=np.array([-0.5, -1e-8, -30.25, 0.0, -2.0, -np.float32(1e-40)], np.float32),
        policy_versions_T=np.array([4, 4, 5, 5, 5, 6], np.int32),  # sampled across updates
        trainable=True,
        started_at=T0 + timedelta(seconds=1),
        duration_ms=12.25,
        tool_calls=(
            ToolCallRecord(0, "execute_bash", '{"command": "ls"}', "a\nb\n", 4, 0, 2.0, False),
            ToolCallRecord(1, "nope", "{bad json", "", 0, None, 0.0, True, ToolErrorKind.BAD_JSON),
        ),
    )
    prompt = TurnRecord(
        index=0,
        role=Role.SYSTEM,
        text="sys",
        token_ids_T=np.arange(n, dtype=np.int32),
        logprobs_T=None,
        policy_versions_T=None,
        trainable=False,
        started_at=T0,
        duration_ms=0.0,
    )
    tool = TurnRecord(
        index=2,
        role=Role.TOOL,
        text="",
        token_ids_T=np.zeros(0, np.int32),
        logprobs_T=None,
        policy_versions_T=None,
        trainable=False,
        started_at=T0,
        duration_ms=0.5,
    )
    empty_sampled = TurnRecord(
        index=3,
        role=Role.ASSISTANT,
        text="",
        token_ids_T=np.zeros(0, np.int32),
        logprobs_T=np.zeros(0, np.float32),
        policy_versions_T=np.zeros(0, np.int32),
        trainable=True,
        started_at=T0,
        duration_ms=0.0,
    )
    user = dataclasses.replace(prompt, index=4, role=Role.USER, text="again")
    good = EpisodeRecord(
        episode_id="e0",
        sample_index=0,
        stop_reason=StopReason.SUBMITTED,
        valid=True,
        trainable=True,
        reward=0.75,
        reward_breakdown={"tests_passed": 3, "nested": {"a": [1, 2.5, None, "x"]}, "ok": True},
        turns=(prompt, sampled, tool, empty_sampled, user),
        started_at=T0,
        duration_ms=99.5,
        sandbox_id="box-1",
    )
    invalid = EpisodeRecord(
        episode_id="e1",
        sample_index=1,
        stop_reason=StopReason.SANDBOX_LOST,
        valid=False,
        trainable=True,
        reward=None,
        reward_breakdown={},
        turns=(prompt,),
        started_at=T0,
        duration_ms=1.0,
        sandbox_id=None,
        error="container vanished",
    )
    no_turns = EpisodeRecord(
        episode_id="e2",
        sample_index=2,
        stop_reason=StopReason.MAX_TURNS,
        valid=True,
        trainable=False,
        reward=-1.0,
        reward_breakdown={"why": "eval"},
        turns=(),
        started_at=T0,
        duration_ms=0.0,
        sandbox_id=None,
    )
    return GroupRecord(
        group_id=group_id,
        run_id="run",
        task_id="task",
        split=Split.TRAIN,
        sampling_params=GroupSampling(
            temperature=0.7,
            top_p=0.95,
            max_tokens_per_turn=512,
            max_turns=8,
            max_episode_tokens=4096,
            context_limit=8192,
            tool_format="hermes",
            endpoint="http://x/v1",
            model="m",
        ),
        episodes=(good, invalid, no_turns),
        created_at=T0,
        collector_id="host:1:2:abc",
        slot_lease=slot_lease,
    )


def assert_same(a, b, where: str = "group") -> None:
    """Field by field, arrays by dtype and value (NaN equal to NaN)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), where
        assert a.dtype == b.dtype, f"{where}: {a.dtype} != {b.dtype}"
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} != {b!r}"


# ---- the format ------------------------------------------------------------------------------


def test_every_field_round_trips() -> None:
    group = rich_group()
    back = spool.decode(spool.encode(group))
    assert_same(group, back)
    assert back.episodes[0].turns[0].started_at.tzinfo is UTC


@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
def test_round_trip_with_each_compression(compression) -> None:
    group = make_group("g", n_episodes=3, n_turns=4, tokens_per_turn=33, n_invalid=1)
    assert_same(group, spool.decode(spool.encode(group, compression=compression)))


def test_a_spool_file_is_the_rows_the_store_ingests() -> None:
    """One IPC stream, one row; a list column per bulk table whose struct is the store's
    Arrow schema; the format version and slot lease in the schema's metadata."""
    group = rich_group()
    reader = pa.ipc.open_stream(spool.encode(group))
    meta = reader.schema.metadata
    assert meta[b"sandpiper.spool.format"] == spool.FORMAT_VERSION.encode()
    assert meta[b"sandpiper.spool.group_id"] == group.group_id.encode()
    assert meta[b"sandpiper.spool.slot_lease"] == b"3"
    assert meta[b"sandpiper.store.schema_version"] == str(schema.SCHEMA_VERSION).encode()
    (batch,) = list(reader)
    assert batch.num_rows == 1
    want, _ = to_arrow.convert_groups([group], datetime.now(UTC))
    assert batch.schema.names == [t.name for t in schema.BULK_TABLES]
    for table in schema.BULK_TABLES:
        column = batch.column(table.name)
        assert column.type.value_type == pa.struct(list(schema.arrow_schema(table)))
        rows = pa.Table.from_batches([pa.RecordBatch.from_struct_array(column.flatten())])
        skip = {"committed_at", "updated_at"}  # the commit's time, set again at ingest
        assert rows.drop_columns([c for c in rows.column_names if c in skip]).equals(
            want[table.name].drop_columns([c for c in rows.column_names if c in skip])
        ), table.name


def test_what_is_read_back_converts_to_the_same_rows() -> None:
    """The store ingests the same rows whether a group comes from memory or from the spool
    (also for a group the ingest check invalidates: NaN logprob, fractional version)."""
    bad = make_group("run/task/1", n_episodes=2, n_turns=2, tokens_per_turn=4)
    t = bad.episodes[0].turns[1]
    lp = t.logprobs_T.copy()
    lp[1] = np.nan
    turn = dataclasses.replace(
        t, logprobs_T=lp, policy_versions_T=np.array([0, 0.5, 1, 1], np.float64)
    )
    ep = dataclasses.replace(bad.episodes[0], turns=(bad.episodes[0].turns[0], turn))
    bad = dataclasses.replace(bad, episodes=(ep, bad.episodes[1]))
    now = datetime.now(UTC)
    for group in (rich_group(), bad):
        direct = to_arrow.groups_to_arrow([check_group(group)], now)
        spooled = to_arrow.groups_to_arrow([check_group(spool.decode(spool.encode(group)))], now)
        for name in direct:
            assert direct[name].equals(spooled[name]), name
    back = spool.decode(spool.encode(bad))
    assert back.episodes[0].stop_reason is StopReason.BAD_SAMPLER_OUTPUT
    assert back.episodes[0].turns[1].policy_versions_T.tolist() == [0, -1, 1, 1]


def test_put_refuses_a_group_the_store_cannot_take(store, tmp_path) -> None:
    g = make_group("g-bad", n_turns=2)
    ep = g.episodes[0]
    broken = dataclasses.replace(ep.turns[1], logprobs_T=None)  # trainable without logprobs
    g = dataclasses.replace(g, episodes=(dataclasses.replace(ep, turns=(ep.turns[0], broken)),))
    with store.writer(spool_dir=str(tmp_path / "spool")) as w:
        with pytest.raises(StoreError, match="trainable without logprobs_T"):
            w.put(g)
        assert w.pending() == 0
    assert not list((tmp_path / "spool").glob("*.group"))
    assert not list((tmp_path / "spool").glob("*.tmp"))


# ---- the writer ------------------------------------------------------------------------------


def _stored(store: Store, sql: str):
    with store.connect_readonly() as conn:
        return conn.execute(sa.text(sql)).all()


def test_put_spools_arrow_and_a_new_writer_commits_it(store, tmp_path) -> None:
    spool_dir = tmp_path / "spool"
    tasks = [("task", task_rank("task", seed=1))]
    cid = store.slots.register(run_id="run", host="h")
    (slot,) = store.slots.claim(run_id="run", collector_id=cid, tasks=tasks, ttl_s=600)
    group = dataclasses.replace(rich_group(slot.group_id, slot_lease=slot.lease), collector_id=cid)
    w = store.writer(spool_dir=str(spool_dir), flush_interval_s=3600)
    w.put(group)
    path = spool_dir / f"{_name(group.group_id)}.group"
    assert path.read_bytes()[:4] == b"\xff\xff\xff\xff"  # an IPC stream, not a pickle
    assert_same(check_group(group), spool.decode(path.read_bytes()))
    # a crash before the commit: the thread never commits, the lock goes with the process
    w._closed = True
    with w._cond:
        w._pending.clear()
        w._cond.notify_all()
    w._thread.join()
    w._owner.release()
    assert path.exists()
    seen: list[tuple[str, WriteOutcome]] = []
    with store.writer(
        spool_dir=str(spool_dir), on_outcome=lambda g, o: seen.append((g.group_id, o))
    ) as again:
        assert again.pending() == 1
        again.flush(timeout_s=30)
    assert seen == [(group.group_id, WriteOutcome.STORED)]
    assert again.committed_groups == 1 and again.rejected_groups == 0
    assert not path.exists()
    assert store.claims.group_ids("run") == [group.group_id]
    ((lease, status),) = _stored(
        store, f"SELECT lease, status FROM task_slots WHERE seq = {slot.seq}"
    )
    assert (lease, status) == (slot.lease, "done")
    (row,) = _stored(store, "SELECT sampling_params, collector_id, n_episodes, n_valid FROM groups")
    params = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    assert params == group.sampling_params.to_json()
    assert row[1:] == (cid, 3, 2)
    lps = _stored(store, "SELECT logprobs FROM turns WHERE episode_id = 'e0' AND turn_index = 1")
    np.testing.assert_array_equal(
        np.frombuffer(lps[0][0], "<f4"), group.episodes[0].turns[1].logprobs_T
    )


def _previous_release_put(spool_dir: Path, group: GroupRecord) -> None:
    """``GroupWriter.put``'s file writing as the previous release (commit 8007c1f) did it,
    verbatim: a pickle of the GroupRecord, temp file, fsync, rename, fsync of the folder."""
    name = hashlib.sha1(group.group_id.encode()).hexdigest()
    path = spool_dir / f"{name}.group"
    tmp = spool_dir / f"{name}.{threading.get_ident()}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(group, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fd = os.open(spool_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_spool_of_the_previous_release_commits_after_the_upgrade(store, tmp_path) -> None:
    """Pickles written by the previous release's put() (and the older shapes: a dict for
    sampling_params; the records under ``store.records`` before the parts moved into
    ``sandpiper``) commit, are deleted, and sit next to new files."""
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    previous = [
        rich_group("run/task/0", slot_lease=None),
        make_group("g-prev", n_episodes=4, n_turns=3, n_invalid=1),
    ]
    for g in previous:
        _previous_release_put(spool_dir, g)
    older = dataclasses.replace(
        make_group("g-dict"),
        sampling_params={"temperature": 0.5, "limits": {"max_turns": 3}, "max_tokens": 16},
    )
    (spool_dir / f"{_name('g-dict')}.group").write_bytes(pickle.dumps(older))
    before_move = pickle.dumps(make_group("g-store-records"), protocol=2)
    assert b"csandpiper.store.records\n" in before_move
    (spool_dir / f"{_name('g-store-records')}.group").write_bytes(
        before_move.replace(b"csandpiper.store.records\n", b"cstore.records\n")
    )
    (spool_dir / f"{_name('g-new')}.group").write_bytes(spool.encode(make_group("g-new")))
    with store.writer(spool_dir=str(spool_dir)) as w:
        assert w.pending() == 5
        w.flush(timeout_s=30)
    assert w.committed_groups == 5 and w.rejected_groups == 0
    assert not list(spool_dir.glob("*.group"))
    assert sorted(store.claims.group_ids("run")) == sorted(
        ["run/task/0", "g-prev", "g-dict", "g-store-records", "g-new"]
    )
    (params,) = _stored(store, "SELECT sampling_params FROM groups WHERE group_id = 'g-dict'")[0]
    got = json.loads(params) if isinstance(params, str) else params
    assert got == {"temperature": 0.5, "top_p": 1.0, "max_tokens_per_turn": 16, "max_turns": 3}
    # what the previous release spooled reads back as it was
    _previous_release_put(spool_dir, previous[0])
    assert_same(
        previous[0], spool.decode((spool_dir / f"{_name('run/task/0')}.group").read_bytes())
    )


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_unreadable_spool_files_are_quarantined_not_fatal(store, tmp_path, caplog, monkeypatch):
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    good = spool.encode(make_group("g-ok"))
    (spool_dir / "a-truncated.group").write_bytes(good.to_pybytes()[: good.size // 2])
    monkeypatch.setattr(spool, "FORMAT_VERSION", "99")
    (spool_dir / "b-future.group").write_bytes(spool.encode(make_group("g-future")))
    monkeypatch.undo()
    (spool_dir / "c-garbage.group").write_bytes(b"not a spool file at all")
    (spool_dir / "d-empty.group").write_bytes(b"")
    (spool_dir / "e-evil.group").write_bytes(pickle.dumps(_Evil()))
    pickled = pickle.dumps(make_group("g-trunc-pickle"), protocol=pickle.HIGHEST_PROTOCOL)
    (spool_dir / "f-truncated-pickle.group").write_bytes(pickled[:-100])
    (spool_dir / "g-not-a-group.group").write_bytes(pickle.dumps({"group_id": "x"}))
    junk = dataclasses.replace(make_group("g-junk"), episodes=("not an episode",))
    (spool_dir / "h-junk-fields.group").write_bytes(pickle.dumps(junk))
    (spool_dir / f"{_name('g-ok')}.group").write_bytes(good)
    monkeypatch.chdir(tmp_path)
    with (
        caplog.at_level(logging.ERROR, logger="sandpiper.store.writer"),
        store.writer(spool_dir=str(spool_dir)) as w,
    ):
        assert w.pending() == 1
        w.flush(timeout_s=30)
    assert not (tmp_path / "pwned").exists()
    assert w.committed_groups == 1
    assert w.unreadable_files == 8 and w.rejected_groups == 8
    assert store.claims.group_ids("run") == ["g-ok"]
    assert not list(spool_dir.glob("*.group"))
    assert sorted(p.name for p in (spool_dir / "rejected").iterdir()) == [
        "a-truncated.group",
        "b-future.group",
        "c-garbage.group",
        "d-empty.group",
        "e-evil.group",
        "f-truncated-pickle.group",
        "g-not-a-group.group",
        "h-junk-fields.group",
    ]
    lines = [r.getMessage() for r in caplog.records if "UNREADABLE" in r.getMessage()]
    assert len(lines) == 8
    assert any("spool format b'99', this release reads '1'" in m for m in lines)
    assert any("posix.system is not allowed" in m or "os.system" in m for m in lines)


def test_a_leftover_temp_file_is_ignored_and_removed(store, tmp_path) -> None:
    """kill -9 during put(): the temp file was never acknowledged; it is removed, not read."""
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    data = spool.encode(make_group("g-half"))
    (spool_dir / f"{_name('g-half')}.123.tmp").write_bytes(data.to_pybytes()[:1000])
    (spool_dir / f"{_name('g-done')}.456.tmp").write_bytes(data)  # whole, but never renamed
    with store.writer(spool_dir=str(spool_dir)) as w:
        assert w.pending() == 0
        w.flush(timeout_s=10)
    assert w.rejected_groups == 0 and w.committed_groups == 0
    assert not list(spool_dir.glob("*.tmp"))
    assert not (spool_dir / "rejected").exists()
    assert store.claims.group_ids("run") == []


FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "spool"


@pytest.mark.parametrize("release", ["previous-release", "format-1"])
def test_spool_files_of_earlier_releases_commit(store, tmp_path, release) -> None:
    """Files written by an earlier release's own code (tests/fixtures/spool/README.md) are
    committed, whole and exact, by this release's writer, and deleted."""
    from sandpiper.testing import expected_tokens

    run = {"previous-release": "prev", "format-1": "v1"}[release]
    store.ensure_run(RunRecord(run, "{}", "test"))
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    for f in sorted((FIXTURES / release).glob("*.group")):
        (spool_dir / f.name).write_bytes(f.read_bytes())
    with store.writer(spool_dir=str(spool_dir)) as w:
        assert w.pending() == 2
        w.flush(timeout_s=30)
    assert (w.committed_groups, w.rejected_groups) == (2, 0)
    assert not list(spool_dir.glob("*.group"))
    assert store.claims.group_ids(run) == [f"{run}/task/0", f"{run}/task/1"]
    rows = _stored(
        store,
        "SELECT e.group_id, e.sample_index, t.turn_index, t.token_ids, t.logprobs, t.trainable, "
        "e.valid FROM turns t JOIN episodes e USING (episode_id) ORDER BY 1, 2, 3",
    )
    assert len(rows) == 2 * 3 + 3 * 2
    for gid, i, turn, tokens, logprobs, trainable, valid in rows:
        n = 8 if gid.endswith("/0") else 5
        assert np.frombuffer(tokens, "<i4").tolist() == expected_tokens(gid, i, turn, n).tolist()
        assert trainable == (turn % 2 == 1) and (logprobs is not None) == trainable
        assert valid == (gid.endswith("/0") or i >= 1)
    ((n_valid,),) = _stored(store, f"SELECT n_valid FROM groups WHERE group_id = '{run}/task/1'")
    assert n_valid == 2


# ---- one conversion per group ------------------------------------------------------------------


def _group_ids(store: Store) -> list[str]:
    return [gid for (gid,) in _stored(store, "SELECT group_id FROM groups ORDER BY group_id")]


def _count_conversions(monkeypatch) -> dict[str, int]:
    """Counts of records -> Arrow conversions and Arrow -> records rebuilds from now on."""
    calls = {"convert": 0, "rebuild": 0}
    convert, rebuild = to_arrow.convert_groups, spool.tables_to_group

    def counted_convert(groups, now):
        calls["convert"] += len(groups)
        return convert(groups, now)

    def counted_rebuild(tables, **kw):
        calls["rebuild"] += 1
        return rebuild(tables, **kw)

    monkeypatch.setattr(to_arrow, "convert_groups", counted_convert)
    monkeypatch.setattr(spool, "tables_to_group", counted_rebuild)
    return calls


def test_put_converts_once_and_the_commit_inserts_the_spooled_rows(store, tmp_path, monkeypatch):
    """A group is converted once, at put; the commit (from memory or after a restart) inserts
    the rows its spool file holds, without rebuilding a record or converting again."""
    calls = _count_conversions(monkeypatch)
    groups = [make_group(f"g{i}", n_episodes=3, n_turns=3, tokens_per_turn=5) for i in range(4)]
    with store.writer(spool_dir=str(tmp_path / "a"), flush_interval_s=3600) as w:
        for g in groups[:2]:
            w.put(g)
        assert calls == {"convert": 2, "rebuild": 0}
        w.flush(timeout_s=30)
    assert calls == {"convert": 2, "rebuild": 0}
    # a restart: two groups put, the writer gone before its commit
    spool_dir = tmp_path / "b"
    w = store.writer(spool_dir=str(spool_dir), flush_interval_s=3600)
    for g in groups[2:]:
        w.put(g)
    assert w.abandon() == 2
    assert calls == {"convert": 4, "rebuild": 0}
    with store.writer(spool_dir=str(spool_dir)) as again:
        again.flush(timeout_s=30)
    assert again.committed_groups == 2
    assert calls == {"convert": 4, "rebuild": 0}
    assert _group_ids(store) == [g.group_id for g in groups]
    # with an on_outcome, a group read back after a restart is rebuilt for it (only then)
    w = store.writer(spool_dir=str(spool_dir), flush_interval_s=3600)
    told = make_group("g-told")
    w.put(told)
    w.abandon()
    seen: list[GroupRecord] = []
    with store.writer(spool_dir=str(spool_dir), on_outcome=lambda g, o: seen.append(g)) as again:
        again.flush(timeout_s=30)
    assert calls == {"convert": 5, "rebuild": 1}
    assert_same(check_group(told), seen[0])


def test_the_spooled_rows_are_the_rows_a_direct_write_stores(store, tmp_path) -> None:
    """The same group through the writer (rows made at put, committed after a restart) and
    through ``write_groups`` (records converted at the commit) stores the same rows."""
    other = Store(f"duckdb:///{tmp_path / 'direct.duckdb'}")
    other.init()
    other.ensure_run(RunRecord("run", "{}", "test"))
    group = rich_group("run/task/0", slot_lease=None)
    other.write_groups([group])
    spool_dir = tmp_path / "spool"
    w = store.writer(spool_dir=str(spool_dir), flush_interval_s=3600)
    w.put(group)
    w.abandon()
    with store.writer(spool_dir=str(spool_dir)) as again:
        again.flush(timeout_s=30)
    for table in schema.BULK_TABLES:
        skip = {"committed_at", "updated_at"}
        cols = ", ".join(c.name for c in table.c if c.name not in skip)
        order = ", ".join(c.name for c in table.primary_key)
        sql = f"SELECT {cols} FROM {table.name} ORDER BY {order}"
        with other.connect_readonly() as conn:
            want = conn.execute(sa.text(sql)).all()
        assert _stored(store, sql) == want, table.name
    other.close()


def test_read_gives_the_rows_and_checks_they_are_one_group() -> None:
    group = rich_group()
    rows, _ = to_arrow.checked_rows(group, datetime.now(UTC))
    back = spool.read(spool.encode_rows(rows))
    assert (back.group_id, back.run_id, back.task_id, back.slot_lease, back.collector_id) == (
        group.group_id, group.run_id, group.task_id, 3, group.collector_id,
    )  # fmt: skip
    assert back.episode_ids == {"e0", "e1", "e2"} and back.n_episodes == 3
    for name, table in rows.tables.items():
        assert back.tables[name].equals(table), name
    # rows of two groups in one file are refused
    two, _ = to_arrow.checked_tables([group, make_group("other")], datetime.now(UTC))
    mixed = dataclasses.replace(rows, tables=two)
    with pytest.raises(spool.SpoolFormatError, match="does not hold a whole group"):
        spool.read(spool.encode_rows(mixed))
    # a nullable column the file lacks (a later migration added it) is read as nulls
    episodes = rows.tables["episodes"].drop_columns(["sandbox_id"])
    older = dataclasses.replace(rows, tables={**rows.tables, "episodes": episodes})
    back = spool.read(spool.encode_rows(older))
    assert back.tables["episodes"].schema.equals(rows.tables["episodes"].schema)
    assert back.tables["episodes"]["sandbox_id"].null_count == 3
    # one that may not be null is refused
    older = dataclasses.replace(
        rows, tables={**rows.tables, "episodes": rows.tables["episodes"].drop_columns(["valid"])}
    )
    with pytest.raises(spool.SpoolFormatError, match="no column valid"):
        spool.read(spool.encode_rows(older))


def test_a_spool_file_gone_under_the_writer_commits_from_memory(store, tmp_path, caplog):
    spool_dir = tmp_path / "spool"
    with store.writer(spool_dir=str(spool_dir), flush_interval_s=3600) as w:
        w.put(make_group("g-gone"))
        (spool_dir / f"{_name('g-gone')}.group").unlink()
        with caplog.at_level(logging.WARNING, logger="sandpiper.store.writer"):
            w.flush(timeout_s=30)
    assert w.committed_groups == 1 and _group_ids(store) == ["g-gone"]
    assert any("committing it from memory" in r.getMessage() for r in caplog.records)
