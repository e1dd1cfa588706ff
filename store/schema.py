"""The store's tables, declared once (SQLAlchemy Core) — DDL and Arrow schemas derive from here.

Both backends use this one declaration: DuckDB (embedded default) and PostgreSQL (JSON becomes
JSONB there). Keys are natural strings (``run_id``, ``group_id``, ``episode_id``) so that
ingest is idempotent without sequences (DuckDB rejects ``Identity``/SERIAL keys).

Why a separate ``group_states`` table: claims update status columns often, and DuckDB's
``UPDATE … RETURNING`` on a wide table is very slow; ``groups`` itself is written once.
Analysis joins ``groups`` with ``group_states`` on ``group_id`` (the view ``group_status``
in analysis does that).

Token ids and sampling logprobs are packed arrays (:data:`Packed`): one BLOB per turn of
little-endian int32 / float32 values, which DuckDB compresses with zstd (``USING
COMPRESSION ZSTD``; BYTEA on PostgreSQL). Per-token policy versions are a per-turn scalar
(``policy_version``, the version of the turn's first sampled token) plus, only for the rare
turn sampled across a weight update, its change points (``policy_version_changes``). Never
JSON. Rewards are DOUBLE (``Float`` is 4 bytes in DuckDB).

Why packed BLOBs and not INTEGER[] / REAL[] lists (measured with bench/store_bench.py,
10,000 trajectories × 20 turns × 500 tokens): lists are stored with DuckDB's lightweight
integer/float codecs, 11× the bytes of the same data in Parquet + zstd (402 MB vs 36.5 MB);
DuckDB cannot zstd a LIST column, but it can a BLOB, and then stores about what Parquet does.
Reading a packed column back is one ``np.frombuffer`` of the Arrow binary buffer (no list
flattening). :mod:`sandpiper.store.packed` packs and unpacks; ``sandpiper sql`` and the analysis
API show the arrays as lists.

Why ``turns`` and ``tool_calls`` have their primary key (and ``turns`` its ``group_id``
index) only on PostgreSQL: in DuckDB these are ART indexes that no query uses (DuckDB
prunes the learner's ``group_id IN (…)`` scan with row-group zone maps: rows go in a group
at a time) and that cost a quarter of the file and a third of a large commit (measured,
2,000 trajectories: 14.2 → 10.8 MB, commit 26 → 8 ms; the claim's fetch unchanged). What
the keys guaranteed still holds: a group's rows are inserted only when its id is new
(``groups``' key, under the writer's lock), an episode id only once (``episodes``' key),
and :func:`sandpiper.store.to_arrow.convert_groups` refuses an episode whose turn indexes,
or a turn whose call indexes, repeat. On PostgreSQL the keys are the index that episode
lookups use. Migration 6 rebuilds the two tables of an older DuckDB store.
"""

from __future__ import annotations

import pyarrow as pa
import sqlalchemy as sa

from sandpiper.store.text import SafeJson, SafeText

SCHEMA_VERSION = 7
"""Bump with a registered migration in ``store/migrations.py`` whenever a table changes."""

metadata = sa.MetaData()

Text = SafeText
"""Every text column: any Python string (NUL, lone surrogates) round-trips on both backends;
what a backend refuses is stored escaped after a marker (:mod:`sandpiper.store.text`)."""
Json = SafeJson
"""JSON text in DuckDB (json extension, bundled), JSONB on PostgreSQL; strings in it escaped
as in :data:`Text`, non-finite floats as marker strings (:mod:`sandpiper.store.text`)."""
Timestamp = sa.DateTime(timezone=True)


class _ZstdBlob(sa.types.UserDefinedType):
    """DuckDB's BLOB stored with zstd (the column's codec is persisted in the file)."""

    cache_ok = True

    def get_col_spec(self, **kw) -> str:
        return "BLOB USING COMPRESSION ZSTD"


Packed = sa.LargeBinary().with_variant(_ZstdBlob(), "duckdb")
"""A packed little-endian numeric array (int32 token ids, float32 logprobs): BLOB (zstd) in
DuckDB, BYTEA in PostgreSQL."""

