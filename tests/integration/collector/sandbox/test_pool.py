"""The podman pool and runtime on a real host: warm acquire, labels, files, watchdog, janitor."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandpiper.collector.sandbox.base import ExecOutcome
from sandpiper.collector.sandbox.client import PodmanSandbox
from sandpiper.collector.sandbox.containers import collector_id
from sandpiper.collector.sandbox.janitor import gc, list_containers, remove_containers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_warm_acquire_labels_and_reuse(sandbox_pool):
    async def go():
        async with sandbox_pool(pool_size=2) as pool:
            await pool.wait_warm()
            started = time.monotonic()
            box = await pool.acquire(episode_id="ep-1", task_id="task-1")
            assert (time.monotonic() - started) * 1000 < 50
            [info] = [c for c in await list_containers() if c.name == box.id]
            assert info.labels["sandpiper.run"] == "pytest-sandbox"
            assert info.labels["sandpiper.collector"] == collector_id()
            ls = subprocess.run([sys.executable, "-m", "sandpiper.cli", "sandbox", "ls"],
                                capture_output=True, text=True, check=True)  # fmt: skip
            assert box.id in ls.stdout and "ep-1" in ls.stdout and "task-1" in ls.stdout
            await box.exec("echo dirty > /workspace/x; export LEAK=1")
            await pool.release(box)
            await pool.wait_warm()
            again = [await pool.acquire(episode_id=f"ep-{i}", task_id="t") for i in (2, 3)]
            assert box.id in {b.id for b in again}
            for b in again:
                r = await b.exec("ls -A /workspace; echo ${LEAK-clean}")
                assert r.stdout == "clean\n"

    asyncio.run(go())


def test_broken_sandbox_is_replaced(sandbox_pool):
    async def go():
        async with sandbox_pool(pool_size=1) as pool:
            box = await pool.acquire(episode_id="e", task_id="t")
            await pool.release(box, broken=True)
            fresh = await pool.acquire(episode_id="e2", task_id="t")
            assert fresh.id != box.id
            names = {c.name for c in await list_containers()}
            assert box.id not in names and fresh.id in names

    asyncio.run(go())


def test_files_round_trip_byte_exact(sandbox_pool, tmp_path: Path):
    src = tmp_path / "src"
    hostile = ["it's", "$(touch PWNED)", "new\nline", "..dots..", "sp ace", "ünï"]
    for name in hostile:
        (src / name).mkdir(parents=True)
        (src / name / f"{name}.bin").write_bytes(os.urandom(1000) + name.encode())
    big = os.urandom(8 * 1024 * 1024)

    async def go():
        async with (
            sandbox_pool(pool_size=1) as pool,
            pool.session(episode_id="e", task_id="t") as b,
        ):
            await b.write_file("/workspace/big.bin", big)
            assert await b.read_file("/workspace/big.bin") == big
            r = await b.exec("sha256sum /workspace/big.bin")
            import hashlib

            assert r.stdout.split()[0] == hashlib.sha256(big).hexdigest()
            await b.copy_in(src, "/workspace/in")
            await b.copy_out("/workspace/in", tmp_path / "out")
            assert not (await b.exec("find / -name PWNED -not -path '/proc/*'")).stdout
            with pytest.raises(FileNotFoundError):
                await b.read_file("/workspace/missing")

    asyncio.run(go())
    for name in hostile:
        assert (tmp_path / "out" / name / f"{name}.bin").read_bytes() == (
            src / name / f"{name}.bin"
        ).read_bytes()


def test_watchdog_restarts_a_hung_shell(sandbox_pool, monkeypatch):
    import sandpiper.collector.sandbox.client as client

    monkeypatch.setattr(client, "WATCHDOG_GRACE_S", 2.0)

    async def go():
        async with (
            sandbox_pool(pool_size=1) as pool,
            pool.session(episode_id="e", task_id="t") as b,
        ):
            # the agent cannot freeze the shell (another uid) ...
            r = await b.exec("pkill -STOP -f 'supervis[o]r.py'; echo rc=$?", timeout_s=5)
            assert r.outcome is ExecOutcome.OK and "rc=0" not in r.stdout and b.restarts == 0
            # ... the host can: then only the host-side watchdog can get out of this
            pid = (await b.ping())["pid"]
            await client.run_podman("exec", b.name, "kill", "-STOP", str(pid))
            r = await b.exec("sleep 1", timeout_s=1)
            assert r.outcome is ExecOutcome.TIMED_OUT
            assert b.restarts == 1 and b.alive
            assert (await b.exec("echo back")).stdout == "back\n"

    asyncio.run(go())


def _remove_container(name: str) -> None:
    """Remove a container from outside, as a crashed host process would. podman 4.3 can
    answer 125 while the container's own exec sessions are still settling: retry briefly."""
    for _ in range(5):
        done = subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True)
        if done.returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"podman rm {name} failed: {done.stderr.decode()[-500:]}")


