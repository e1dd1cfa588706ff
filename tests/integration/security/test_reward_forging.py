"""Forged rewards: each attack is a whole episode through the real agent loop (scripted policy,
real Toolbox, real podman sandbox) on a task whose honest answer is WRONG, so any reward above
0 is forged. After each attack the next episode on the same container submits a wrong answer
too and must get 0, and must find nothing of the attacker (docs/security.md lists each attack
and what stops it).

Cost: one pool of one container for the whole module (one event loop kept for it), about
1–2 s per episode on the shared 2-core CI machine; ~20 episodes, well under a minute.
"""

from __future__ import annotations

import asyncio
import base64
import json
import textwrap
from pathlib import Path

import pytest

from sandpiper.collector.episode.loop import default_toolbox_factory, run_episode
from sandpiper.collector.episode.policy import TokenPolicy
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.episode.tools import TOOL_SCHEMAS
from sandpiper.collector.tasks.loading import load_task_folder
from sandpiper.collector.tasks.model import Task
from sandpiper.config import SamplingLimits
from sandpiper.store.records import StopReason
from sandpiper.testing import ScriptedPolicy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WRONG_SOL = "def add(a, b):\n    return a - b\n"
GOOD_SOL = "def add(a, b):\n    return a + b\n"
# The tests import the agent's module in-process (the common pytest-like case).
IMPORT_TESTS = r"""
cd "$WORKSPACE"
python3 - <<'EOF'
import json, os, sys
sys.path.append(os.environ["WORKSPACE"])  # appended: the agent's files never shadow stdlib
result = {"passed": 0, "total": 1}
try:
    import sol
    result["passed"] = int(sol.add(2, 3) == 5)
finally:
    with open(os.environ["SANDPIPER_RESULT_FILE"], "w") as f:
        json.dump(result, f)
EOF
"""
# The agent's code runs only in the subject phase (as the agent); the tests read its output.
SUBJECT_COMMAND = "python3 -c 'import sol; print(sol.add(2, 3))' > \"$SUBJECT_OUT/sum\""
SUBJECT_TESTS = r"""
python3 -I - <<'EOF'
import json, os
try:
    got = open(os.environ["SUBJECT_OUT"] + "/sum").read().strip()
except OSError:
    got = None
json.dump({"passed": int(got == "5"), "total": 1}, open(os.environ["SANDPIPER_RESULT_FILE"], "w"))
EOF
"""


def _task(root: Path, name: str, tests: str, extra_toml: str = "") -> Task:
    folder = root / name
    (folder / "files").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "instruction.md").write_text("Fix add() in /workspace/sol.py, then submit.")
    (folder / "files" / "sol.py").write_text(WRONG_SOL)
    (folder / "tests" / "run.sh").write_text(tests)
    (folder / "task.toml").write_text('result_format = "result_file"\n' + extra_toml)
    return load_task_folder(folder)


def bash(command: str) -> str:
    call = {"name": "execute_bash", "arguments": {"command": command, "timeout": 20}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def put(path: str, text: str, mode: str = ">") -> str:
    """A shell command writing ``text`` to ``path`` byte-exact (no quoting games)."""
    return f"echo {base64.b64encode(text.encode()).decode()} | base64 -d {mode} {path}"


SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {"answer": "done"}}\n</tool_call>'
LIMITS = SamplingLimits(max_turns=8, max_tokens_per_turn=100_000, max_episode_tokens=400_000,
                       context_limit=500_000)  # fmt: skip


class Harness:
    """One event loop and one single-container pool for the whole module."""

    def __init__(self, make_pool, tokenizer, tasks_root: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self._cm = make_pool(pool_size=1, exec_timeout_s=20.0)
        self.pool = self.loop.run_until_complete(self._cm.__aenter__())
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer, TOOL_SCHEMAS)
        self.imports = _task(tasks_root, "imports", IMPORT_TESTS)
        self.subject = _task(tasks_root, "subject", SUBJECT_TESTS,
                             f"subject_command = {json.dumps(SUBJECT_COMMAND)}\n")  # fmt: skip
        self.keep = _task(tasks_root, "keep", IMPORT_TESTS, "tests_see_agent_processes = true\n")
        answer_task = tasks_root / "answer-file"
        answer_task.mkdir()
        (answer_task / "instruction.md").write_text("Write 6*7 to /workspace/answer.txt.")
        (answer_task / "task.toml").write_text(
            'reward = "exact"\nanswer = "42"\nanswer_file = "/workspace/answer.txt"\n'
        )
        self.answer_file = load_task_folder(answer_task)
        self.toolboxes = default_toolbox_factory(exec_timeout_s=20, test_timeout_s=30)
        self.n = 0

    def episode(self, task: Task, replies: list[str]):
        async def go():
            self.n += 1
            async with self.pool.session(episode_id=f"e{self.n}", task_id=task.task_id) as box:
                return box.id, await run_episode(
                    episode_id=f"e{self.n}", sample_index=0, task=task,
                    policy=TokenPolicy(ScriptedPolicy(self.tokenizer, replies), self.renderer),
                    sandbox=box, toolbox=self.toolboxes(box, task), limits=LIMITS,
                )  # fmt: skip

        return self.loop.run_until_complete(go())

    def close(self) -> None:
        self.loop.run_until_complete(self._cm.__aexit__(None, None, None))
        self.loop.close()


