"""The writer's spool file format: one group per file, Arrow IPC in the store's own schema.

A spooled group (``<spool>/<sha1 of group_id>.group``) is **one Arrow IPC stream** holding
one record batch of one row. Its columns are the store's bulk tables (``groups``,
``group_states``, ``episodes``, ``turns``, ``tool_calls``: :data:`~sandpiper.store.schema.BULK_TABLES`),
each of type ``list<struct<…>>`` whose struct is that table's Arrow schema
(:func:`~sandpiper.store.schema.arrow_schema`); the list holds the rows the group becomes,
exactly as :func:`~sandpiper.store.to_arrow.convert_groups` makes them for ingest (packed
token / logprob BLOBs, per-turn policy version + change points). The schema's metadata says
what the file is:

- ``sandpiper.spool.format``: :data:`FORMAT_VERSION` (a reader refuses any other value);
- ``sandpiper.spool.group_id``: the group's id (also in the ``groups`` row);
- ``sandpiper.spool.slot_lease``: the slot lease the group was produced under, or empty (not
  a store column: the store checks it at ingest and keeps only the slot's current lease);
- ``sandpiper.store.schema_version``: the store schema the tables were made from (information:
  columns are read by name, and :func:`read` fills a nullable column a later migration added).

Why one stream of list columns and not one stream per table: an IPC stream has one schema,
and one self-describing stream per file keeps the write a single buffer (temp file, fsync,
rename, fsync of the folder: see :mod:`sandpiper.store.writer`) that any Arrow reader can
open (``pyarrow.ipc.open_stream``). Buffers are compressed with :data:`COMPRESSION`
(measured with ``bench/spool_bench.py``); a reader needs no option to read any of them.

One conversion per group: ``put`` checks and converts a group once
(:func:`~sandpiper.store.to_arrow.checked_rows`: the ingest check of
:mod:`sandpiper.store.validation` runs on the converted buffers), :func:`encode_rows` writes
those rows, and the commit inserts the rows :func:`read` gives back from the file — the same
rows whether the group was put by this process or found in the spool after a restart; no
``GroupRecord`` is rebuilt on the way. :func:`decode` still rebuilds one (the writer's
``on_outcome`` of a group read back after a restart, ``store retry-dead``, tests).

Files of the release before format 1 — a pickle of the ``GroupRecord`` (:func:`load_legacy`) —
are still read so that groups acknowledged before an upgrade commit after it (checked and
converted when read); they are unpickled with an allow-list of the classes such a pickle
holds (records, numpy arrays, datetimes), so a file dropped into the spool cannot run code.
New files are never pickles.
"""

from __future__ import annotations

import codecs
import dataclasses
import io
import pickle
from datetime import UTC, date, datetime, timedelta, timezone
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sandpiper.errors import StoreError
from sandpiper.store import packed, records, schema, text, to_arrow
from sandpiper.store.records import (
    EpisodeRecord,
    GroupRecord,
    GroupSampling,
    Role,
    Split,
    StopReason,
    ToolCallRecord,
    ToolErrorKind,
    TurnRecord,
)
from sandpiper.store.to_arrow import GroupRows

FORMAT_VERSION = "1"
"""Value of ``sandpiper.spool.format``; bump when the layout of a spool file changes (and
keep reading the previous one: acknowledged groups must commit after an upgrade). Format 1
already held the rows the store inserts, so the files written before ``put`` stopped
converting twice are read, and committed, as they are."""

COMPRESSION: str | None = None
"""IPC buffer compression of new spool files (``None``, ``"lz4"`` or ``"zstd"``; a reader
takes any). None, measured with ``bench/spool_bench.py`` (groups of 8 trajectories × 20
turns × 500 tokens, load ~1–2, p50 of a durable ``put``): pickle 2.9–3.0 ms and 664 kB, IPC 2.9–3.6 ms
(1.0–1.3×) and 518 kB (0.78×: the per-token policy versions are a per-turn scalar), lz4 1.3–1.8×
the pickle's time for 0.41× (``make_group``'s regular tokens) to 0.53× (``--random``) of its
bytes, zstd 1.5–2.2× for 0.20–0.43×. A spool file lives until the next commit (~1.5 s) and
the store zstd-compresses what it keeps, so the bytes saved are not worth the time on the
collector's path; compression would pay where the spool must hold a long store outage."""