schema_meta = sa.Table(
    "schema_meta",
    metadata,
    sa.Column("key", Text, primary_key=True),
    sa.Column("value", Text, nullable=False),
    comment="Store metadata; key 'schema_version' holds the applied schema version.",
)

runs = sa.Table(
    "runs",
    metadata,
    sa.Column("run_id", Text, primary_key=True),
    sa.Column("config_json", Json, nullable=False, comment="Resolved run config."),
    sa.Column("code_version", Text, nullable=False),
    sa.Column("created_at", Timestamp, nullable=False),
)

policies = sa.Table(
    "policies",
    metadata,
    sa.Column("run_id", Text, primary_key=True),
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("checkpoint_uri", Text, nullable=False),
    sa.Column("parent_version", sa.Integer, comment="NULL for version 0."),
    sa.Column("learner_step", sa.Integer, comment="NULL for version 0."),
    sa.Column("created_at", Timestamp, nullable=False),
)

tasks = sa.Table(
    "tasks",
    metadata,
    sa.Column("task_id", Text, primary_key=True),
    sa.Column("source", Text, nullable=False),
    sa.Column("format", Text, nullable=False),
    sa.Column("instruction", Text, nullable=False),
    sa.Column("reference", Json, nullable=False),
    sa.Column("data_uri", Text, comment="NULL for prompt-only tasks."),
    sa.Column("split", Text, nullable=False),
)

groups = sa.Table(
    "groups",
    metadata,
    sa.Column("group_id", Text, primary_key=True),
    sa.Column("run_id", Text, nullable=False),
    sa.Column("task_id", Text, nullable=False),
    sa.Column("split", Text, nullable=False),
    sa.Column("sampling_params", Json, nullable=False),
    sa.Column("n_episodes", sa.Integer, nullable=False),
    sa.Column("n_valid", sa.Integer, nullable=False),
    sa.Column("min_policy_version", sa.Integer, comment="Oldest sampled token; NULL if none."),
    sa.Column("max_policy_version", sa.Integer, comment="Newest sampled token; NULL if none."),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("committed_at", Timestamp, nullable=False),
    # last: migration 2 appends it, and PostgreSQL's ingest copies rows by column position
    sa.Column("collector_id", Text, comment="Collector that produced it; NULL if none."),
)

group_states = sa.Table(
    "group_states",
    metadata,
    sa.Column("group_id", Text, primary_key=True),
    sa.Column("run_id", Text, nullable=False),
    sa.Column("status", Text, nullable=False, comment="store.records.GroupStatus value."),
    sa.Column("claim_id", Text, comment="Current or last claim; NULL if never claimed."),
    sa.Column("claimed_by", Text, comment="learner_id of the claim."),
    sa.Column("lease_expires_at", Timestamp, comment="A claim past this may be re-taken."),
    sa.Column("consumed_by_step", sa.Integer, comment="Learner step that trained on it."),
    sa.Column("updated_at", Timestamp, nullable=False),
    sa.Index("ix_group_states_run_status", "run_id", "status"),
)

episodes = sa.Table(
    "episodes",
    metadata,
    sa.Column("episode_id", Text, primary_key=True),
    sa.Column("group_id", Text, nullable=False),
    sa.Column("run_id", Text, nullable=False),
    sa.Column("task_id", Text, nullable=False),
    sa.Column("sample_index", sa.Integer, nullable=False),
    sa.Column("stop_reason", Text, nullable=False, comment="records.StopReason value."),
    sa.Column("valid", sa.Boolean, nullable=False, comment="False: infra failure."),
    sa.Column("trainable", sa.Boolean, nullable=False),
    sa.Column("reward", sa.Double, comment="NULL when invalid or not scored."),
    sa.Column("reward_breakdown", Json, nullable=False),
    sa.Column("min_policy_version", sa.Integer),
    sa.Column("max_policy_version", sa.Integer),
    sa.Column("n_turns", sa.Integer, nullable=False),
    sa.Column("completion_tokens", sa.Integer, nullable=False),
    sa.Column("total_tokens", sa.Integer, nullable=False),
    sa.Column("started_at", Timestamp, nullable=False),
    sa.Column("duration_ms", sa.Double, nullable=False),
    sa.Column("sandbox_id", Text),
    sa.Column("error", Text, comment="Cause of an infra failure; NULL otherwise."),
    sa.Index("ix_episodes_group", "group_id"),
)

