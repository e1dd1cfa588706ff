"""Store benchmark: ingest vs Parquet, learner batch fetch, read latency during writes.

Run::

    .venv/bin/python bench/store_bench.py --json     # 2,000 trajectories × 20 turns × 500 tokens
    .venv/bin/python bench/store_bench.py --full     # 10,000 trajectories
    .venv/bin/python bench/store_bench.py --postgres local  # also a private PostgreSQL (or a URL)

Figures (one line each; with ``--json`` the last line is one JSON object):

- ingest: trajectories/s and MB/s of ``Store.write_groups`` (Arrow bulk insert, one
  transaction per batch of 2,000 trajectories, as the writer commits) into a DuckDB file,
  against writing the same Arrow tables to Parquet (zstd) with pyarrow in the same run →
  ``ingest_vs_parquet_ratio`` = Parquet time / store time (1.0 = as fast as Parquet; goal
  ≥ 0.8); both times include building the Arrow tables from the records.
- ``store_bytes_vs_parquet``: the DuckDB file's bytes / the bytes of the same data in
  Parquet + zstd with the turns' arrays as list columns (``parquet_lists_file_mb``; goal ≤ 2).
  With ``--postgres`` the same groups are also written to that (empty) database and
  ``postgres_mb`` is the sum of ``pg_total_relation_size`` of its tables.
- ``batch_fetch_ms_p50``: ``store.claims.claim`` of 64 groups × 8 trajectories (claim + load; goal
  ≤ 100 ms).
- ``read_during_write_ms_p50`` / ``_max``: a read-only query (open, count, close) while
  another thread keeps committing batches (goal max ≤ 300 ms).
- ``store_cpu_ms_per_group``: CPU of ``Store.write_groups`` per group of 8 (records
  converted at the commit, as one batch).
- ``writer_cpu_ms_per_group``: the collector's write path for the same number of groups (of
  other ids) into another DuckDB file: ``GroupWriter.put`` of each (check, convert once,
  durable spool file; ``writer_put_cpu_ms_per_group``), then one commit of them all
  (``writer_commit_cpu_ms_per_group``, the rows the spool holds inserted).
- ``*_cpu_*``: the same in CPU seconds of this process (all threads), which the machine's
  other load blurs far less than wall time; ``load_avg_1m_start`` / ``_end`` say how loaded
  it was. One untimed warm-up batch goes through both paths first.

What limits each figure: docs/benchmarks.md; measured figures: bench/results/store_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandpiper.store import Store, to_arrow, train_arrays
from sandpiper.store.backends import DuckDBBackend
from sandpiper.store.records import PolicyRecord, RunRecord
from sandpiper.testing import make_group

GROUP_SIZE = 8
BATCH_EPISODES = 2000


def _setup_run(store: Store) -> None:
    store.ensure_run(RunRecord("run", "{}", "bench"))
    store.policy_versions.register(PolicyRecord("run", 0, "none", None, None))


def _batches(n_traj: int, n_turns: int, tokens: int, prefix: str):
    per_batch = BATCH_EPISODES // GROUP_SIZE
    n_groups = max(1, n_traj // GROUP_SIZE)
    for start in range(0, n_groups, per_batch):
        yield [
            make_group(f"{prefix}{i:06d}", n_episodes=GROUP_SIZE, n_turns=n_turns,
                       tokens_per_turn=tokens)
            for i in range(start, min(start + per_batch, n_groups))
        ]  # fmt: skip


def warm_up(work: Path, n_turns: int, tokens: int) -> None:
    """One untimed batch through both paths into scratch files: the first batch of a
    process pays one-off costs (imports, allocator growth, first DuckDB open) that would
    otherwise all land on whichever side runs first."""
    scratch = work / "warm-up"
    scratch.mkdir()
    store = Store(f"duckdb:///{scratch / 'warm.duckdb'}")
    store.init()
    groups = next(_batches(BATCH_EPISODES, n_turns, tokens, "warm"))
    store.write_groups(groups)
    store.close()
    for name, table in to_arrow.groups_to_arrow(groups, datetime.now(UTC)).items():
        pq.write_table(table, scratch / f"{name}.parquet", compression="zstd")
    shutil.rmtree(scratch)


def bench_ingest(store: Store, out_dir: Path, n_traj: int, n_turns: int, tokens: int) -> dict:
    store_s = parquet_s = store_cpu = parquet_cpu = 0.0
    n_bytes = n_done = 0
    for k, groups in enumerate(_batches(n_traj, n_turns, tokens, "g")):
        t0, c0 = time.perf_counter(), time.process_time()
        store.write_groups(groups)
        store_s += time.perf_counter() - t0
        store_cpu += time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        tables = to_arrow.groups_to_arrow(groups, datetime.now(UTC))
        for name, table in tables.items():
            pq.write_table(table, out_dir / f"{name}-{k:04d}.parquet", compression="zstd")
        parquet_s += time.perf_counter() - t0
        parquet_cpu += time.process_time() - c0
        # The size baseline: the same turns with list columns (one value per token), the
        # layout an analyst would write; Parquet compresses it better than packed bytes
        # (measured: 7.3 vs 13.5 MB at --scale 0.2), so it is the stricter denominator.
        lists = train_arrays.turns_as_lists(tables["turns"])
        pq.write_table(lists, out_dir / "lists" / f"turns-{k:04d}.parquet", compression="zstd")
        n_bytes += sum(t.nbytes for t in tables.values())
        n_done += sum(len(g.episodes) for g in groups)
    mb = n_bytes / 1e6
    assert isinstance(store.backend, DuckDBBackend)  # the bench writes a DuckDB file
    store_path = store.backend.path
    parquet_bytes = sum(f.stat().st_size for f in out_dir.glob("*.parquet"))
    list_bytes = parquet_bytes - sum(f.stat().st_size for f in out_dir.glob("turns-*.parquet"))
    list_bytes += sum(f.stat().st_size for f in (out_dir / "lists").glob("*.parquet"))
    return {
        # The synthetic data is kind to zstd (identical logprob ramps, token ids in arithmetic
        # progressions that repeat shifted); the packed zstd BLOBs find the same repeats.
        "store_file_mb": round(store_path.stat().st_size / 1e6, 1),
        "store_bytes_vs_parquet": round(store_path.stat().st_size / list_bytes, 2),
        "parquet_lists_file_mb": round(list_bytes / 1e6, 1),
        "parquet_file_mb": round(parquet_bytes / 1e6, 1),
        "trajectories": n_done,
        "store_s": round(store_s, 3),
        "parquet_s": round(parquet_s, 3),
        "store_trajectories_per_s": round(n_done / store_s, 1),
        "store_mb_per_s": round(mb / store_s, 1),
        "parquet_trajectories_per_s": round(n_done / parquet_s, 1),
        "parquet_mb_per_s": round(mb / parquet_s, 1),
        "ingest_vs_parquet_ratio": round(parquet_s / store_s, 3),
        # CPU seconds of this process (all threads, DuckDB's included): the same ratio
        # without the machine's other load and without waiting for the disk
        "store_cpu_s": round(store_cpu, 3),
        "parquet_cpu_s": round(parquet_cpu, 3),
        "ingest_vs_parquet_cpu_ratio": round(parquet_cpu / store_cpu, 3),
        "store_cpu_ms_per_group": round(store_cpu / (n_done / GROUP_SIZE) * 1e3, 3),
    }


def bench_writer(work: Path, n_traj: int, n_turns: int, tokens: int) -> dict:
    """The collector's write path: ``put`` every group into a ``GroupWriter`` (no commit
    due meanwhile), then one flush; CPU of this process (all threads) per group."""
    store = Store(f"duckdb:///{work / 'writer.duckdb'}")
    store.init()
    _setup_run(store)
    put_cpu, n_groups = 0.0, 0
    # one batch of the collector's default size, committed by the flush
    with store.writer(spool_dir=str(work / "writer.spool"), flush_interval_s=3600,
                      flush_max_episodes=BATCH_EPISODES + 1) as w:  # fmt: skip
        for groups in _batches(n_traj, n_turns, tokens, "w"):
            c0 = time.process_time()
            for g in groups:
                w.put(g)
            put_cpu += time.process_time() - c0
            n_groups += len(groups)
        c0 = time.process_time()
        w.flush()
        commit_cpu = time.process_time() - c0
        assert w.committed_groups == n_groups, (w.committed_groups, n_groups)
    store.close()
    return {
        "writer_put_cpu_ms_per_group": round(put_cpu / n_groups * 1e3, 3),
        "writer_commit_cpu_ms_per_group": round(commit_cpu / n_groups * 1e3, 3),
        "writer_cpu_ms_per_group": round((put_cpu + commit_cpu) / n_groups * 1e3, 3),
    }


def bench_postgres(url: str, n_traj: int, n_turns: int, tokens: int, parquet: dict) -> dict:
    """Write the same groups to PostgreSQL; its tables' total bytes (heap + TOAST + indexes),
    its ingest time against the Parquet time of the same run, and its batch fetch."""
    pg = Store(url)
    pg.init()
    _setup_run(pg)
    t0 = time.perf_counter()
    for groups in _batches(n_traj, n_turns, tokens, "g"):
        pg.write_groups(groups)
    seconds = time.perf_counter() - t0
    with pg.connect_readonly() as conn:
        n_bytes = conn.exec_driver_sql(
            "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = current_schema() AND c.relkind = 'r'"
        ).scalar()
    fetch = bench_fetch(pg, repeats=5)
    pg.close()
    return {
        "postgres_mb": round(int(n_bytes) / 1e6, 1),
        "postgres_bytes_vs_parquet": round(
            int(n_bytes) / 1e6 / parquet["parquet_lists_file_mb"], 2
        ),
        "postgres_ingest_s": round(seconds, 2),
        "postgres_ingest_vs_parquet_ratio": round(parquet["parquet_s"] / seconds, 3),
        "postgres_batch_fetch_ms_p50": fetch["batch_fetch_ms_p50"],
    }


def bench_fetch(store: Store, repeats: int) -> dict:
    """``store.claims.claim`` of 64 groups, each claim released again untimed so that every timed
    claim is a full one (a store of 250 groups has only 3 disjoint claims of 64)."""
    times, cpu = [], []
    for i in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        batch = store.claims.claim(run_id="run", learner_id=f"L{i}", n_groups=64, max_lag=100)
        times.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
        if batch is None:
            raise SystemExit("fewer than 64 groups stored: nothing to fetch")
        store.claims.release(batch.claim_id)
    return {
        "batch_fetch_ms_p50": round(statistics.median(times), 1),
        "batch_fetch_ms_max": round(max(times), 1),
        "batch_fetch_cpu_ms_p50": round(statistics.median(cpu), 1),
        "fetches": len(times),
    }


def bench_read_during_write(store: Store, n_turns: int, tokens: int, seconds: float) -> dict:
    stop = threading.Event()
    commits = []

    def write() -> None:
        for k in range(10_000):
            if stop.is_set():
                return
            groups = [make_group(f"w{k}-{i}", n_turns=n_turns, tokens_per_turn=tokens)
                      for i in range(16)]  # fmt: skip
            store.write_groups(groups)
            commits.append(k)

    writer = threading.Thread(target=write)
    writer.start()
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or len(latencies) < 5:
        t0 = time.perf_counter()
        with store.connect_readonly() as conn:
            conn.exec_driver_sql("SELECT count(*) FROM episodes").scalar()
        latencies.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.02)
    stop.set()
    writer.join()
    return {
        "read_during_write_ms_p50": round(statistics.median(latencies), 1),
        "read_during_write_ms_max": round(max(latencies), 1),
        "reads": len(latencies),
        "writer_commits": len(commits),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=0.2, help="fraction of 10,000 trajectories")
    ap.add_argument("--full", action="store_true", help="the issue's size (--scale 1)")
    ap.add_argument(
        "--postgres",
        default=None,
        help="also write to this empty PostgreSQL db; 'local': a private throw-away server",
    )
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=500, help="tokens per turn")
    ap.add_argument("--dir", default=None, help="work dir (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as last line")
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="store-bench-"))
    (work / "parquet" / "lists").mkdir(parents=True, exist_ok=True)
    store = Store(f"duckdb:///{work / 'bench.duckdb'}")
    store.init()
    _setup_run(store)
    if args.full:
        args.scale = 1.0
    n_traj = max(GROUP_SIZE, int(10_000 * args.scale))

    result = {"scale": args.scale, "turns": args.turns, "tokens_per_turn": args.tokens}
    result["load_avg_1m_start"] = round(os.getloadavg()[0], 1)
    warm_up(work, args.turns, args.tokens)
    result |= bench_ingest(store, work / "parquet", n_traj, args.turns, args.tokens)
    result |= bench_writer(work, n_traj, args.turns, args.tokens)
    if args.postgres == "local":
        from tests.fixtures.postgres import private_server

        with private_server() as url:
            result |= bench_postgres(url, n_traj, args.turns, args.tokens, result)
    elif args.postgres:
        result |= bench_postgres(args.postgres, n_traj, args.turns, args.tokens, result)
    result |= bench_fetch(store, repeats=7)
    result |= bench_read_during_write(store, args.turns, args.tokens, seconds=10)
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 1)
    for key, value in result.items():
        print(f"{key}: {value}")
    if args.json:
        print(json.dumps(result))
    store.close()
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