@pytest.fixture(scope="module")
def harness(sandbox_pool, tiny_tokenizer, tmp_path_factory):
    h = Harness(sandbox_pool, tiny_tokenizer, tmp_path_factory.mktemp("forging-tasks"))
    yield h
    h.close()


def outputs(episode) -> str:
    return "\n".join(c.output for t in episode.turns for c in t.tool_calls)


def assert_forged_nothing(h: Harness, task: Task, attack: list[str]):
    """The attack episode gets 0; the next, innocent but wrong, episode gets 0 and is clean."""
    box_id, ep = h.episode(task, [*attack, SUBMIT])
    assert ep.stop_reason is StopReason.SUBMITTED and ep.valid, (ep.stop_reason, ep.error)
    assert ep.reward == 0.0, (ep.reward, ep.reward_breakdown, outputs(ep)[-3000:])
    check = bash(
        "ps -eo uid=,stat=,comm= | grep -v ' ps$' | sort | tr -s ' ' | tr '\\n' ';'; echo; "
        "ls -A /workspace /tmp /dev/shm /dev/mqueue /grade | tr '\\n' ' '; echo; ipcs | grep -c '^0x'"
    )
    next_box, nxt = h.episode(task, [check, SUBMIT])
    assert next_box == box_id  # the same container, reset in between
    assert nxt.reward == 0.0, (nxt.reward, nxt.reward_breakdown)
    procs, files, ipc = outputs(nxt).split("\n")[:3]
    rows = [p.split() for p in procs.split(";") if p.strip()]
    assert {r[0] for r in rows} <= {"0", "1000"}, procs  # no grader uid left
    assert not [r for r in rows if r[1].startswith("T")], procs  # nothing stopped survives
    assert len([r for r in rows if r[2] == "sleep"]) == 0, procs
    expected = ["/workspace:", "sol.py", "/tmp:", "/dev/shm:", "/dev/mqueue:", "/grade:"]
    assert sorted(files.split()) == sorted(expected), files
    assert ipc.strip() == "0", ipc
    return ep, nxt


def test_control_an_honest_fix_is_paid(harness):
    fix = bash(f"printf '{GOOD_SOL}' > /workspace/sol.py")
    assert harness.episode(harness.imports, [fix, SUBMIT])[1].reward == 1.0
    assert harness.episode(harness.subject, [fix, SUBMIT])[1].reward == 1.0
    assert harness.episode(harness.keep, [fix, SUBMIT])[1].reward == 1.0
    assert harness.episode(harness.imports, [SUBMIT])[1].reward == 0.0


def test_user_site_pth_and_usercustomize_in_home(harness):
    forge = (
        "import os\n"
        "open(os.environ.get('SANDPIPER_RESULT_FILE', '/tmp/x'), 'w').write('{\"reward\": 1}')\n"
        "os._exit(0)\n"
    )
    attack = bash(
        "for site in $(python3 -c 'import site; print(site.getusersitepackages())') "
        "/tmp/.local/lib/python3.11/site-packages; do mkdir -p $site; "
        f"{put('$site/usercustomize.py', forge)}; "
        "echo 'import usercustomize' > $site/aaa.pth; done; "
        "python3 -c 'print(1)'; echo rc=$?"  # the agent's own python is hijacked: proof
    )
    ep, _ = assert_forged_nothing(harness, harness.imports, [attack])
    assert "rc=0" in outputs(ep) and "1\nrc=0" not in outputs(ep)  # planted for real


def test_json_shadowing_stdlib_in_the_workspace(harness):
    evil = (
        "import os\n"
        "def dump(obj, f, **kw): f.write('{\"reward\": 1.0}')\n"
        "def dumps(obj, **kw): return '{\"reward\": 1.0}'\n"
        "open(os.environ.get('SANDPIPER_RESULT_FILE', '/dev/null'), 'w').write('{\"reward\": 1}')\n"
    )
    attack = bash(f"{put('/workspace/json.py', evil)}; cp /workspace/json.py /workspace/os.py")
    assert_forged_nothing(harness, harness.imports, [attack])