def test_removed_container_is_sandbox_lost_and_replaced(sandbox_pool):
    """The host removed the container: not the agent's doing, so ``sandbox_lost`` (infra)."""

    async def go():
        async with sandbox_pool(pool_size=1) as pool:
            box = await pool.acquire(episode_id="e", task_id="t")
            _remove_container(box.id)
            r = await box.exec("echo hi")
            assert r.outcome is ExecOutcome.SANDBOX_LOST and not box.alive and box.lost
            await pool.release(box)
            fresh = await pool.acquire(episode_id="e2", task_id="t")
            assert fresh.id != box.id and (await fresh.exec("echo ok")).ok

    asyncio.run(go())


def test_gc_judges_by_store_heartbeats_not_pids(sandbox_config, sandbox_image, tmp_path):
    """Removed: a registered collector that stopped, and a container of an unknown collector
    older than the grace period even though its "pid" is alive (pid reuse). Kept: a live
    collector's container (whatever PID namespace it runs in) and another store's."""
    from sandpiper.store import Store

    store = Store(f"duckdb:///{tmp_path / 'store.duckdb'}")
    store.init()
    dead = store.slots.register(run_id="run", host="elsewhere")
    live = store.slots.register(run_id="run", host="elsewhere")
    store.slots.stop(dead)
    run = f"gc-test-{os.getpid()}-{time.time_ns()}"  # gc is scoped to this test's containers
    sid = store.store_id()
    labels = {
        "dead": {"sandpiper.collector": dead, "sandpiper.store": sid},
        "live": {"sandpiper.collector": live, "sandpiper.store": sid},
        "other": {"sandpiper.collector": dead, "sandpiper.store": "another-store"},
        "reused_pid": {"sandpiper.collector": f"{os.uname().nodename}:{os.getpid()}"},
    }

    async def go():
        boxes = {}
        try:
            for i, (key, extra) in enumerate(labels.items()):
                uid_base = None if os.geteuid() else 1_000_000 + 65536 * (1000 + i)
                boxes[key] = await PodmanSandbox.create(
                    sandbox_config, labels={"sandpiper.run": run, **extra}, uid_base=uid_base
                )
                await boxes[key]._kill_shell()
            scope = {"sandpiper.run": run}
            opts = {"state_dir": None, "filters": scope}  # the default sandbox folders
            want = {boxes["dead"].id, boxes["reused_pid"].id}
            assert set(await gc(store, ttl_s=60, grace_s=0, dry_run=True, **opts)) == want
            assert set(await gc(store, ttl_s=60, grace_s=3600, **opts)) == {
                boxes["dead"].id  # a young unknown container is kept through the grace period
            }
            assert set(await gc(store, ttl_s=60, grace_s=0, **opts)) == {boxes["reused_pid"].id}
            left = {c.name for c in await list_containers(scope)}
            assert left == {boxes["live"].id, boxes["other"].id}
        finally:
            for box in boxes.values():
                await box.close()

    asyncio.run(go())
    store.close()