turns = sa.Table(
    "turns",
    metadata,
    sa.Column("episode_id", Text, nullable=False),
    sa.Column("turn_index", sa.Integer, nullable=False),
    sa.Column("group_id", Text, nullable=False),
    sa.Column("role", Text, nullable=False, comment="records.Role value."),
    sa.Column("text", Text, nullable=False),
    sa.Column("token_ids", Packed, nullable=False, comment="int32 little-endian, packed."),
    sa.Column("logprobs", Packed, comment="float32 LE sampling logprobs; NULL if not sampled."),
    sa.Column(
        "policy_version", sa.Integer, comment="Version of the first sampled token; NULL if none."
    ),
    sa.Column(
        "policy_version_changes",
        sa.ARRAY(sa.Integer),
        comment="[token offset, version, ...] where the version changes; NULL if it never does.",
    ),
    sa.Column("trainable", sa.Boolean, nullable=False, comment="In the loss (sampled tokens)."),
    sa.Column("n_tokens", sa.Integer, nullable=False),
    sa.Column("started_at", Timestamp, nullable=False),
    sa.Column("duration_ms", sa.Double, nullable=False),
    sa.PrimaryKeyConstraint("episode_id", "turn_index").ddl_if(dialect="postgresql"),
    sa.Index("ix_turns_group", "group_id").ddl_if(dialect="postgresql"),
)

tool_calls = sa.Table(
    "tool_calls",
    metadata,
    sa.Column("episode_id", Text, nullable=False),
    sa.Column("turn_index", sa.Integer, nullable=False),
    sa.Column("call_index", sa.Integer, nullable=False),
    sa.Column("group_id", Text, nullable=False),
    sa.Column("name", Text, nullable=False),
    sa.Column("arguments", Text, nullable=False, comment="JSON text (raw if unparsable)."),
    sa.Column("output", Text, nullable=False, comment="Capped head + tail."),
    sa.Column("output_bytes_total", sa.BigInteger, nullable=False),
    sa.Column("exit_code", sa.Integer),
    sa.Column("duration_ms", sa.Double, nullable=False),
    sa.Column("timed_out", sa.Boolean, nullable=False),
    sa.Column("error_kind", Text, nullable=False, comment="records.ToolErrorKind value."),
    sa.PrimaryKeyConstraint("episode_id", "turn_index", "call_index").ddl_if(dialect="postgresql"),
)

