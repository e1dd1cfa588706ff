"""The host is protected from the sandbox (issue 14, deliverable 5), with real podman:

- nothing written to the container init's stdout is kept on the host (``--log-driver=none``):
  the agent cannot open it, and 50 MB pushed into it from the host side grow nothing;
- editor reads are bounded in the container: viewing or editing a 200 MB file (many lines,
  or one line), with any ``view_range``, grows the collector's peak memory by a few MB, not
  by the file's size, and a sparse 1 TB file is refused quickly.

Cost: two containers, ~400 MB written to a tmpfs, about 20–40 s on the shared CI machine.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandpiper.collector.episode.tools.editor import Editor, EditorError
from sandpiper.collector.sandbox.host_state import CGROUP_V1_ROOT, cgroup_parent
from tests.conftest import require

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MB = 1024 * 1024


def _inspect(name: str) -> dict:
    out = subprocess.run(["podman", "inspect", name], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]


def _du_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def test_container_output_is_not_kept_on_the_host(sandbox_pool):
    async def go():
        async with (
            sandbox_pool(pool_size=1) as pool,
            pool.session(episode_id="e", task_id="t") as box,
        ):
            info = _inspect(box.id)
            assert info["HostConfig"]["LogConfig"]["Type"] == "none"
            static_dir = info["StaticDir"]
            before = _du_bytes(static_dir)
            # as the agent would: refused (another uid's descriptors)
            r = await box.exec("head -c 50M /dev/zero > /proc/1/fd/1; echo rc=$?", timeout_s=30)
            assert "Permission denied" in r.stderr and "rc=1" in r.stdout, (r.stdout, r.stderr)
            # whatever reaches the init's stdout anyway (here: host root) is not stored
            line = b"x" * 99 + b"\n"
            with open(f"/proc/{info['State']['Pid']}/fd/1", "wb") as init_stdout:
                for _ in range(50 * MB // len(line)):
                    init_stdout.write(line)
            await asyncio.sleep(0.5)
            grown = _du_bytes(static_dir) - before
            assert grown < MB, f"the container's host folder grew by {grown} bytes"
            assert (await box.exec("echo alive")).stdout == "alive\n"

    asyncio.run(go())


def _reset_peak() -> int:
    """Reset this process's peak RSS (VmHWM) and return the current RSS, in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def test_editor_on_huge_files_keeps_host_memory_small(sandbox_pool):
    """Peak RSS growth of this (collector) process per editor call, against the 200 MB file."""
    grown: dict[str, int] = {}

    async def measured(name: str, call):
        base = _reset_peak()
        try:
            result = await call
        except EditorError as e:
            result = str(e)
        grown[name] = _status("VmHWM") - base
        return result

    async def go():
        async with (
            sandbox_pool(pool_size=1, workspace_size_mb=450, memory_mb=1024, selfcheck=False)
            as pool,
            pool.session(episode_id="e", task_id="t") as box,
        ):  # fmt: skip
            made = await box.exec(
                "yes 'a line of some text, repeated' | head -c 200M > /workspace/lines.txt && "
                "head -c 200M /dev/zero | tr '\\0' a > /workspace/oneline.txt && "
                "truncate -s 1T /workspace/sparse && wc -l /workspace/lines.txt",
                timeout_s=120,
            )
            assert made.ok, made.stderr
            n_lines = int(made.stdout.split()[0])
            editor = Editor(box)
            lines, one = "/workspace/lines.txt", "/workspace/oneline.txt"
            view = await measured("view", editor(command="view", path=lines))
            assert "<response clipped>" in view
            everything = await measured(
                "view_range_all", editor(command="view", path=lines, view_range=[1, -1])
            )
            assert "<response clipped>" in everything
            end = await measured(
                "view_range_end",
                editor(command="view", path=lines, view_range=[n_lines - 1, n_lines]),
            )
            assert f"{n_lines - 1}\ta line of some text" in end
            assert "<response clipped>" in await measured(
                "view_one_line", editor(command="view", path=one)
            )
            assert "<response clipped>" in await measured(
                "view_range_one_line", editor(command="view", path=one, view_range=[1, 1])
            )
            for name, call in [
                ("str_replace", editor(command="str_replace", path=lines, old_str="a", new_str="b")),
                ("insert", editor(command="insert", path=one, insert_line=1, new_str="b")),
            ]:  # fmt: skip
                assert "too large to edit" in await measured(name, call)
            started = time.monotonic()
            sparse = await measured(
                "view_range_sparse_1TB",
                editor(command="view", path="/workspace/sparse", view_range=[1, 2]),
            )
            assert "bytes to scan by line" in sparse and time.monotonic() - started < 30
            # control: the measure sees a read that does cross (the unbounded protocol call)
            assert len(await measured("control_unbounded_read", box.read_file(lines))) == 200 * MB
            assert (await box.exec("echo alive")).stdout == "alive\n"

    asyncio.run(go())
    control = grown.pop("control_unbounded_read")
    assert control > 200 * MB, f"the peak-RSS measure missed a 200 MB read ({control} bytes)"
    print(f"peak RSS growth per call (KiB), control {control // 1024}:",
          {k: v // 1024 for k, v in grown.items()})  # fmt: skip
    worst = max(grown, key=grown.__getitem__)
    # The file is 200 MB and the view shows 16 kB: a call that read the file whole would grow
    # the peak by 200 MB, as the control does. The bound is a tenth of that: the rest of the
    # worker (its event loop, pytest, the pool's own buffers) moves the peak too, by up to
    # 20 MB under a loaded full suite (a 16 MB bound failed there once at 19.4 MB).
    assert grown[worst] < 32 * MB, (worst, grown)


PROBE = """
import os, sys, time
names = sys.argv[2:]
def sandboxes():
    return sum(int(open(f"{sys.argv[1]}/{n}/cpuacct.usage").read()) for n in names) / 1e9
os.sched_setaffinity(0, {0})
s, c, t = sandboxes(), time.process_time(), time.monotonic() + 4.0
while time.monotonic() < t:
    pass
print(time.process_time() - c, sandboxes() - s)
"""


def _busy_host_process_against(names: list[str]) -> tuple[float, float]:
    """(CPU seconds of a busy host process on CPU 0 over 4 s, CPU seconds the containers
    ``names`` used in that same window), the window measured by the process itself from its
    cgroup counters (``cpuacct.usage``), not across its start-up."""
    root = str(CGROUP_V1_ROOT / "cpuacct")
    # a session of its own: with the kernel's autogroup scheduling, every process of one
    # session shares one weight (this test's session holds the other test workers)
    probe = subprocess.run([sys.executable, "-c", PROBE, root, *names], capture_output=True,
                           text=True, check=True, start_new_session=True)  # fmt: skip
    host, sandboxes = map(float, probe.stdout.split())
    return host, sandboxes


def test_busy_sandboxes_cannot_starve_the_host(sandbox_pool):
    """Four sandboxes burn CPU 0 (two busy loops each); a busy host process on CPU 0,
    standing for the collector that serves them, gets as much of it as the four together.
    Each sandbox weighs a quarter of a host process (``host_state.SANDBOX_CPU_SHARES``), so
    the process (1024) and the four (4 x 256) split the core evenly; at a host process's
    weight each, the process gets a fifth (ratio 0.25).

    Bound: the ratio is a property of CFS weights on one run queue, so everything competes
    on one core (on two, the sandboxes' loops would also fill the core the single-threaded
    process cannot use: ratio ~0.5 with the right weights, a coin toss against the bound).
    Other host processes on CPU 0 (a parallel test worker) take from both in proportion to
    their weights, so the ratio holds under any background load; the process and the
    sandboxes are measured in one window, by the process itself. (Earlier versions compared
    with a baseline taken a moment earlier, then across the process's start-up on two
    cores; parallel workers failed both, at 0.45 and 0.46.)"""
    require("cgroup v1 with root podman", cgroup_parent("probe", 0, None) is not None,
            "elsewhere sandboxes keep podman's own placement")  # fmt: skip

    async def go():
        async with sandbox_pool(pool_size=4) as pool:
            boxes = [await pool.acquire(episode_id=f"e{i}", task_id="t") for i in range(4)]
            burn = (
                "for i in 1 2; do timeout 8 taskset -c 0 sh -c 'while :; do :; done' & done;"
                " echo started"
            )
            for box in boxes:
                assert (await box.exec(burn, timeout_s=10)).stdout.strip() == "started"
            await asyncio.sleep(1)  # every burner running
            names = [box.name for box in boxes]
            host, sandboxes = await asyncio.to_thread(_busy_host_process_against, names)
            for box in boxes:
                await pool.release(box)
            return host, sandboxes

    host, sandboxes = asyncio.run(go())
    print(f"in 4 s a busy host process got {host:.2f} CPU-s, 4 busy sandboxes {sandboxes:.2f}")
    assert sandboxes > 0.5, f"the sandboxes did not burn ({sandboxes:.2f} CPU-s)"
    assert host > 0.5 * sandboxes, (
        f"a busy host process got {host:.2f} CPU-s against {sandboxes:.2f} of 4 busy sandboxes"
    )