def test_check_command_proves_every_limit(sandbox_image, tmp_path):
    """Run from an empty folder, which it must leave empty: conmon wrote an ``oom`` marker
    into the podman client's working directory when the memory check's hog was killed."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[4])}
    proc = subprocess.run([sys.executable, "-m", "sandpiper.cli", "sandbox", "check"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == [], "sandbox check left files in its working directory"
    for name in ["user_namespace", "network_none", "capabilities_dropped", "read_only_root",
                 "workspace_size", "memory_limit", "pids_limit", "cpu_limit",
                 "init_survives_kill_all"]:  # fmt: skip
        assert f"ok   {name}" in proc.stdout, proc.stdout


def test_task_image_extends_the_base_and_is_cached(sandbox_config, sandbox_image, tmp_path):
    from sandpiper.collector.sandbox.image_build import extend_image, image_recipe_hash

    setup = tmp_path / "setup.sh"
    setup.write_text("echo extended > /etc/sandpiper-extended\n")
    tag = "localhost/sandpiper-test-task:1"
    try:
        assert extend_image(sandbox_config.image, setup, tag, network=False) == tag
        digest = image_recipe_hash(tag)
        assert digest and digest != image_recipe_hash(sandbox_config.image)
        extend_image(sandbox_config.image, setup, tag, network=False)  # cached: same image
        assert image_recipe_hash(tag) == digest
        out = subprocess.run(["podman", "run", "--rm", "--network=none", tag, "cat",
                              "/etc/sandpiper-extended"], capture_output=True, text=True)  # fmt: skip
        assert out.stdout == "extended\n"
    finally:
        subprocess.run(["podman", "rmi", "-f", tag], capture_output=True, check=False)


def test_cancelled_exec_does_not_desync_the_shell(sandbox_pool):
    async def go():
        async with (
            sandbox_pool(pool_size=1) as pool,
            pool.session(episode_id="e", task_id="t") as b,
        ):
            await b.exec("cd /tmp")
            slow = asyncio.create_task(b.exec("sleep 2; echo SLOW", timeout_s=10))
            await asyncio.sleep(0.5)
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            r = await b.exec("echo next; pgrep -c sleep || true")
            assert r.stdout == "next\n0\n" and b.restarts == 1

    asyncio.run(go())


def test_a_shell_whose_host_died_before_connecting_exits_at_once(sandbox_pool):
    """A collector killed between starting a sandbox's shell (``podman exec -i ... --listen``)
    and connecting to its socket: the shell sees its stdin close and exits, and with it the
    ``podman exec`` on the host, instead of waiting out the accept timeout (60 s; seen as a
    leftover ``podman exec`` in the kill -9 test of tests/integration/collector/daemon/test_shutdown.py)."""
    from sandpiper.collector.sandbox.client import SUPERVISOR_MAIN
    from sandpiper.collector.sandbox.supervisor.server import ACCEPT_TIMEOUT_S

    async def go():
        async with (
            sandbox_pool(pool_size=1) as pool,
            pool.session(episode_id="e", task_id="t") as box,
        ):
            argv = ["podman", "exec", "-i", box.name, "python3", "-I", SUPERVISOR_MAIN,
                    "--listen", "/.sandpiper/sock/second"]  # fmt: skip
            shell = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
            )
            assert shell.stdout is not None and shell.stdin is not None
            ready = await asyncio.wait_for(shell.stdout.readline(), 60)
            assert ready.startswith(b'{"ready"'), ready
            started = time.monotonic()
            shell.stdin.close()  # what the kernel does to the pipe of a killed collector
            try:
                code = await asyncio.wait_for(shell.wait(), ACCEPT_TIMEOUT_S / 4)
            finally:
                if shell.returncode is None:
                    shell.kill()
                    await shell.wait()
            assert code == 1 and time.monotonic() - started < ACCEPT_TIMEOUT_S / 4
            assert (await box.exec("echo alive")).stdout == "alive\n"  # the first shell serves

    asyncio.run(go())


_NAMESPACED_COLLECTOR = """
import os, socket, sys, time
from sandpiper.store import Store
store = Store(sys.argv[1])
cid = store.slots.register(run_id="run")  # host: this namespace's own host name
print(cid, socket.gethostname(), os.getpid(), flush=True)
while True:  # heartbeat until killed, as a running collector does
    time.sleep(0.5)
    store.slots.heartbeat(cid)