KEY_FORMAT = b"sandpiper.spool.format"
KEY_GROUP = b"sandpiper.spool.group_id"
KEY_LEASE = b"sandpiper.spool.slot_lease"
KEY_SCHEMA = b"sandpiper.store.schema_version"

_IPC_MAGIC = b"\xff\xff\xff\xff"
"""An IPC stream starts with the continuation marker of its schema message."""

TABLES = tuple(t.name for t in schema.BULK_TABLES)
_SCHEMAS = {t.name: schema.arrow_schema(t) for t in schema.BULK_TABLES}


class SpoolFormatError(StoreError):
    """A spool file that is not a group this release can read (truncated, another format
    version, not a spool file at all)."""


# ---- writing -------------------------------------------------------------------------------


def _as_list_column(table: pa.Table) -> pa.Array:
    """All rows of ``table`` as one ``list<struct>`` value (a one-row list array)."""
    table = table.combine_chunks()
    fields = list(table.schema)
    if table.num_rows:
        values = pa.StructArray.from_arrays(
            [c.chunk(0) if c.num_chunks else pa.array([], c.type) for c in table.columns],
            fields=fields,
        )
    else:
        values = pa.array([], pa.struct(fields))
    return pa.ListArray.from_arrays(pa.array([0, table.num_rows], pa.int32()), values)


def warm_up() -> None:
    """Pay pyarrow's one-time costs now: its first conversion of Python values imports pandas
    (measured 0.5–3.3 s on the 2-core machine, once per process). Run when a writer starts,
    so that the collector's first acknowledged group does not wait for it."""
    pa.array([0], pa.int64())


def encode(group: GroupRecord, *, compression: str | None = COMPRESSION) -> pa.Buffer:
    """The spool file of ``group`` after the store's ingest check (bytes to write); raises
    :class:`StoreError` for a group the store could not ingest (a trainable turn without
    logprobs, arrays of wrong length). The writer's ``put`` keeps the rows it converts
    (:func:`~sandpiper.store.to_arrow.checked_rows`, then :func:`encode_rows`)."""
    rows, _ = to_arrow.checked_rows(group, records.utcnow())
    return encode_rows(rows, compression=compression)


def encode_rows(rows: GroupRows, *, compression: str | None = COMPRESSION) -> pa.Buffer:
    """The spool file holding ``rows`` (one checked group's rows: ``to_arrow.checked_rows``)."""
    columns = [_as_list_column(rows.tables[name]) for name in TABLES]
    meta = {
        KEY_FORMAT: FORMAT_VERSION.encode(),
        KEY_GROUP: rows.group_id.encode(),
        KEY_LEASE: b"" if rows.slot_lease is None else str(rows.slot_lease).encode(),
        KEY_SCHEMA: str(schema.SCHEMA_VERSION).encode(),
    }
    batch = pa.RecordBatch.from_arrays(columns, schema=pa.schema(
        [pa.field(n, c.type, nullable=False) for n, c in zip(TABLES, columns, strict=True)],
        metadata=meta,
    ))  # fmt: skip
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, batch.schema, options=options) as w:
        w.write_batch(batch)
    return sink.getvalue()


# ---- reading -------------------------------------------------------------------------------


def read(data: bytes | pa.Buffer) -> GroupRows:
    """The rows a spool file holds, ready to commit: this format's tables as they are, or a
    pickle of the release before it checked and converted (:func:`load_legacy`). Raises
    :class:`SpoolFormatError` for anything else."""
    head = bytes(memoryview(data)[:4])
    if head == _IPC_MAGIC:
        return _read_ipc(data)
    if head[:1] == b"\x80":  # pickle protocol >= 2 (what put() wrote before format 1)
        return _legacy_rows(bytes(data))[0]
    raise SpoolFormatError(f"not a spool file (starts with {head!r})")


