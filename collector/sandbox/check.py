"""Prove on this host that every sandbox limit is enforced (``sandpiper sandbox check``).

Each check runs an attack or probe in a real sandbox container and looks at the outcome:
user namespace (container root is not host root), no network, no capabilities and
no-new-privileges, read-only root (nothing writable outside /workspace, /tmp, /dev/shm,
/grade, /tests and /logs, the last three root-owned),
workspace size limit, memory limit (a hog is OOM-killed), pids limit (a fork bomb is held),
CPU limit (measured), an init that survives ``kill -9 -1``; and the reward's protections:
agent commands run as an unprivileged uid with no capabilities, the agent cannot trace,
signal or borrow descriptors of the supervisor, and grading runs as another uid with
nothing of the agent left (processes, user site, environment); and the host's: no container
log kept on the host, SysV IPC capped and removed with its processes.

A passing result is cached per (image, limits, podman, kernel) in
``~/.cache/sandpiper/sandbox-check-<key>.json``; :func:`ensure_limits_enforced` (called by
``SandboxPool.start``) runs the checks when no passing result is cached and refuses to go on
when one fails, unless ``allow_unenforced_limits`` is set.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from sandpiper.collector.sandbox.base import ExecOutcome
from sandpiper.collector.sandbox.client import PodmanSandbox
from sandpiper.collector.sandbox.containers import EXPIRES_LABEL, PURPOSE_LABEL, run_podman
from sandpiper.collector.sandbox.uids import UidSlots
from sandpiper.config import SandboxConfig
from sandpiper.errors import SandboxError, SandboxLimitsNotEnforced

log = logging.getLogger(__name__)
CACHE_DIR = Path.home() / ".cache" / "sandpiper"
"""Where passing checks are cached without a ``sandbox.host_state_dir`` (:func:`cache_dir`)."""
CHECK_DEADLINE_S = 600.0
"""A check run stops after this long (all checks take 10-20 s); its container is labelled to
expire then, so the janitor removes it if the check was killed (``janitor.judge``)."""
CHECKOUT = Path(__file__).resolve().parents[2]
"""The project's folder on the host, which no sandbox may see."""


@dataclass(frozen=True)
class CheckResult:
    """One limit and whether this host enforces it."""

    name: str
    passed: bool
    detail: str


Check = Callable[[PodmanSandbox, SandboxConfig], Awaitable[CheckResult]]


