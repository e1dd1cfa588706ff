"""Where each side's CPU-seconds went during its training budget (issue 47, item 5).

The machine offers ``cores x wall seconds`` of CPU; each side's share goes to

- ``generation``: Sandpiper's vLLM server process tree; TRL's generation phase (rollouts with
  their tool calls and scoring, colocated vLLM in the trainer's process);
- ``training``: Sandpiper's learner process tree; TRL's training phase of each step;
- ``tools``: the sandbox containers (their cgroups' CPU usage) and the podman client
  processes that run each call;
- ``other``: the rest of the side's processes (Sandpiper's collector; TRL's start-up,
  checkpoint saves and everything outside a step);
- ``idle``: ``cores x wall`` less everything measured (nothing of the side ran on it).

:class:`CpuSampler` reads the side's process tree (``psutil``: each process's own user +
system seconds, threads included, and the seconds of its children it has reaped, so short
podman clients that start and end between two samples are not lost) and the sandbox
containers labelled with the run's name (``podman ps`` / ``podman inspect`` for the cgroup,
then its ``cpu.stat`` ``usage_usec`` on cgroup v2, ``cpuacct.usage`` on v1) in a thread,
once a second, until :meth:`CpuSampler.stop`. The sampler's own podman calls are children
of the bench process, outside the sampled tree.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("generation", "training", "tools", "other")
CGROUP_ROOT = Path("/sys/fs/cgroup")
TOOL_PROGRAMS = ("podman", "conmon", "crun", "runc", "catatonit")
"""Processes that run a sandbox call: counted as ``tools`` wherever they hang."""


def _is_tool(cmdline: str) -> bool:
    return Path(cmdline.split(" ", 1)[0]).name in TOOL_PROGRAMS


def sandpiper_role(chain: list[str]) -> str | None:
    """The role of a process of Sandpiper's side from its cmdlines, itself first, then its
    parents up to the child of the bench (``sandpiper collect`` or ``sandpiper learn``);
    None for anything else the bench started (the sampler's own podman calls)."""
    top = f" {chain[-1]} "
    if " learn " in top:
        return "training"
    if " collect " not in top:
        return None
    if any(_is_tool(c) for c in chain[:-1]):
        return "tools"
    if any("vllm" in c for c in chain[:-1]):
        return "generation"
    return "other"


def trl_role(chain: list[str]) -> str | None:
    """TRL's side: its one process (``race_trl.py``, split by phase afterwards, see
    :func:`trl_split`) and what it starts (podman calls: ``tools``)."""
    if "race_trl.py" not in chain[-1]:
        return None
    return "tools" if any(_is_tool(c) for c in chain[:-1]) else "other"


@dataclass
class _Seen:
    """One process of the side, as last sampled."""

    role: str
    parent: int
    own_s: float = 0.0
    """Its own user + system seconds (all its threads)."""
    reaped_s: float = 0.0
    """Seconds of its descendants it has reaped (they ended; the kernel adds them here)."""
    alive: bool = True


@dataclass
class _Container:
    """One sandbox container of the side."""

    cgroup: str
    """Its cgroup path (``podman inspect``'s ``State.CgroupPath``; empty when not given)."""
    before_s: float = 0.0
    """Its usage when the side started, if it was there then (else 0)."""
    used_s: float = 0.0
    """Seconds used since, as last read."""
    read: bool = False
    """Whether its cgroup was ever read."""


@dataclass
class CpuSampler:
    """CPU seconds of ``root_pid``'s descendants by role, and of the run's containers."""

    root_pid: int
    """The sampled tree's root, not itself sampled (the bench process)."""
    role_of: Callable[[list[str]], str | None]
    """A process's role from its cmdline and its parents' (None: not the side's)."""
    run_label: str | None = None
    """``sandpiper.run`` label of the side's sandbox containers (None: no containers)."""
    interval_s: float = 1.0
    container_every: int = 3
    """Container samples are every this many process samples (podman calls cost CPU)."""
    budget_s: float | None = None
    """Sample until this many seconds after :meth:`start` (the side's training budget),
    then keep the figures as they were (what runs after the budget is not the race's)."""
    _seen: dict[tuple[int, float], _Seen] = field(default_factory=dict)
    _ignored: set[tuple[int, float]] = field(default_factory=set)
    _containers: dict[str, _Container] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _t0: float = 0.0
    _wall_s: float = 0.0

    def start(self) -> CpuSampler:
        self._t0 = time.time()
        self._sample_containers(baseline=True)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        """Stop sampling (one last sample first, unless the budget ended it) and return the
        CPU seconds by role."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self._expired():
            self._finish()
        return self.cpu_s()

    def _expired(self) -> bool:
        return self.budget_s is not None and time.time() - self._t0 >= self.budget_s

    def _finish(self) -> None:
        self._sample_processes()
        self._sample_containers()
        self._wall_s = time.time() - self._t0

    def _loop(self) -> None:
        i = 0
        while not self._stop.wait(self.interval_s):
            if self._expired():
                self._finish()
                return
            self._sample_processes()
            i += 1
            if i % self.container_every == 0:
                self._sample_containers()

    def _sample_processes(self) -> None:
        import psutil

        try:
            procs = psutil.Process(self.root_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        info: dict[int, tuple[float, int, str]] = {}
        times: dict[int, Any] = {}
        for p in procs:
            try:
                with p.oneshot():
                    info[p.pid] = (p.create_time(), p.ppid(), " ".join(p.cmdline()))
                    times[p.pid] = p.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        for pid, t in times.items():
            key = (pid, info[pid][0])
            if key in self._ignored:
                continue
            seen = self._seen.get(key)
            if seen is None:
                role = self.role_of(_chain(pid, info, self.root_pid))
                if role is None:
                    self._ignored.add(key)
                    continue
                seen = self._seen[key] = _Seen(role, parent=info[pid][1])
            seen.own_s = t.user + t.system
            seen.reaped_s = t.children_user + t.children_system
        live = {(pid, v[0]) for pid, v in info.items()}
        for key, seen in self._seen.items():
            seen.alive = key in live

    def _sample_containers(self, baseline: bool = False) -> None:
        if self.run_label is None:
            return
        for cid in _podman_lines("ps", "-a", "-q", "--no-trunc", "--filter",
                                 f"label=sandpiper.run={self.run_label}"):  # fmt: skip
            entry = self._containers.get(cid)
            if entry is None:
                paths = _podman_lines("inspect", "--format", "{{.State.CgroupPath}}", cid)
                path = paths[0] if paths else ""
                before = cgroup_usage_s(path) if baseline and path else None
                # a container there before the side started counts from then, a new one from 0
                entry = self._containers[cid] = _Container(path, before_s=before or 0.0)
            usage = cgroup_usage_s(entry.cgroup) if entry.cgroup else None
            if usage is not None:
                entry.used_s, entry.read = max(entry.used_s, usage - entry.before_s), True

    def cpu_s(self) -> dict[str, Any]:
        """CPU seconds by role; the process tree's and the containers' totals apart.

        Every sampled process counts its own seconds as last seen. It also counts what it
        reaped beyond the sampled children that ended under it (short-lived ones no sample
        saw, and the last second of those it did), at its role; the collector's reaped
        children are its podman calls (``tools``)."""
        by_role = dict.fromkeys(ROLES, 0.0)
        ended_under: dict[int, float] = {}
        for seen in self._seen.values():
            if not seen.alive:
                total = seen.own_s + seen.reaped_s
                ended_under[seen.parent] = ended_under.get(seen.parent, 0.0) + total
        for (pid, _), seen in self._seen.items():
            by_role[seen.role] += seen.own_s
            unseen = max(seen.reaped_s - ended_under.get(pid, 0.0), 0.0)
            by_role["tools" if seen.role == "other" else seen.role] += unseen
        containers_s = sum(c.used_s for c in self._containers.values())
        processes_s = sum(by_role.values())
        by_role["tools"] += containers_s
        return {"by_role_s": by_role, "processes_s": processes_s, "containers_s": containers_s,
                "containers": len(self._containers),
                "containers_unread": sum(not c.read for c in self._containers.values()),
                "wall_s": self._wall_s}  # fmt: skip


def _chain(pid: int, info: dict[int, tuple[float, int, str]], root: int) -> list[str]:
    """Cmdlines from ``pid`` up to the child of ``root``."""
    chain = []
    while pid in info:
        _, ppid, cmdline = info[pid]
        chain.append(cmdline)
        if ppid == root:
            break
        pid = ppid
    return chain or [""]


def _podman_lines(*args: str) -> list[str]:
    try:
        done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def cgroup_usage_s(cgroup_path: str, root: Path = CGROUP_ROOT) -> float | None:
    """CPU seconds a container's cgroup has used: cgroup v2 ``cpu.stat`` ``usage_usec``, or
    cgroup v1 ``cpuacct.usage`` (nanoseconds); None when neither can be read."""
    rel = cgroup_path.lstrip("/")
    stat = root / rel / "cpu.stat"
    if stat.is_file():
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
    for controller in ("cpuacct", "cpu,cpuacct"):
        usage = root / controller / rel / "cpuacct.usage"
        if usage.is_file():
            return int(usage.read_text().strip()) / 1e9
    return None


def process_cpu_s() -> float:
    """This process's own CPU seconds (user + system, all threads; not its children, whose
    seconds the sampler counts as ``tools``)."""
    t = os.times()
    return t.user + t.system


def shares(by_role_s: dict[str, float], *, cores: int, wall_s: float) -> dict[str, Any]:
    """The CPU-seconds profile: seconds and share of ``cores x wall_s`` per role, ``idle``
    the rest (never below 0: a side cannot use more than the machine)."""
    capacity = cores * wall_s
    seconds = {role: by_role_s.get(role, 0.0) for role in ROLES}
    seconds["idle"] = max(capacity - sum(seconds.values()), 0.0)
    return {"cores": cores, "wall_s": wall_s, "capacity_cpu_s": capacity, "cpu_s": seconds,
            "share": {k: v / capacity if capacity else float("nan") for k, v in seconds.items()}}  # fmt: skip


def trl_split(total: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, float]:
    """TRL's CPU seconds by role: its process tree's seconds split by the step log's phase
    CPU times (``generate_cpu_s``, ``train_cpu_s``: the process's CPU time taken at each
    phase's boundaries); the rest of the tree is ``other``; containers are ``tools``."""
    by_role = total["by_role_s"]
    generation = sum(s.get("generate_cpu_s", 0.0) for s in steps)
    training = sum(s.get("train_cpu_s", 0.0) for s in steps)
    tree_s = by_role["other"] + by_role["generation"] + by_role["training"]
    return {"generation": generation, "training": training, "tools": by_role["tools"],
            "other": max(tree_s - generation - training, 0.0)}  # fmt: skip


def summary_line(side: str, profile: dict[str, Any]) -> str:
    """One printed line: each role's share of the side's cores x wall seconds."""
    parts = ", ".join(f"{k} {v:.0%}" for k, v in profile["share"].items())
    return f"{side}: CPU of {profile['cores']} cores x {profile['wall_s']:.0f} s: {parts}"