def decode(data: bytes | pa.Buffer) -> GroupRecord:
    """The group a spool file holds, as a record: rebuilt from this format's rows
    (:func:`group_of`), or the previous release's pickle (:func:`load_legacy`). Raises
    :class:`SpoolFormatError` for anything else. The commit does not need it (:func:`read`)."""
    head = bytes(memoryview(data)[:4])
    if head[:1] == b"\x80":
        return load_legacy(bytes(data))
    rows = read(data)
    try:
        return group_of(rows)
    except (KeyError, ValueError, TypeError, IndexError, pa.ArrowException) as e:
        raise SpoolFormatError(f"spool file does not hold a whole group: {e!r}") from e


def group_of(rows: GroupRows) -> GroupRecord:
    """The record whose rows ``rows`` are (:func:`tables_to_group`)."""
    return tables_to_group(rows.tables, slot_lease=rows.slot_lease)


def _read_ipc(data: bytes | pa.Buffer) -> GroupRows:
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data) if isinstance(data, bytes) else data)
        meta = reader.schema.metadata or {}
        version = meta.get(KEY_FORMAT)
        if version != FORMAT_VERSION.encode():
            raise SpoolFormatError(
                f"spool format {version!r}, this release reads {FORMAT_VERSION!r}"
            )
        batches = list(reader)
    except pa.ArrowException as e:  # truncated or damaged
        raise SpoolFormatError(f"unreadable Arrow IPC stream: {e}") from e
    if len(batches) != 1 or batches[0].num_rows != 1:
        raise SpoolFormatError(f"expected one row, found {[b.num_rows for b in batches]}")
    batch = batches[0]
    try:
        tables = {name: _conformed(name, _rows(batch, name)) for name in TABLES}
        lease = meta.get(KEY_LEASE, b"")
        rows = _group_rows(tables, slot_lease=int(lease) if lease else None)
    except SpoolFormatError:
        raise
    except (KeyError, ValueError, TypeError, IndexError, pa.ArrowException) as e:
        raise SpoolFormatError(f"spool file does not hold a whole group: {e!r}") from e
    if meta.get(KEY_GROUP, rows.group_id.encode()) != rows.group_id.encode():
        raise SpoolFormatError("group id in the metadata differs from the groups row")
    return rows


def _rows(batch: pa.RecordBatch, name: str) -> pa.Table:
    col = batch.column(name)
    if not isinstance(col, pa.ListArray):
        raise TypeError(f"column {name} is {col.type}, not a list of rows")
    values = col.flatten()
    return pa.Table.from_batches([pa.RecordBatch.from_struct_array(values)])


def _conformed(name: str, table: pa.Table) -> pa.Table:
    """``table`` in this release's Arrow schema of table ``name``: columns by name, a
    nullable column the file lacks (added by a later migration) filled with nulls."""
    want = _SCHEMAS[name]
    if table.schema.equals(want):
        return table
    columns = []
    for f in want:
        if f.name in table.column_names:
            columns.append(table[f.name].cast(f.type))
        elif f.nullable:
            columns.append(pa.nulls(table.num_rows, f.type))
        else:
            raise SpoolFormatError(f"table {name} has no column {f.name}")
    return pa.Table.from_arrays(columns, schema=want)