@pytest.mark.parametrize(
    "payload",
    [
        "print('{\"reward\": 1.0}'); print('=== 99 passed in 0.01s ==='); print('passed 9/9')",
        "import os; print('{\"reward\": 1.0}', flush=True); os._exit(0)",
        "import os\nfor tag in ('', 'x'): print('SANDPIPER_RESULT', tag, '{\"reward\": 1}')\n"
        "os.write(1, b'SANDPIPER_RESULT ' + os.environ.get('SANDPIPER_RESULT_TAG', '').encode()"
        " + b' {\"reward\": 1}\\n')",
    ],
    ids=["prints-reward-and-99-passed", "os-exit-0-at-import", "tagged-lines"],
)
def test_module_under_test_prints_or_exits_at_import(harness, payload):
    attack = bash(put("/workspace/sol.py", payload + "\n", ">>"))
    assert_forged_nothing(harness, harness.imports, [attack])


def test_module_under_test_writes_the_result_file_in_the_subject_phase(harness):
    """With a subject phase the agent's code never runs with the tests' rights."""
    forge = textwrap.dedent("""
        import glob, os
        for path in ["/grade/out/result.json", os.environ.get("SANDPIPER_RESULT_FILE", "")]:
            try:
                open(path, "w").write('{"reward": 1}'); print("WROTE", path)
            except OSError as e:
                print("refused", path, e)
        for env in glob.glob("/proc/*/environ"):
            try:
                if b"SANDPIPER" in open(env, "rb").read(): print("LEAK", env)
            except OSError:
                pass
        """)
    attack = bash(put("/workspace/sol.py", forge, ">>"))
    assert_forged_nothing(harness, harness.subject, [attack])


def test_pre_created_test_and_result_destinations(harness):
    attack = bash(
        "mkdir -p /grade/tests /grade/out 2>&1; ln -s /workspace /grade/tests 2>&1; "
        "ln -s /workspace/r.json /grade/out/result.json 2>&1; echo '{\"reward\": 1}' > /workspace/r.json; "
        "mkdir -p /tmp/.sandpiper-tests; echo 'echo {\\\"reward\\\": 1}' > /tmp/.sandpiper-tests/run.sh; "
        "chmod 555 /tmp/.sandpiper-tests; ln -s /workspace/r.json /tmp/.sandpiper-answer; "
        "ln /workspace/r.json /workspace/hard.json; mkfifo /workspace/fifo; "
        "ln -s /etc/passwd /workspace/passwd; ls -ld /grade"
    )
    ep, _ = assert_forged_nothing(harness, harness.imports, [attack])
    assert "Permission denied" in outputs(ep)
    refused = set(ep.reward_breakdown["test_details"].get("refused", []))
    assert {"fifo", "passwd"} <= refused


def test_supervisor_pipes_cannot_be_taken_over(harness):
    """pidfd_getfd + SIGSTOP of the supervisor, ptrace, /proc/PID/fd and mem: all refused;
    a watcher left behind to answer for this episode or the next is killed."""
    takeover = textwrap.dedent("""
        import ctypes, os, signal
        libc = ctypes.CDLL(None, use_errno=True)
        SYS_pidfd_open, SYS_pidfd_getfd, PTRACE_ATTACH = 434, 438, 16
        for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
            try:
                comm = open(f"/proc/{pid}/comm").read().strip()
                uid = int(open(f"/proc/{pid}/status").read().split("Uid:")[1].split()[0])
            except OSError:
                continue
            if uid == os.getuid():
                continue
            pidfd = libc.syscall(SYS_pidfd_open, int(pid), 0)
            for fd in (0, 1, 2):
                got = libc.syscall(SYS_pidfd_getfd, pidfd, fd, 0)
                print("GETFD", comm, fd, "OK" if got >= 0 else "refused")
            print("PTRACE", comm, "OK" if libc.ptrace(PTRACE_ATTACH, int(pid), 0, 0) == 0 else "refused")
            for path in (f"/proc/{pid}/fd/1", f"/proc/{pid}/mem", f"/proc/{pid}/environ"):
                try:
                    open(path, "rb").close(); print("OPEN", path, "OK")
                except OSError:
                    print("OPEN", path, "refused")
            try:
                os.kill(int(pid), signal.SIGSTOP); print("SIGSTOP", comm, "OK")
            except OSError:
                print("SIGSTOP", comm, "refused")
        """)
    watcher = (
        "(while :; do for p in /proc/[0-9]*; do echo '{\"reward\": 1}' > $p/fd/1; done "
        "2>/dev/null; sleep 0.01; done) >/dev/null 2>&1 & "
        "sleep 1000 & kill -STOP $!; setsid sleep 999 >/dev/null 2>&1 & echo planted"
    )
    attack = [bash(put("/tmp/t.py", takeover) + "; python3 /tmp/t.py"), bash(watcher)]
    ep, _ = assert_forged_nothing(harness, harness.imports, attack)
    out = outputs(ep)
    assert "GETFD python3" in out and "PTRACE python3" in out, out[-2000:]
    assert " OK" not in out.replace("planted", ""), out[-3000:]