"""


def _free_host_pid() -> int:
    """A pid no process on this host has now."""
    return next(p for p in range(30000, 20000, -1) if not Path(f"/proc/{p}").exists())


@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --pid/--uts needs root")
def test_gc_keeps_a_live_collector_in_another_pid_namespace_and_host(
    sandbox_config, sandbox_image, tmp_path
):
    """A collector in its own PID and UTS namespace (a second host: its own host name, and a
    pid that names no process here) heartbeats into the store: `sandpiper sandbox gc` keeps
    its container. A collector of THIS host whose heartbeat lapsed is removed although the
    pid in its row is alive (this very process). ~10 s."""
    from sandpiper.store import Store

    url = f"duckdb:///{tmp_path / 'store.duckdb'}"
    store = Store(url)
    store.init()
    pid = _free_host_pid()
    # ns_last_pid makes the namespace's next pid `pid`: one that does not exist on this host
    # not exec'd: the collector is a child of the namespace's init (sh), so it gets `pid`
    inner = (f"hostname simulated-host-b && echo {pid - 1} > /proc/sys/kernel/ns_last_pid && "
             f'{sys.executable} -c "$COLLECTOR" {url}')  # fmt: skip
    repo = str(Path(__file__).resolve().parents[4])
    other_host = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--uts", "sh", "-c", inner],
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": repo, "COLLECTOR": _NAMESPACED_COLLECTOR},
    )  # fmt: skip
    run = f"gc-ns-test-{os.getpid()}-{time.time_ns()}"
    try:
        live, host, inner_pid = other_host.stdout.readline().split()
        assert host == "simulated-host-b" != os.uname().nodename
        assert int(inner_pid) == pid and not Path(f"/proc/{pid}").exists()
        # a collector of this host whose pid (ours) is alive, but whose heartbeat lapses
        lapsed = store.slots.register(run_id="run")
        assert [r.pid for r in store.slots.collectors("run") if r.collector_id == lapsed] == [
            os.getpid()
        ]
        sid = store.store_id()

        async def make(i: int, cid: str):
            uid_base = None if os.geteuid() else 1_000_000 + 65536 * (1100 + i)
            box = await PodmanSandbox.create(
                sandbox_config, uid_base=uid_base,
                labels={"sandpiper.run": run, "sandpiper.collector": cid, "sandpiper.store": sid},
            )  # fmt: skip
            await box._kill_shell()
            return box

        async def both():
            return await make(0, live), await make(1, lapsed)

        live_box, lapsed_box = asyncio.run(both())
        time.sleep(3)  # > the TTL below: only the namespaced collector heartbeats meanwhile
        gc_cli = subprocess.run(
            [sys.executable, "-m", "sandpiper.cli", "sandbox", "gc", "--store.url", url,
             "--collector.heartbeat_ttl_s", "2", "--collector.heartbeat_s", "1",
             "--grace-s", "1000000000"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert gc_cli.returncode == 0, gc_cli.stdout + gc_cli.stderr
        assert lapsed_box.id in gc_cli.stdout and live_box.id not in gc_cli.stdout
        left = {c.name for c in asyncio.run(list_containers({"sandpiper.run": run}))}
        assert left == {live_box.id}
    finally:
        other_host.kill()
        other_host.wait(timeout=30)
        asyncio.run(remove_containers({"sandpiper.run": run}, state_dir=None))
        store.close()


def test_each_sandbox_weighs_a_quarter_of_a_host_process_and_runs_static_bash(sandbox_pool):
    """Root podman on cgroup v1: each sandbox's processes are in a top-level cgroup of its
    own (``/<name>``) whose ``cpu.shares`` is ``SANDBOX_CPU_SHARES``, so N busy sandboxes
    cannot starve the collector's event loop that serves them (host_state says why)."""
    from sandpiper.collector.sandbox.host_state import CGROUP_V1_ROOT, SANDBOX_CPU_SHARES

    async def go():
        async with sandbox_pool(pool_size=1) as pool:
            box = await pool.acquire(episode_id="e", task_id="t")
            r = await box.exec('sleep 30 & echo $!; echo "$BASH"', timeout_s=10)
            pid, shell = r.stdout.split()
            shares = (CGROUP_V1_ROOT / "cpu" / box.id / "cpu.shares").read_text().strip()
            mine = [
                p.parent.name
                for p in (CGROUP_V1_ROOT / "cpu" / box.id).rglob("cgroup.procs")
                if p.read_text().split()
            ]
            await pool.release(box)
            return int(pid), shell, shares, mine

    pid, shell, shares, mine = asyncio.run(go())
    assert shell == "/usr/bin/bash-static"  # commands start in the static bash (supervisor/run.py)
    assert pid > 1 and shares == str(SANDBOX_CPU_SHARES) == "256"
    assert mine, "no process of the sandbox under its own cpu cgroup"