def _group_rows(tables: dict[str, pa.Table], *, slot_lease: int | None) -> GroupRows:
    """The :class:`GroupRows` of one group's tables (every row of the group's id)."""
    groups = tables["groups"]
    if groups.num_rows != 1 or tables["group_states"].num_rows != 1:
        raise ValueError("not one groups row and one group_states row")
    stored_id = groups["group_id"][0]
    for name, table in tables.items():
        if table.num_rows and not pc.all(pc.equal(table["group_id"], stored_id)).as_py():
            raise ValueError(f"rows of another group in {name}")
    (g,) = _pylist(groups.select(["group_id", "run_id", "task_id", "collector_id"]))
    episode_ids = [text.decode(e) or "" for e in tables["episodes"]["episode_id"].to_pylist()]
    return GroupRows(
        group_id=g["group_id"],
        run_id=g["run_id"],
        task_id=g["task_id"],
        slot_lease=slot_lease,
        collector_id=g["collector_id"],
        episode_ids=frozenset(episode_ids),
        tables=tables,
    )


def _dt(value: datetime | None) -> datetime:
    if value is None:
        raise ValueError("missing timestamp")
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _pylist(table: pa.Table) -> list[dict[str, Any]]:
    """``table``'s rows as dicts, text columns decoded (:mod:`sandpiper.store.text`)."""
    rows = table.to_pylist()
    names = [f.name for f in table.schema if pa.types.is_string(f.type)]
    for row in rows:
        for n in names:
            row[n] = text.decode(row[n])
    return rows


def tables_to_group(tables: dict[str, pa.Table], *, slot_lease: int | None) -> GroupRecord:
    """Rebuild the one group whose rows ``tables`` are (the inverse of
    :func:`~sandpiper.store.to_arrow.convert_groups` for one checked group)."""
    (g,) = _pylist(tables["groups"])
    turns_t = tables["turns"]
    lengths = packed.packed_lengths(turns_t["token_ids"], "<i4")
    tokens = packed.unpack(turns_t["token_ids"], "<i4")
    has_lp = turns_t["logprobs"].is_valid().to_numpy(zero_copy_only=False)
    logprobs = packed.unpack(turns_t["logprobs"], "<f4")
    token_at = np.r_[0, np.cumsum(lengths)]
    lp_at = np.r_[0, np.cumsum(np.where(has_lp, lengths, 0))]
    calls: dict[tuple[str, int], list[ToolCallRecord]] = {}
    for c in _pylist(tables["tool_calls"]):
        calls.setdefault((c["episode_id"], c["turn_index"]), []).append(
            ToolCallRecord(
                index=c["call_index"],
                name=c["name"],
                arguments_json=c["arguments"],
                output=c["output"],
                output_bytes_total=c["output_bytes_total"],
                exit_code=c["exit_code"],
                duration_ms=c["duration_ms"],
                timed_out=c["timed_out"],
                error_kind=ToolErrorKind(c["error_kind"]),
            )
        )
    turns: dict[str, list[TurnRecord]] = {}
    cols = _pylist(turns_t.select(
        ["episode_id", "turn_index", "role", "text", "policy_version",
         "policy_version_changes", "trainable", "started_at", "duration_ms"]
    ))  # fmt: skip
    for i, t in enumerate(cols):
        n = int(lengths[i])
        lp = logprobs[lp_at[i] : lp_at[i + 1]] if has_lp[i] else None
        versions: np.ndarray | None
        if t["policy_version"] is not None:
            versions = packed.expand_versions(t["policy_version"], t["policy_version_changes"], n)
        else:  # no version: nothing sampled (or an empty sampled turn)
            versions = np.zeros(0, np.int32) if lp is not None and n == 0 else None
        turns.setdefault(t["episode_id"], []).append(
            TurnRecord(
                index=t["turn_index"],
                role=Role(t["role"]),
                text=t["text"],
                token_ids_T=tokens[token_at[i] : token_at[i + 1]],
                logprobs_T=lp,
                policy_versions_T=versions,
                trainable=t["trainable"],
                started_at=_dt(t["started_at"]),
                duration_ms=t["duration_ms"],
                tool_calls=tuple(calls.get((t["episode_id"], t["turn_index"]), ())),
            )
        )
    episodes = tuple(
        EpisodeRecord(
            episode_id=e["episode_id"],
            sample_index=e["sample_index"],
            stop_reason=StopReason(e["stop_reason"]),
            valid=e["valid"],
            trainable=e["trainable"],
            reward=e["reward"],
            reward_breakdown=text.loads(e["reward_breakdown"]),
            turns=tuple(turns.get(e["episode_id"], ())),
            started_at=_dt(e["started_at"]),
            duration_ms=e["duration_ms"],
            sandbox_id=e["sandbox_id"],
            error=e["error"],
        )
        for e in _pylist(tables["episodes"])
    )
    if sum(len(e.turns) for e in episodes) != turns_t.num_rows:
        raise ValueError("turn rows of episodes the group does not have")
    return GroupRecord(
        group_id=g["group_id"],
        run_id=g["run_id"],
        task_id=g["task_id"],
        split=Split(g["split"]),
        sampling_params=GroupSampling.from_json(text.loads(g["sampling_params"])),
        episodes=episodes,
        created_at=_dt(g["created_at"]),
        collector_id=g["collector_id"],
        slot_lease=slot_lease,
    )


