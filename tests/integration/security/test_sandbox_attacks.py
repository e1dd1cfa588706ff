"""Attacks on real podman sandboxes: each is contained, the host stays responsive, the outcome
kind is right, and the next episode on the same container gets a clean sandbox.

The pool has one container, so ``release`` + ``acquire`` hands back the very container the
attack ran in (after its reset).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from sandpiper.collector.episode.tools import Toolbox
from sandpiper.collector.sandbox.base import ExecOutcome
from sandpiper.store.records import ToolErrorKind

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


async def _host_lag_probe(stop: asyncio.Event, lags_ms: list[float]) -> None:
    """Spawn /bin/true on the host every 100 ms and record how long it takes."""
    while not stop.is_set():
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec("true")
        await proc.wait()
        lags_ms.append((time.monotonic() - started) * 1000)
        await asyncio.sleep(0.1)


async def _attack(pool, command: str, timeout_s: float = 10):
    """Run ``command`` in an episode while probing the host; return (result, next sandbox)."""
    box = await pool.acquire(episode_id="attack", task_id="attack")
    stop, lags = asyncio.Event(), []
    probe = asyncio.create_task(_host_lag_probe(stop, lags))
    try:
        result = await box.exec(command, timeout_s=timeout_s)
    finally:
        stop.set()
        await probe
    assert max(lags) < 3000, f"host unresponsive during the attack: {max(lags):.0f} ms"
    await pool.release(box, broken=not box.alive)
    fresh = await pool.acquire(episode_id="next", task_id="next")
    return box, result, fresh


async def _assert_clean(box) -> None:
    r = await box.exec("ls -A /workspace /tmp; ps -eo comm= | sort | tr '\\n' ' '", timeout_s=10)
    assert r.ok, r
    assert r.stdout.split("\n")[0:2] == ["/tmp:", ""] or "/workspace:\n\n/tmp:\n" in r.stdout
    processes = set(r.stdout.strip().split("\n")[-1].split())
    assert processes <= {
        "catatonit",
        "python3",
        "timeout",
        "bash",
        "bash-static",
        "ps",
        "sort",
        "tr",
    }, processes


def test_fork_bomb_is_held(sandbox_pool):
    async def go():
        async with sandbox_pool(pool_size=1) as pool:
            _, r, fresh = await _attack(pool, ":(){ :|:& };:", timeout_s=5)
            assert r.outcome in (ExecOutcome.TIMED_OUT, ExecOutcome.OK)
            await _assert_clean(fresh)

    asyncio.run(go())


def test_memory_hog_is_oom_killed(sandbox_pool):
    async def go():
        async with sandbox_pool(pool_size=1) as pool:
            _, r, fresh = await _attack(pool, "python3 -c 'b = bytearray(2 << 30)'")
            assert r.outcome is ExecOutcome.OOM_KILLED and r.exit_code == 137
            await _assert_clean(fresh)

    asyncio.run(go())


def test_filling_the_workspace_hits_its_size_limit(sandbox_pool):
    async def go():
        async with sandbox_pool(pool_size=1) as pool:
            _, r, fresh = await _attack(pool, "head -c 500M /dev/zero > /workspace/fill")
            assert r.exit_code != 0 and "No space left on device" in r.stderr
            await _assert_clean(fresh)

    asyncio.run(go())


def test_one_gigabyte_of_output_is_capped_at_the_source(sandbox_pool):
    async def go():
        async with sandbox_pool(pool_size=1) as pool:
            _box, r, fresh = await _attack(pool, "head -c 1G /dev/zero | tr '\\0' y", timeout_s=120)
            assert r.outcome is ExecOutcome.OK and r.stdout_bytes_total == 1 << 30
            cap = pool.config.output_cap_bytes
            assert len(r.stdout) < cap + 100 and "bytes of output omitted" in r.stdout
            await _assert_clean(fresh)

    asyncio.run(go())


def test_infinite_loop_times_out(sandbox_pool):
    async def go():
        async with sandbox_pool(pool_size=1) as pool:
            box = await pool.acquire(episode_id="e", task_id="t")
            r = await box.exec("while :; do :; done", timeout_s=1.5)
            assert r.outcome is ExecOutcome.TIMED_OUT and r.exit_code is None
            assert 1400 < r.duration_ms < 5000
            assert (await box.exec("echo next")).stdout == "next\n"
            await pool.release(box)

    asyncio.run(go())


def test_kill_all_processes_leaves_init_and_a_working_shell(sandbox_pool):
    async def go():
        async with sandbox_pool(pool_size=1) as pool:
            box = await pool.acquire(episode_id="e", task_id="t")
            await box.exec("cd /tmp")
            r = await box.exec("kill -9 -1")
            assert r.outcome is ExecOutcome.OK and r.exit_code == 137
            after = await box.exec("pwd; cat /proc/1/comm")
            # the agent's uid cannot signal the supervisor: the shell and its state survive
            assert after.stdout == "/tmp\ncatatonit\n" and box.alive and box.restarts == 0
            await pool.release(box)
            fresh = await pool.acquire(episode_id="next", task_id="t")
            assert fresh.id == box.id
            await _assert_clean(fresh)

    asyncio.run(go())


def test_kill_all_is_reported_once_and_only_by_the_command_that_did_it(sandbox_pool):
    """No ``timeout(1)`` parent: the launcher, of the agent's uid, tells a ``kill -9 -1`` (builtin
    or ``/bin/kill``); the commands after it, a reset and a grade-time kill are not killed."""

    async def go():
        async with sandbox_pool(pool_size=1) as pool:
            box = await pool.acquire(episode_id="e", task_id="t")
            for command in ("kill -9 -1", "/bin/kill -9 -1", "sleep 100 & kill -9 -1; echo x"):
                assert (await box.exec(command)).exit_code == 137, command
                assert (await box.exec("true")).exit_code == 0
            await box.reset()
            assert [(await box.exec("true")).exit_code for _ in range(3)] == [0, 0, 0]
            await box.kill_all()
            assert (await box.exec("echo ok")).stdout == "ok\n"
            await pool.release(box)

    asyncio.run(go())


def test_the_launcher_is_the_agents_own_and_gives_it_nothing(sandbox_pool):
    """The process that starts the agent's commands has the agent's uid: the agent can stop
    or kill it (and only harms itself: the next command gets a new one, the shell never
    restarts), but it holds no capability and refuses tracing, descriptor theft and memory
    reads; a reset leaves no launcher behind."""
    from sandpiper.collector.sandbox.check import LAUNCHER_PROBE

    async def go():
        async with sandbox_pool(pool_size=1) as pool:
            box = await pool.acquire(episode_id="e", task_id="t")
            await box.write_file("/tmp/probe.py", LAUNCHER_PROBE.encode())
            seen = " ".join((await box.exec("python3 /tmp/probe.py", timeout_s=20)).stdout.split())
            zero = "0000000000000000"
            assert f"uid 1000 capprm {zero} capeff {zero}" in seen, seen
            assert "title sandpiper-launcher" in seen and " ok" not in seen, seen
            assert seen.count("refused") == 6, seen
            # aimed at "the supervisor" by name, the agent finds only the shell (another uid)
            r = await box.exec("pkill -STOP -f 'supervis[o]r.py'; echo rc=$?", timeout_s=5)
            assert r.outcome is ExecOutcome.OK and "rc=1" in r.stdout, r
            # stopped between commands: replaced before the next one
            r = await box.exec("(sleep 0.3; pkill -STOP -f sandpiper-launcher) >/dev/null 2>&1 &")
            assert r.ok
            await asyncio.sleep(1)
            started = time.monotonic()
            assert (await box.exec("echo ok", timeout_s=5)).stdout == "ok\n"
            assert time.monotonic() - started < 2
            # killed by the command: reported killed (137), the next command runs
            r = await box.exec("kill -9 $PPID; echo after")
            assert r.exit_code == 137 and r.stdout == "after\n", r
            assert (await box.exec("echo ok")).stdout == "ok\n" and box.restarts == 0
            await box.reset()
            r = await box.exec("ps -eo user=,args= | grep -c '[s]andpiper-launcher'")
            assert r.stdout.strip() == "1", r  # only the one that started this command
            await pool.release(box)

    asyncio.run(go())


def test_background_process_does_not_survive_the_episode(sandbox_pool):
    async def go():
        async with sandbox_pool(pool_size=1) as pool:
            _, r, fresh = await _attack(
                pool, "nohup sleep 1000 >/dev/null 2>&1 & setsid sleep 999 &"
            )
            assert r.ok
            await _assert_clean(fresh)

    asyncio.run(go())


def test_no_network(sandbox_pool):
    async def go():
        async with sandbox_pool(pool_size=1) as pool:
            _, r, fresh = await _attack(
                pool,
                "timeout 5 bash -c 'echo > /dev/tcp/1.1.1.1/80' && echo CONNECTED; "
                "python3 -c \"import socket; socket.create_connection(('10.0.2.2', 22), 3)\"",
            )
            assert "CONNECTED" not in r.stdout and "Network is unreachable" in r.stderr
            await _assert_clean(fresh)

    asyncio.run(go())


def test_tests_cannot_be_read_before_submit(sandbox_pool, tmp_path: Path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "run.sh").write_text(
        'echo \'{"reward": 1.0}\' > "$SANDPIPER_RESULT_FILE"  # SECRET-EXPECTED-OUTPUT\n'
    )

    async def go():
        async with (
            sandbox_pool(pool_size=1) as pool,
            pool.session(episode_id="e", task_id="t") as box,
        ):
            tools = Toolbox(box, tests_dir=tests, test_command=None, test_timeout_s=20,
                            exec_timeout_s=20)  # fmt: skip
            snoop = await tools.call(
                "execute_bash",
                {
                    "command": "grep -rs SECRET-EXPECTED / --exclude-dir=proc --exclude-dir=sys"
                    " | head -3; echo done"
                },
            )
            assert snoop.error_kind is ToolErrorKind.NONE and "run.sh" not in snoop.output
            # a planted watcher would try to rewrite the tests; submit kills it first
            await tools.call(
                "execute_bash",
                {
                    "command": "(while :; do echo 'echo "
                    '{\\"reward\\": 0.0}\' > /grade/tests/run.sh '
                    "2>/dev/null; sleep 0.01; done) >/dev/null 2>&1 &"
                },
            )
            result = await tools.call("submit", {"answer": "x"})
            assert result.submitted and result.test_reward == 1.0, result

    asyncio.run(go())


def test_the_supervisors_socket_cannot_be_reached_from_the_agent(sandbox_pool):
    """The shell is served over a Unix socket in a host folder mounted at
    ``/.sandpiper/sock``: an agent that could connect there would send the supervisor
    requests (run as root, write ``/grade``, grade itself). The folder is container root's
    with mode 0700, the socket file is unlinked once the host is connected, and the shell
    serves only a peer outside the container's pid namespace."""
    from sandpiper.collector.sandbox.host_state import SOCKET_DIR, socket_dir

    probe = (
        "import socket\n"
        f"for path in ('{SOCKET_DIR}/s', '{SOCKET_DIR}'):\n"
        "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "    try:\n"
        "        s.connect(path); print('connected', path)\n"
        "    except OSError as e:\n"
        "        print('refused', path, e.errno)\n"
    )

    async def go():
        async with sandbox_pool(pool_size=1) as pool:
            box = await pool.acquire(episode_id="e", task_id="t")
            r = await box.exec(
                f"ls -la {SOCKET_DIR}; echo rc=$?; find / -path /proc -prune -o -type s -print 2>/dev/null; "
                f'python3 -c "$PROBE"',
                env={"PROBE": probe},
            )
            assert "rc=2" in r.stdout and "Permission denied" in r.stderr, r
            assert "connected" not in r.stdout and r.stdout.count("refused") == 2, r
            assert "/.sandpiper" not in r.stdout.replace(f"refused {SOCKET_DIR}", ""), r
            # on the host the folder is empty: the socket was unlinked at connect
            assert list(socket_dir(box.id, None).iterdir()) == []
            assert (await box.exec("echo still served")).stdout == "still served\n"
            await pool.release(box)

    asyncio.run(go())
