"""Spool benchmark: ``GroupWriter.put`` latency and bytes per group, Arrow IPC vs pickle.

Run::

    .venv/bin/python bench/spool_bench.py --json    # 40 groups × 8 trajectories × 20 turns × 500 tokens

For each spool format, the same synthetic groups (``store.testing.make_group``, the groups
of ``bench/store_bench.py``) are written the way ``put`` writes them: encode, write a temp
file, fsync, rename, fsync of the folder. Formats: ``pickle`` (the previous release's
``pickle.dump(group, HIGHEST_PROTOCOL)``) and ``ipc`` (``store.spool.encode``) with IPC
buffer compression none, lz4 and zstd. Figures per format (one line each; with ``--json``
the last line is one JSON object):

- ``put_ms_p50`` / ``put_ms_mean``: wall time of one durable write (encode + fsyncs);
- ``encode_ms_p50``: the encoding alone (CPU, no disk);
- ``decode_ms_p50``: reading a file back into a ``GroupRecord`` (``store retry-dead``; a
  writer's start reads the rows alone: ``writer_restart_cpu_ms_per_group``);
- ``bytes_per_group``: size of one spool file.

``ratio_put_ms_p50_<format>_vs_pickle`` and ``ratio_bytes_<format>_vs_pickle`` compare each
IPC variant with the pickle in the same run (> 1: slower / bigger than the pickle). The
order of formats rotates every round, so drift of the machine's load spreads over all.
``put`` of a real ``GroupWriter`` is also timed with the default format (``writer_put_ms_p50``),
with the write path's CPU per group (this process, all threads: DuckDB's too):
``writer_put_cpu_ms_per_group`` (check, convert, spool), ``writer_commit_cpu_ms_per_group``
(one commit of all the groups into a DuckDB file) and their sum ``writer_cpu_ms_per_group``;
``writer_restart_cpu_ms_per_group`` is the commit of the same number of other groups by a
writer started on a spool that a previous one left them in (reading the files back included).
And its idle cost: ``writer_idle_cpu_per_s`` is the process's CPU-seconds per second while an
open writer has nothing to commit (a collector between groups), beside
``baseline_idle_cpu_per_s``, the same process idle with no writer, measured in the same run
(goal: <= 0.01, a hundredth of a core; a writer that polled spun a whole core).
``--random`` draws token ids and logprobs at random (``make_group``'s regular ids compress
far better than sampled text does).

Where the IPC encoding's time goes (one group): ~2.0 ms, of which ~1.5 ms is the store's own
records → Arrow conversion, ~0.4 ms the IPC write (the writer converts each group once, at
``put``, and its commit inserts the rows the spool file holds); ``store.spool.COMPRESSION`` says why the
default is no compression. Measured figures: bench/results/spool_bench.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandpiper.store import Store, spool
from sandpiper.store.records import GroupRecord
from sandpiper.store.writer import write_durably
from sandpiper.testing import make_group

GROUP_SIZE = 8


def _durable_write(folder: Path, name: str, data) -> None:
    write_durably(folder / f"{name}.group", data, tmp=folder / f"{name}.tmp")  # as put() does


def _formats() -> dict[str, Callable[[GroupRecord], bytes]]:
    return {
        "pickle": lambda g: pickle.dumps(g, protocol=pickle.HIGHEST_PROTOCOL),
        "ipc": lambda g: spool.encode(g, compression=None),
        "ipc_lz4": lambda g: spool.encode(g, compression="lz4"),
        "ipc_zstd": lambda g: spool.encode(g, compression="zstd"),
    }


def _randomised(group: GroupRecord, seed: int) -> GroupRecord:
    """``group`` with token ids drawn Zipf-like from a 150k vocabulary and logprobs from an
    exponential: about as (in)compressible as sampled text."""
    rng = np.random.default_rng(seed)

    def turn(t):
        n = len(t.token_ids_T)
        ids = np.minimum(rng.zipf(1.2, n), 150_000).astype(np.int32)
        lp = None if t.logprobs_T is None else (-rng.exponential(0.5, n)).astype(np.float32)
        return dataclasses.replace(t, token_ids_T=ids, logprobs_T=lp)

    episodes = tuple(
        dataclasses.replace(e, turns=tuple(turn(t) for t in e.turns)) for e in group.episodes
    )
    return dataclasses.replace(group, episodes=episodes)


def _p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


IDLE_S = 3.0
"""How long the idle cost is measured, with and without an open writer."""


def _idle_cpu_per_s(seconds: float) -> float:
    """CPU-seconds this process (all its threads) uses per second while the caller sleeps."""
    cpu = time.process_time()
    time.sleep(seconds)
    return (time.process_time() - cpu) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=40)
    ap.add_argument("--episodes", type=int, default=GROUP_SIZE)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=500, help="tokens per turn")
    ap.add_argument(
        "--random",
        action="store_true",
        help="random token ids (Zipf-like over 150k) and logprobs instead of make_group's "
        "regular ones, which compress far better than real output",
    )
    ap.add_argument("--dir", default=None, help="work dir (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as last line")
    args = ap.parse_args()

    groups = [
        make_group(f"run/task/{i}", n_episodes=args.episodes, n_turns=args.turns,
                   tokens_per_turn=args.tokens)
        for i in range(args.groups)
    ]  # fmt: skip
    if args.random:
        groups = [_randomised(g, i) for i, g in enumerate(groups)]
    formats = _formats()
    put_ms: dict[str, list[float]] = {k: [] for k in formats}
    enc_ms: dict[str, list[float]] = {k: [] for k in formats}
    dec_ms: dict[str, list[float]] = {k: [] for k in formats}
    size: dict[str, list[int]] = {k: [] for k in formats}
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        base = Path(work)
        folders = {k: base / k for k in formats}
        for f in folders.values():
            f.mkdir()
        for fn in formats.values():  # warm-up: imports, first conversion
            fn(groups[0])
        names = list(formats)
        for i, g in enumerate(groups):
            order = names[i % len(names) :] + names[: i % len(names)]
            for k in order:
                t0 = time.perf_counter()
                data = formats[k](g)
                t1 = time.perf_counter()
                _durable_write(folders[k], str(i), data)
                t2 = time.perf_counter()
                enc_ms[k].append((t1 - t0) * 1e3)
                put_ms[k].append((t2 - t0) * 1e3)
                size[k].append(len(memoryview(data)))
                raw = (folders[k] / f"{i}.group").read_bytes()
                t3 = time.perf_counter()
                back = spool.decode(raw)
                dec_ms[k].append((time.perf_counter() - t3) * 1e3)
                assert back.group_id == g.group_id
        # the real writer, default format (flush never due while timing put)
        store = Store(f"duckdb:///{base / 'w.duckdb'}")
        store.init()
        writer_ms = []
        with store.writer(spool_dir=str(base / "writer"), flush_interval_s=3600,
                          flush_max_episodes=10**9) as w:  # fmt: skip
            c0 = time.process_time()
            for g in groups:
                t0 = time.perf_counter()
                w.put(g)
                writer_ms.append((time.perf_counter() - t0) * 1e3)
            c1 = time.process_time()
            w.flush()
            c2 = time.process_time()
        put_cpu, commit_cpu = (c1 - c0) / len(groups), (c2 - c1) / len(groups)
        # a restart: other groups left in a spool by a writer that stopped before its commit
        others = [make_group(f"run/restart/{i}", n_episodes=args.episodes, n_turns=args.turns,
                             tokens_per_turn=args.tokens)
                  for i in range(len(groups))]  # fmt: skip
        if args.random:
            others = [_randomised(g, len(groups) + i) for i, g in enumerate(others)]
        left = store.writer(spool_dir=str(base / "restart"), flush_interval_s=3600,
                            flush_max_episodes=10**9)  # fmt: skip
        for g in others:
            left.put(g)
        left.abandon()
        c0 = time.process_time()
        with store.writer(spool_dir=str(base / "restart"), flush_interval_s=3600,
                          flush_max_episodes=10**9) as w:  # fmt: skip
            w.flush()
            assert w.committed_groups == len(others), w.committed_groups
        restart_cpu = (time.process_time() - c0) / len(others)
        baseline_idle = _idle_cpu_per_s(IDLE_S)
        with store.writer(spool_dir=str(base / "idle"), flush_interval_s=0.05) as w:
            w.put(groups[0])
            w.flush()
            writer_idle = _idle_cpu_per_s(IDLE_S)
        store.close()

    out: dict[str, object] = {
        "groups": args.groups,
        "group_shape": f"{args.episodes} trajectories x {args.turns} turns x {args.tokens} tokens",
        "tokens": "random (zipf)" if args.random else "make_group",
        "default_compression": spool.COMPRESSION,
        "writer_put_ms_p50": _p50(writer_ms),
        "writer_put_cpu_ms_per_group": round(put_cpu * 1e3, 3),
        "writer_commit_cpu_ms_per_group": round(commit_cpu * 1e3, 3),
        "writer_cpu_ms_per_group": round((put_cpu + commit_cpu) * 1e3, 3),
        "writer_restart_cpu_ms_per_group": round(restart_cpu * 1e3, 3),
        "writer_idle_cpu_per_s": round(writer_idle, 4),
        "baseline_idle_cpu_per_s": round(baseline_idle, 4),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    for k in formats:
        out[f"{k}_put_ms_p50"] = _p50(put_ms[k])
        out[f"{k}_put_ms_mean"] = round(statistics.fmean(put_ms[k]), 3)
        out[f"{k}_encode_ms_p50"] = _p50(enc_ms[k])
        out[f"{k}_decode_ms_p50"] = _p50(dec_ms[k])
        out[f"{k}_bytes_per_group"] = int(statistics.fmean(size[k]))
    for k in formats:
        if k == "pickle":
            continue
        out[f"ratio_put_ms_p50_{k}_vs_pickle"] = round(
            statistics.median(put_ms[k]) / statistics.median(put_ms["pickle"]), 2
        )
        out[f"ratio_encode_ms_p50_{k}_vs_pickle"] = round(
            statistics.median(enc_ms[k]) / statistics.median(enc_ms["pickle"]), 2
        )
        out[f"ratio_bytes_{k}_vs_pickle"] = round(
            statistics.fmean(size[k]) / statistics.fmean(size["pickle"]), 3
        )
    for key, value in out.items():
        print(f"{key}: {value}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