# ---- the pickles of the release before format 1 --------------------------------------------

_RECORD_MODULES = {"sandpiper.store.records", "store.records"}
"""Where the record classes lived: ``store.records`` before the parts moved under
``sandpiper`` (commit 8007c1f)."""
_ALLOWED: dict[tuple[str, str], Any] = {
    ("datetime", "datetime"): datetime,
    ("datetime", "timedelta"): timedelta,
    ("datetime", "timezone"): timezone,
    ("datetime", "date"): date,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "bytearray"): bytearray,
    ("_codecs", "encode"): codecs.encode,  # bytes in protocol 2 (numpy data)
}
_NUMPY_HELPERS = {"_reconstruct", "_frombuffer", "scalar"}


class _SpoolUnpickler(pickle.Unpickler):
    """Only the classes a pickled GroupRecord holds; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module in _RECORD_MODULES:
            cls = getattr(records, name, None)
            if isinstance(cls, type) and cls.__module__ == records.__name__:
                return cls
        if module.startswith(("numpy._core.", "numpy.core.")) and name in _NUMPY_HELPERS:
            sub = module.split(".", 2)[2]
            if sub in ("multiarray", "numeric"):  # numpy 2 names it _core, numpy 1 core
                try:
                    return super().find_class(f"numpy._core.{sub}", name)
                except ImportError:
                    return super().find_class(f"numpy.core.{sub}", name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a spool file")


def upgraded(group: GroupRecord) -> GroupRecord:
    """A group spooled by an earlier release, in this release's types (before
    ``GroupSampling``, ``sampling_params`` was a dict)."""
    if isinstance(group.sampling_params, dict):
        return dataclasses.replace(
            group, sampling_params=GroupSampling.from_json(group.sampling_params)
        )
    return group


def load_legacy(data: bytes) -> GroupRecord:
    """A group pickled by the previous release's ``GroupWriter.put`` (and the older shapes
    :func:`upgraded` converts); :class:`SpoolFormatError` for anything else."""
    return _legacy_rows(data)[1]


def _legacy_rows(data: bytes) -> tuple[GroupRows, GroupRecord]:
    """:func:`load_legacy`'s group, checked and converted (its rows), and as it was pickled."""
    try:
        group = _SpoolUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # truncated, refused class, ...: never crash the writer
        raise SpoolFormatError(f"unreadable pickled spool file: {e!r}") from e
    if not isinstance(group, GroupRecord):
        raise SpoolFormatError(f"pickled spool file holds a {type(group).__name__}")
    group = upgraded(group)
    try:  # a pickle's fields may hold anything; the store's conversion must take them
        rows, _ = to_arrow.checked_rows(group, records.utcnow())
    except Exception as e:
        raise SpoolFormatError(f"pickled group {group.group_id!r} cannot be stored: {e!r}") from e
    return rows, group