learner_steps = sa.Table(
    "learner_steps",
    metadata,
    sa.Column("run_id", Text, primary_key=True),
    sa.Column("step", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("policy_version", sa.Integer, nullable=False, comment="Version it produced."),
    sa.Column("claim_id", Text, comment="Claim whose groups it consumed."),
    sa.Column("n_groups", sa.Integer, nullable=False),
    sa.Column("metrics", Json, nullable=False),
    sa.Column("created_at", Timestamp, nullable=False),
)

learner_leases = sa.Table(
    "learner_leases",
    metadata,
    sa.Column("run_id", Text, primary_key=True),
    sa.Column("learner_id", Text, nullable=False, comment="host:pid:start:random."),
    sa.Column("term", sa.Integer, nullable=False, comment="+1 at every change of leader."),
    sa.Column("expires_at", Timestamp, nullable=False, comment="Store clock; renewed."),
    sa.Column("acquired_at", Timestamp, nullable=False),
    comment="The learner in charge of each run; its term fences claims and registrations "
    "(docs/scaleout.md).",
)

collectors = sa.Table(
    "collectors",
    metadata,
    sa.Column("collector_id", Text, primary_key=True, comment="host:pid:start:random."),
    sa.Column("run_id", Text, nullable=False),
    sa.Column("host", Text, nullable=False, comment="collector.host_id or host name."),
    sa.Column("pid", sa.Integer, nullable=False, comment="In its own PID namespace."),
    sa.Column("started_at", Timestamp, nullable=False),
    sa.Column("heartbeat_at", Timestamp, nullable=False, comment="Store clock."),
    sa.Column("stopped_at", Timestamp, comment="Clean stop or retired; NULL while running."),
    # last: migration 5 appends it
    sa.Column(
        "policy_version",
        sa.Integer,
        comment="Version it serves or is loading (set before a reload); NULL: none announced.",
    ),
    comment="One row per collector process; see docs/scaleout.md.",
)

task_slots = sa.Table(
    "task_slots",
    metadata,
    sa.Column("run_id", Text, primary_key=True),
    sa.Column("task_id", Text, primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("split", Text, nullable=False),
    sa.Column("rank", Text, nullable=False, comment="Fixed tie-break order of tasks."),
    sa.Column("status", Text, nullable=False, comment="free, leased or done."),
    sa.Column("collector_id", Text, comment="Holder of the latest lease."),
    sa.Column("lease", sa.Integer, nullable=False, comment="Times issued (0 = never)."),
    sa.Column("leased_at", Timestamp),
    sa.Column("done_at", Timestamp, comment="When its group was stored."),
    sa.Index("ix_task_slots_run_status", "run_id", "status", "seq"),
    comment="Task slots (one GRPO group each) issued to collectors; docs/scaleout.md.",
)

dead_groups = sa.Table(
    "dead_groups",
    metadata,
    sa.Column("group_id", Text, primary_key=True),
    sa.Column("run_id", Text, nullable=False),
    sa.Column("source", Text, nullable=False, comment="'writer': never committed; 'learner'."),
    sa.Column("collector_id", Text, comment="Collector whose writer gave it up; NULL if none."),
    sa.Column(
        "error", Text, nullable=False, comment="Last error, as the writer or learner saw it."
    ),
    sa.Column(
        "spool", Packed, comment="The group's spool file (writer): what retry-dead re-submits."
    ),
    sa.Column("attempts", sa.Integer, nullable=False, comment="Times it failed (retries too)."),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("updated_at", Timestamp, nullable=False),
    comment="Groups that failed alone and were set aside so that nothing else waits on them "
    "(docs/security.md: no poison pill); `sandpiper store retry-dead` re-submits them.",
)

BULK_TABLES = (groups, group_states, episodes, turns, tool_calls)
"""Tables the writer fills from Arrow, parents first (one transaction per batch)."""


def _arrow_type(col: sa.Column) -> pa.DataType:
    t = col.type
    if isinstance(t, sa.types.TypeDecorator):
        t = t.impl_instance
    if isinstance(t, sa.ARRAY):
        item = t.item_type
        return pa.list_(pa.float32() if isinstance(item, sa.REAL) else pa.int32())
    if isinstance(t, sa.LargeBinary):
        return pa.large_binary()  # 64-bit offsets: a batch's token bytes may pass 2 GB
    if isinstance(t, sa.JSON):
        return pa.string()  # JSON travels as text; both backends cast on insert
    if isinstance(t, sa.DateTime):
        return pa.timestamp("us", tz="UTC")
    if isinstance(t, sa.Boolean):
        return pa.bool_()
    if isinstance(t, sa.BigInteger):
        return pa.int64()
    if isinstance(t, sa.Integer):
        return pa.int32()
    if isinstance(t, sa.Double):
        return pa.float64()
    if isinstance(t, sa.REAL):
        return pa.float32()
    if isinstance(t, sa.String):
        return pa.string()
    raise TypeError(f"no Arrow type for column {col.table.name}.{col.name}: {t!r}")


def arrow_schema(table: sa.Table) -> pa.Schema:
    """The Arrow schema of ``table``, derived column by column from the Core declaration."""
    return pa.schema([pa.field(c.name, _arrow_type(c), nullable=c.nullable) for c in table.c])
