"""Scale-out benchmark: PostgreSQL store writes from 4 collector processes vs 1, and claim
latency while they write.

Run::

    .venv/bin/python bench/scaleout_bench.py --json          # starts a private PostgreSQL
    .venv/bin/python bench/scaleout_bench.py --fsync-off     # ... with the test fixture's -F
    .venv/bin/python bench/scaleout_bench.py --url postgresql+psycopg://u@host/db

The private server runs PostgreSQL's shipped defaults, what a user's server runs:
``fsync = on``, ``synchronous_commit = on``, 128 MB shared buffers (``--fsync-off`` gives
the test fixture's ``-F`` instead). Each writer is a separate PROCESS doing what a
collector's store writer does, in a loop: claim 16 task slots (``Store.slots.claim``) and
commit their groups (16 groups × 8 trajectories × 6 turns × 200 tokens by default) under
those leases in one transaction (``Store.write_groups_report``: duplicate check, slots
marked done, text COPY). Only building the records from a template happens in the writer
besides; ``make_group`` runs before the clock starts. Figures:

- ``pg_writer_scaling``: aggregate trajectories/s of 4 concurrent writer processes on one
  run, divided by that of 1 writer process (goal >= 2.5). The 1- and 4-writer phases
  alternate for ``--rounds`` rounds, so that on a shared machine both see the same
  background load; the ratio is of the mean rates (``pg_writer_scaling_by_round`` gives
  each round's). 4 writers can beat 1 only by what a single writer leaves idle (waiting on
  round trips and WAL flushes): ``client_cpu_s_per_1k_traj_*`` and
  ``server_cpu_s_per_1k_traj_*`` say what a writer's work costs in CPU on each side, and
  ``machine_busy_cores_*`` how busy the whole machine was (other users included).
- ``claim_ms_p50_under_write``: p50 (and p90) of one collector's slot claim
  (``store.slots.claim`` of 1 slot, one transaction) while the 4 writers commit (goal <= 50 ms);
  ``learner_claim_ms_p50_under_write``: the learner's ``store.claims.claim`` of 4 groups (claim
  and load their token arrays) at the same time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandpiper.store import Store
from sandpiper.store.records import PolicyRecord, RunRecord
from sandpiper.store.slots import task_rank
from sandpiper.testing import make_group

GROUP_SIZE = 8
N_TASKS = 64
GOALS = {"pg_writer_scaling": ">= 2.5", "claim_ms_p50_under_write": "<= 50"}


@contextlib.contextmanager
def private_postgres(*, fsync: bool = True) -> Iterator[tuple[str, int]]:
    """A throw-away PostgreSQL server in a temp dir; yields its URL and postmaster pid.

    With ``fsync`` (the default) it runs PostgreSQL's shipped defaults, as a user's server
    does: ``fsync = on``, ``synchronous_commit = on`` (every commit waits for its WAL flush).
    ``fsync=False`` is the test fixture's setting (``-F``): no flush at all."""
    import glob
    import socket

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    bin_dir = Path(found[-1]).parent if found else Path(shutil.which("initdb") or "").parent
    if not (bin_dir / "initdb").exists():
        raise SystemExit("no PostgreSQL binaries (apt-get install postgresql) and no --url")
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    root = Path(tempfile.mkdtemp(prefix="scaleout-bench-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pg_ctl = [*as_user, str(bin_dir / "pg_ctl"), "-D", str(root / "data")]
    subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(root / "data"), "-A", "trust",
                    "-U", "postgres", "--no-sync"], check=True, capture_output=True)  # fmt: skip
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=50"
    options += "" if fsync else " -F"
    subprocess.run([*pg_ctl, "-o", options, "-l", str(root / "log"), "-w", "start"],
                   check=True, capture_output=True)  # fmt: skip
    try:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres", autocommit=True) as c:
            c.execute("CREATE DATABASE bench")
        pid = int((root / "data" / "postmaster.pid").read_text().split()[0])
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/bench", pid
    finally:
        subprocess.run([*pg_ctl, "-m", "immediate", "-w", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def _proc_cpu_s(pid: int) -> tuple[float, int]:
    """CPU seconds of ``pid`` including its reaped children, and its parent pid."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime + cutime + cstime) / os.sysconf("SC_CLK_TCK"), int(fields[1])


def server_cpu_s(postmaster: int | None) -> float:
    """CPU seconds used so far by a PostgreSQL server: the postmaster, its live backends and
    (through the postmaster's reaped-children counters) those that exited."""
    if postmaster is None:
        return float("nan")
    total = _proc_cpu_s(postmaster)[0]
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != postmaster:
            with contextlib.suppress(OSError, ValueError, IndexError):
                cpu, ppid = _proc_cpu_s(int(entry))
                total += cpu if ppid == postmaster else 0.0
    return total


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return float(sum(values) - idle), float(sum(values))


def _writer(url: str, name: str, seconds: float, batch: int, turns: int, tokens: int,
            ready, start, out, measured) -> None:  # fmt: skip
    """One collector's writer process: claim slots, commit groups under their leases."""
    store = Store(url, lock_timeout_s=120)
    cid = store.slots.register(run_id="run", host=name)
    tasks = [(f"t{i}", task_rank(f"t{i}", 0)) for i in range(N_TASKS)]
    template = make_group("x", n_episodes=GROUP_SIZE, n_turns=turns, tokens_per_turn=tokens)
    ready.put(name)
    start.wait()
    t0, cpu0 = time.perf_counter(), time.process_time()
    done = 0
    while time.perf_counter() - t0 < seconds:
        leases = store.slots.claim(run_id="run", collector_id=cid, tasks=tasks, ttl_s=600, n=batch)
        groups = [
            replace(template, group_id=x.group_id, task_id=x.task_id, collector_id=cid,
                    slot_lease=x.lease,
                    episodes=tuple(replace(e, episode_id=uuid.uuid4().hex)
                                   for e in template.episodes))
            for x in leases
        ]  # fmt: skip
        report = store.write_groups_report(groups)
        assert report.n_stored == len(groups), report.rejected
        done += len(groups) * GROUP_SIZE
    out.put((name, done, time.perf_counter() - t0, time.process_time() - cpu0))
    measured.wait(timeout=300)  # keep our server backend alive until its CPU is read
    store.close()


def run_writers(url: str, n: int, args, *, postmaster: int | None, probe=None) -> dict:
    """``n`` writer processes for ``args.seconds``; their throughput and where the CPU went.

    ``probe()`` (a claim, returning ms) runs in this process meanwhile, every 50 ms."""
    ctx = mp.get_context("spawn")
    ready, out, start, measured = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [
        ctx.Process(target=_writer, args=(url, f"w{n}-{i}", args.seconds, args.batch,
                                          args.turns, args.tokens, ready, start, out,
                                          measured))
        for i in range(n)
    ]  # fmt: skip
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    server0, (busy0, total0) = server_cpu_s(postmaster), machine_cpu()
    start.set()
    latencies: list[float] = []
    t0 = time.perf_counter()
    while probe is not None and time.perf_counter() - t0 < args.seconds * 0.9:
        latencies.append(probe())
        time.sleep(0.05)
    results = [out.get(timeout=args.seconds + 300) for _ in procs]
    server1, (busy1, total1) = server_cpu_s(postmaster), machine_cpu()
    measured.set()
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(timeout=60)
    trajectories = sum(done for _, done, _, _ in results)
    return {
        "traj_per_s": sum(done / s for _, done, s, _ in results),
        "latencies_ms": latencies,
        # per 1,000 trajectories: what one writer's work costs the clients and the server
        "client_cpu_s_per_1k_traj": 1000 * sum(c for *_, c in results) / max(trajectories, 1),
        "server_cpu_s_per_1k_traj": 1000 * (server1 - server0) / max(trajectories, 1),
        # of the whole machine (other users included), during this phase
        "machine_busy_cores": os.cpu_count() * (busy1 - busy0) / max(total1 - total0, 1.0),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=None, help="a PostgreSQL URL (default: start a private one)")
    ap.add_argument("--fsync-off", action="store_true",
                    help="private server with fsync off (the test fixture's setting)")  # fmt: skip
    ap.add_argument("--seconds", type=float, default=8.0, help="per phase")
    ap.add_argument("--rounds", type=int, default=3, help="alternating 1- and 4-writer phases")
    ap.add_argument("--batch", type=int, default=16, help="groups per commit")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=200, help="tokens per turn")
    ap.add_argument("--json", action="store_true", help="print one JSON object as last line")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        postmaster = None
        if args.url:
            url = args.url
        else:
            url, postmaster = stack.enter_context(private_postgres(fsync=not args.fsync_off))
        store = Store(url)
        store.init()
        store.ensure_run(RunRecord("run", "{}", "bench"))
        store.policy_versions.register(PolicyRecord("run", 0, "none", None, None))
        prober = store.slots.register(run_id="run", host="probe")
        tasks = [(f"t{i}", task_rank(f"t{i}", 0)) for i in range(N_TASKS)]

        def slot_claim() -> float:
            t0 = time.perf_counter()
            store.slots.claim(run_id="run", collector_id=prober, tasks=tasks, ttl_s=600)
            return (time.perf_counter() - t0) * 1000

        learner_ms: list[float] = []

        def both() -> float:
            ms = slot_claim()
            t0 = time.perf_counter()
            store.claims.claim(run_id="run", learner_id=uuid.uuid4().hex, n_groups=4, max_lag=100)
            learner_ms.append((time.perf_counter() - t0) * 1000)
            return ms

        # 1 and 4 writers alternate, round after round: on a shared machine both then see
        # the same background load, and the ratio is taken over the sums
        phases: dict[int, list[dict]] = {1: [], 4: []}
        for _ in range(args.rounds):
            phases[1].append(run_writers(url, 1, args, postmaster=postmaster))
            phases[4].append(run_writers(url, 4, args, postmaster=postmaster, probe=both))
        store.close()
    one, four = _combine(phases[1]), _combine(phases[4])
    result = {
        "seconds": args.seconds, "rounds": args.rounds, "batch_groups": args.batch,
        "group_size": GROUP_SIZE, "turns": args.turns, "tokens_per_turn": args.tokens,
        "cpu_count": os.cpu_count(),
        "server": "given" if args.url else ("fsync off" if args.fsync_off else "defaults"),
        "traj_per_s_1_writer": round(one["traj_per_s"], 1),
        "traj_per_s_4_writers": round(four["traj_per_s"], 1),
        "pg_writer_scaling": round(four["traj_per_s"] / one["traj_per_s"], 2),
        "pg_writer_scaling_by_round": [
            round(f["traj_per_s"] / o["traj_per_s"], 2) for o, f in zip(phases[1], phases[4], strict=True)
        ],
        "claim_ms_p50_under_write": round(statistics.median(four["latencies_ms"]), 1),
        "claim_ms_p90_under_write": round(_quantile(four["latencies_ms"], 0.9), 1),
        "learner_claim_ms_p50_under_write": round(statistics.median(learner_ms), 1),
        "claims": len(four["latencies_ms"]),
        "load_avg_1m_before": round(load_before, 2),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
    }  # fmt: skip
    for label, phase in (("1_writer", one), ("4_writers", four)):
        for key in ("client_cpu_s_per_1k_traj", "server_cpu_s_per_1k_traj", "machine_busy_cores"):
            value = phase[key]  # NaN: the server is not ours to measure (--url)
            result[f"{key}_{label}"] = None if value != value else round(value, 3)
    for key, value in result.items():
        goal = f"  (goal {GOALS[key]})" if key in GOALS else ""
        print(f"{key}: {value}{goal}")
    if args.json:
        print(json.dumps(result))


def _combine(runs: list[dict]) -> dict:
    """Phases of several rounds as one: mean rate and CPU figures, all latencies."""
    out = {k: statistics.fmean(r[k] for r in runs) for k in runs[0] if k != "latencies_ms"}
    out["latencies_ms"] = [x for r in runs for x in r["latencies_ms"]]
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


if __name__ == "__main__":
    main()