async def _user_namespace(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    r = await box.exec("cat /proc/self/uid_map", timeout_s=10)
    fields = r.stdout.split()
    host_uid = int(fields[1]) if len(fields) >= 3 and fields[0] == "0" else 0
    return CheckResult("user_namespace", host_uid != 0, f"container root = host uid {host_uid}")


async def _network(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    probe = (
        "import socket\n"
        "s = socket.socket(); s.settimeout(3)\n"
        "try:\n    s.connect(('1.1.1.1', 80)); print('connected')\n"
        "except OSError as e:\n    print('blocked', e)\n"
    )
    await box.write_file("/tmp/.netprobe.py", probe.encode())
    r = await box.exec("python3 /tmp/.netprobe.py; ls /sys/class/net", timeout_s=15)
    ifaces = set(r.stdout.split()[-3:]) & {"eth0", "tap0", "ens3", "enp0s3"}
    passed = "blocked" in r.stdout and "connected" not in r.stdout and not ifaces
    return CheckResult("network_none", passed, r.stdout.strip().replace("\n", " ")[:200])


async def _privileges(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    r = await box.exec("grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status", timeout_s=10)
    status = dict(line.split(":\t") for line in r.stdout.strip().splitlines() if ":\t" in line)
    passed = (
        int(status.get("CapEff", "1"), 16) == 0
        and int(status.get("CapBnd", "1"), 16) == 0
        and status.get("NoNewPrivs", "0").strip() == "1"
    )
    return CheckResult("capabilities_dropped", passed, " ".join(r.stdout.split()))


async def _read_only(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    targets = ["/", "/etc", "/usr", "/root", "/var", "/home", "/bin", "/opt", "/.sandpiper"]
    script = "".join(f"touch {t}/.probe 2>/dev/null && echo writable:{t}\n" for t in targets)
    script += "touch /workspace/.probe && echo ok:/workspace\n"
    r = await box.exec(script, timeout_s=10)
    passed = "writable:" not in r.stdout and "ok:/workspace" in r.stdout
    return CheckResult("read_only_root", passed, r.stdout.strip().replace("\n", " ") or "-")


async def _workspace_size(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    over_mb = config.workspace_size_mb + 16
    r = await box.exec(
        f"head -c {over_mb}M /dev/zero > /workspace/.fill; echo rc=$?; "
        "du -m /workspace/.fill | cut -f1; rm -f /workspace/.fill",
        timeout_s=60,
    )
    lines = r.stdout.split()
    written = int(lines[-1]) if lines and lines[-1].isdigit() else -1
    passed = "rc=0" not in r.stdout and 0 <= written <= config.workspace_size_mb
    return CheckResult("workspace_size", passed, f"wrote {written} MiB of {over_mb} asked")


async def _memory(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    hog_mb = config.memory_mb * 2
    r = await box.exec(
        f"python3 -c 'b = bytearray({hog_mb} * 1024 * 1024); print(len(b))'", timeout_s=60
    )
    passed = r.outcome is ExecOutcome.OOM_KILLED
    return CheckResult("memory_limit", passed, f"{hog_mb} MiB hog → {r.outcome} ({r.exit_code})")


async def _pids(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    # python's fork fails at once at the limit (bash's fork retries with back-off for long)
    n = config.pids_limit + 64
    probe = (
        "import os, time\n"
        "made = 0\n"
        f"for _ in range({n}):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        time.sleep(30); os._exit(0)\n"
        "    made += 1\n"
        "print(made, len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
    )
    await box.write_file("/tmp/.pidsprobe.py", probe.encode())
    started = time.monotonic()
    r = await box.exec("python3 /tmp/.pidsprobe.py", timeout_s=30)
    host_ms = (time.monotonic() - started) * 1000
    await box.kill_all()
    fields = r.stdout.split()
    made, count = (int(fields[0]), int(fields[1])) if len(fields) == 2 else (-1, -1)
    passed = 0 < made < n and count <= config.pids_limit
    detail = (
        f"fork bomb made {made} of {n} processes, {count} in the container "
        f"(limit {config.pids_limit}); {host_ms:.0f} ms"
    )
    return CheckResult("pids_limit", passed, detail)


async def _cpu(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    workers = (os.cpu_count() or 1) + 1
    if config.cpus >= (os.cpu_count() or 1):
        return CheckResult("cpu_limit", True, f"cpus={config.cpus} ≥ host cores: not measurable")
    probe = (
        "import os, time\n"
        f"for _ in range({workers}):\n"
        "    if os.fork() == 0:\n"
        "        end = time.time() + 2.0\n"
        "        while time.time() < end: pass\n"
        "        os._exit(0)\n"
        "t = time.time()\n"
        f"for _ in range({workers}): os.wait()\n"
        "c = os.times()\n"
        "print((c.children_user + c.children_system) / (time.time() - t))\n"
    )
    await box.write_file("/tmp/.cpuprobe.py", probe.encode())
    r = await box.exec("python3 /tmp/.cpuprobe.py", timeout_s=30)
    try:
        used = float(r.stdout.split()[-1])
    except (ValueError, IndexError):
        return CheckResult("cpu_limit", False, f"probe failed: {r.stderr[-200:]}")
    passed = used <= config.cpus * 1.25
    return CheckResult("cpu_limit", passed, f"{used:.2f} cores used, limit {config.cpus}")


async def _init_survives(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    await box.exec("kill -9 -1", timeout_s=10)
    r = await box.exec("echo alive; cat /proc/1/comm", timeout_s=10)
    passed = r.outcome is ExecOutcome.OK and "alive" in r.stdout and "catatonit" in r.stdout
    return CheckResult("init_survives_kill_all", passed, " ".join(r.stdout.split()))


async def _uid_separation(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    r = await box.exec("id -u; grep -E '^(CapPrm|CapEff)' /proc/self/status", timeout_s=10)
    lines = r.stdout.split()
    passed = bool(lines) and lines[0] not in ("0", "") and r.stdout.count("0000000000000000") == 2
    return CheckResult("agent_uid_unprivileged", passed, " ".join(lines)[:200])


_TAKEOVER = """
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
me = os.getuid()
for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
    try:
        uid = int(open(f"/proc/{pid}/status").read().split("Uid:")[1].split()[0])
    except (OSError, IndexError):
        continue
    if uid == me:
        continue
    pidfd = libc.syscall(434, pid, 0)  # pidfd_open
    print("getfd", "ok" if libc.syscall(438, pidfd, 1, 0) >= 0 else "refused")  # pidfd_getfd
    print("ptrace", "ok" if libc.ptrace(16, pid, 0, 0) == 0 else "refused")  # PTRACE_ATTACH
    try:
        os.kill(pid, signal.SIGSTOP); print("signal ok")
    except OSError:
        print("signal refused")
    try:
        os.listdir(f"/proc/{pid}/fd"); print("fds ok")
    except OSError:
        print("fds refused")
"""


async def _supervisor_untouchable(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    await box.write_file("/tmp/.takeover.py", _TAKEOVER.encode())
    r = await box.exec("python3 /tmp/.takeover.py", timeout_s=20)
    alive = (await box.exec("echo alive", timeout_s=10)).stdout.strip() == "alive"
    passed = r.ok and "refused" in r.stdout and " ok" not in r.stdout and alive
    return CheckResult(
        "supervisor_untouchable", passed, " ".join(sorted(set(r.stdout.split("\n"))))[:200]
    )


async def _host_paths_hidden(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    """No mount in the sandbox names the project's folder on the host (the supervisor and
    grader are mounted from copies: ``isolation.mounted_files``)."""
    r = await box.exec("cat /proc/self/mountinfo", timeout_s=10)
    leaked = str(CHECKOUT) in r.stdout
    detail = f"{CHECKOUT} visible in /proc/self/mountinfo" if leaked else "no host checkout path"
    return CheckResult("host_paths_hidden", r.ok and not leaked, detail)


async def _grading_isolation(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    from sandpiper.collector.sandbox.base import GradeRequest

    site = "/tmp/.local/lib/python3.11/site-packages"
    await box.exec(
        f"mkdir -p {site}; echo 'print(\"HIJACKED\")' > {site}/usercustomize.py; "
        "echo 'raise SystemExit(\"SHADOWED\")' > /workspace/json.py; export AGENT_MARK=1; "
        "(sleep 1000 &) ; sleep 1001 & kill -STOP $!; "
        "unshare -rpf sleep 1002 >/dev/null 2>&1 &",  # a pid namespace of its own
        timeout_s=10,
    )
    probe = (
        'cd "$WORKSPACE"; python3 - > "$SANDPIPER_RESULT_FILE" <<\'EOF\'\n'
        "import json, os\n"
        "agent = [p for p in os.listdir('/proc') if p.isdigit() and\n"
        "         open(f'/proc/{p}/status').read().split('Uid:')[1].split()[0] == '1000']\n"
        "print(json.dumps({'uid': os.getuid(), 'agent_processes': len(agent),\n"
        "                  'agent_env': 'AGENT_MARK' in os.environ, 'reward': 0}))\n"
        "EOF\n"
    )
    request = GradeRequest(answer=b"x", tests_dir=None, command=probe, timeout_s=20,
                           secret="check")  # fmt: skip
    graded = await box.grade(request)
    out = graded.exec.stdout + graded.exec.stderr
    try:
        seen = json.loads(graded.result_text or "")
    except ValueError:
        return CheckResult("grading_isolated", False, f"no result: {out[-200:]}")
    passed = (
        seen.get("uid") not in (0, 1000)
        and seen.get("agent_processes") == 0
        and seen.get("agent_env") is False
        and "HIJACKED" not in out
        and "SHADOWED" not in out
    )
    return CheckResult("grading_isolated", passed, f"{seen} {out.strip()[-100:]}")


async def _logs_off(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    """Nothing of the container's output is stored on the host (conmon's log file)."""
    kind = await run_podman("inspect", "--format", "{{.HostConfig.LogConfig.Type}}", box.name)
    r = await box.exec("echo probe > /proc/1/fd/1 2>&1 || echo refused", timeout_s=10)
    passed = kind.decode().strip() == "none" and "refused" in r.stdout
    detail = (
        f"log driver {kind.decode().strip()}; agent writing to init's stdout: {r.stdout.strip()}"
    )
    return CheckResult("container_logs_off", passed, detail[:200])


async def _socket_unreachable(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    """The supervisor's socket folder (``host_state.SOCKET_DIR``) cannot be entered by the
    agent, and its socket is gone once the host is connected."""
    from sandpiper.collector.sandbox.host_state import SOCKET_DIR, socket_dir

    r = await box.exec(f"ls -A {SOCKET_DIR} >/dev/null 2>&1 && echo listed || echo refused")
    left = sorted(p.name for p in socket_dir(box.name, config.host_state_dir).iterdir())
    passed = r.stdout.strip() == "refused" and not left
    return CheckResult("supervisor_socket_closed", passed, f"agent: {r.stdout.strip()}; {left}")


LAUNCHER_PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
bash = os.getppid()  # the command's bash; its parent starts the agent's commands
pid = int(open(f"/proc/{bash}/stat").read().rpartition(")")[2].split()[1])
status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status") if ":" in line)
print("uid", status["Uid"].split()[0], "capprm", status["CapPrm"].strip(),
      "capeff", status["CapEff"].strip())
print("title", open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")[0].decode())
pidfd = libc.syscall(434, pid, 0)  # pidfd_open
taken = [fd for fd in range(16) if libc.syscall(438, pidfd, fd, 0) >= 0]  # pidfd_getfd
print("getfd", "ok" if taken else "refused")
print("ptrace", "ok" if libc.ptrace(16, pid, 0, 0) == 0 else "refused")  # PTRACE_ATTACH
for name in ("fd", "environ", "mem", "maps"):
    try:
        os.listdir(f"/proc/{pid}/fd") if name == "fd" else open(f"/proc/{pid}/{name}", "rb").read(1)
        print(name, "ok")
    except OSError:
        print(name, "refused")
"""
"""What the agent can try on the process that starts its commands (the supervisor's
``Launcher``, a process of the agent's own uid): it must hold no capability and refuse
tracing, descriptor theft and memory reads (it is not dumpable)."""


async def _launcher_sealed(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    await box.write_file("/tmp/.launcher.py", LAUNCHER_PROBE.encode())
    r = await box.exec("python3 /tmp/.launcher.py", timeout_s=20)
    seen = " ".join(r.stdout.split())
    zero = "0000000000000000"
    passed = (
        r.ok
        and f"uid 1000 capprm {zero} capeff {zero}" in seen
        and "title sandpiper-launcher" in seen
        and " ok" not in seen
        and seen.count("refused") == 6
    )
    return CheckResult("launcher_sealed", passed, seen[:200])


async def _ipc_capped(box: PodmanSandbox, config: SandboxConfig) -> CheckResult:
    """SysV IPC cannot hold more memory than the container's sysctls allow, and a shared
    memory segment goes with its last process (nothing fills memory behind the agent)."""
    r = await box.exec(
        "cat /proc/sys/kernel/shm_rmid_forced; ipcmk -M 67108864 >/dev/null 2>&1 && echo big; "
        "ipcmk -M 4096 >/dev/null && echo small; ipcs -m | grep -c '^0x'",
        timeout_s=10,
    )
    lines = r.stdout.split()
    passed = lines[:1] == ["1"] and "big" not in lines and "small" in lines and lines[-1] == "0"
    return CheckResult("ipc_capped", passed, " ".join(lines)[:200])


CHECKS: list[Check] = [
    _user_namespace,
    _network,
    _privileges,
    _read_only,
    _workspace_size,
    _memory,
    _pids,
    _cpu,
    _uid_separation,
    _supervisor_untouchable,
    _host_paths_hidden,
    _socket_unreachable,
    _launcher_sealed,
    _grading_isolation,
    _logs_off,
    _ipc_capped,
    _init_survives,
]


async def run_checks(config: SandboxConfig) -> list[CheckResult]:
    """Start one sandbox and run every check in it (about 10–20 s; at most
    :data:`CHECK_DEADLINE_S`, the expiry its container is labelled with)."""
    slots = UidSlots.for_host(config)
    slot = slots.acquire()
    labels = {PURPOSE_LABEL: "check", EXPIRES_LABEL: str(int(time.time() + CHECK_DEADLINE_S))}
    box = await PodmanSandbox.create(config, labels=labels, uid_base=slots.base(slot))
    results = []
    try:
        async with asyncio.timeout(CHECK_DEADLINE_S - 30):  # the container's removal after
            for check in CHECKS:
                try:
                    results.append(await check(box, config))
                except (SandboxError, OSError, ValueError) as e:
                    results.append(CheckResult(check.__name__.lstrip("_"), False, f"error: {e}"))
                if not box.alive:
                    break
    except TimeoutError:
        results.append(CheckResult("deadline", False, f"checks ran past {CHECK_DEADLINE_S} s"))
    finally:
        await box.close()
        slots.release(slot)
    return results


def cache_dir(config: SandboxConfig) -> Path:
    """Where passing checks are cached: a property of the podman host, so under a
    ``sandbox.host_state_dir`` every collector container of that host shares them."""
    if config.host_state_dir is not None:
        return Path(config.host_state_dir) / "checks"
    return CACHE_DIR


async def _cache_key(config: SandboxConfig) -> str:
    image_id = (await run_podman("image", "inspect", "--format", "{{.Id}}", config.image)).strip()
    version = (await run_podman("version", "--format", "{{.Client.Version}}")).strip()
    limits = config.model_dump(
        include={"memory_mb", "cpus", "pids_limit", "workspace_size_mb", "rootless", "uid_base"}
    )
    blob = json.dumps(
        [
            image_id.decode(),
            version.decode(),
            platform.release(),
            limits,
            os.geteuid(),
            [c.__name__ for c in CHECKS],
        ]
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


async def ensure_limits_enforced(config: SandboxConfig) -> list[CheckResult]:
    """Run (or reuse cached) checks; raise :class:`SandboxLimitsNotEnforced` on a failure."""
    if not config.selfcheck:
        return []
    cache = cache_dir(config) / f"sandbox-check-{await _cache_key(config)}.json"
    if cache.exists():
        return [CheckResult(**r) for r in json.loads(cache.read_text())]
    results = await run_checks(config)
    failed = [r for r in results if not r.passed]
    if failed and not config.allow_unenforced_limits:
        names = ", ".join(f"{r.name} ({r.detail})" for r in failed)
        raise SandboxLimitsNotEnforced(
            f"this host does not enforce: {names}. Fix the host (see `sandpiper sandbox check`) "
            "or set sandbox.allow_unenforced_limits = true to run anyway."
        )
    if not failed:
        await save_passing(config, results)
    return results


async def save_passing(config: SandboxConfig, results: list[CheckResult]) -> None:
    """Cache an all-passing result so pools on this host skip the checks."""
    if results and all(r.passed for r in results):
        cache_dir(config).mkdir(parents=True, exist_ok=True)
        cache = cache_dir(config) / f"sandbox-check-{await _cache_key(config)}.json"
        cache.write_text(json.dumps([asdict(r) for r in results]))


if __name__ == "__main__":
    for result in asyncio.run(run_checks(SandboxConfig())):
        print(result)