def test_environment_and_preload_of_the_agent_do_not_reach_the_tests(harness):
    attack = bash(
        'printf %s \'echo {\\"reward\\": 1} > "$SANDPIPER_RESULT_FILE"; exit 0\' > /workspace/env.sh; '
        "export BASH_ENV=/workspace/env.sh ENV=/workspace/env.sh PYTHONPATH=/workspace "
        "PYTHONSTARTUP=/workspace/env.sh LD_PRELOAD=/workspace/evil.so PYTHONHOME=/workspace "
        "SANDPIPER_RESULT_FILE=/workspace/r.json HOME=/workspace PATH=/workspace:$PATH; "
        'printf \'#!/bin/sh\\necho {\\"reward\\": 1} > "$SANDPIPER_RESULT_FILE"\\n\' > /workspace/python3; '
        "chmod +x /workspace/python3; cp /workspace/python3 /workspace/bash"
    )
    assert_forged_nothing(harness, harness.imports, [attack])


def test_leftovers_of_every_kind_do_not_reach_the_next_episode(harness):
    """Processes (stopped ones too), files, SysV and POSIX IPC, removed permissions, /dev."""
    plant = bash(
        "ipcmk -M 4096; ipcmk -Q; ipcmk -S 2; "
        "python3 -c \"import ctypes, os; rt = ctypes.CDLL('librt.so.1', use_errno=True); "
        "print('mq', rt.mq_open(b'/mqleft', os.O_CREAT | os.O_RDWR, 0o600, None))\"; "
        "touch /tmp/f /dev/shm/f /workspace/f /dev/leftover 2>&1; mkdir -p /workspace/d/e /tmp/d; "
        "chmod 000 /workspace/d /tmp/d /workspace /tmp 2>&1; "
        "sleep 1000 & kill -STOP $!; nohup sleep 1001 >/dev/null 2>&1 & "
        "unshare -rm sh -c 'mount -t tmpfs none /workspace' 2>&1; "
        "ls /dev/mqueue; ipcs | grep -c '^0x'"
    )
    ep, _ = assert_forged_nothing(harness, harness.imports, [plant])
    out = outputs(ep)
    assert "mqleft" in out and "mq -1" not in out, out  # planted for real


def test_live_agent_processes_cannot_reach_the_tests_when_the_task_keeps_them(harness):
    """``tests_see_agent_processes``: the agent's watcher lives on during the tests, which run
    on a plain copy of the workspace in /grade: it can write neither that copy nor the result."""
    watcher = (
        "(for i in $(seq 1000); do echo '{\"reward\": 1}' > /grade/out/result.json; "
        "echo 'def add(a, b): return 5' > /grade/workspace/sol.py; "
        "ln -sf /workspace/sol.py /grade/workspace/link; sleep 0.01; done) 2>/dev/null & "
        "ln -s /etc/passwd /workspace/passwd; echo started"
    )
    ep, _ = assert_forged_nothing(harness, harness.keep, [bash(watcher)])
    assert "passwd" in ep.reward_breakdown["test_details"].get("refused", [])


@pytest.mark.parametrize(
    "plant",
    ["mkfifo /workspace/answer.txt", "ln -s /etc/passwd /workspace/answer.txt",
     "ln -s /proc/self/environ /workspace/answer.txt", "mkdir /workspace/answer.txt"],
    ids=["fifo", "passwd", "environ", "folder"],
)  # fmt: skip
def test_answer_file_of_every_kind_is_read_safely(harness, plant):
    """A FIFO is refused (never waited on), a link reads only what the agent could: a valid
    episode with reward 0, never a stuck or infra-invalid one."""
    _, ep = harness.episode(harness.answer_file, [bash(plant), SUBMIT.replace('"done"', "null")])
    assert ep.stop_reason is StopReason.SUBMITTED and ep.valid, (ep.stop_reason, ep.error)
    assert ep.reward == 0.0 and ep.duration_ms < 30_000
