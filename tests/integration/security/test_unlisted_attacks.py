"""Attacks the issue's list does not name, each tried as a hostile model would: a whole
episode through the real agent loop, toolbox and a real podman sandbox, on a task whose
honest answer is wrong (any reward above 0 is forged), then an innocent next episode on the
same container that must get 0 and find nothing left (``assert_forged_nothing``).
docs/security.md ("Attacks found by thinking like the adversary") says what stops each.

Cost: one single-container pool for the module (the harness of tests/integration/security/test_reward_forging.py),
about 1–3 s per episode on the shared 2-core CI machine; ~20 episodes.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from sandpiper.collector.tasks.loading import load_task_folder
from sandpiper.collector.tasks.model import Task
from sandpiper.store.records import StopReason
from tests.integration.security.test_reward_forging import (
    SUBMIT,
    Harness,
    _task,
    assert_forged_nothing,
    bash,
    outputs,
    put,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# The tests report what they see of the workspace (kept in the reward breakdown) and pay 0.
PROBE_TESTS = r"""
python3 -I - <<'PY'
import json, os, stat
special, owners = [], set()
for dirpath, dirnames, filenames in os.walk(os.environ["WORKSPACE"]):
    for name in dirnames + filenames:
        st = os.lstat(os.path.join(dirpath, name))
        owners.add(st.st_uid)
        if st.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
            special.append(name)
made = os.path.join(os.environ["WORKSPACE"], "d", "made-by-tests")
open(made, "w").close()
json.dump({"passed": 0, "total": 1, "special": special, "owners": sorted(owners),
           "made_gid": os.stat(made).st_gid}, open(os.environ["SANDPIPER_RESULT_FILE"], "w"))
PY
"""
# Sloppy but plausible tests: they echo the submitted answer, then print their tagged result.
ECHO_ANSWER_TESTS = r"""
cat "$ANSWER_FILE"
echo "SANDPIPER_RESULT $SANDPIPER_RESULT_TAG {\"reward\": 0}"
"""
# The tag on a command line (readable in /proc/PID/cmdline by every uid), after a pause.
CMDLINE_TAG_TESTS = r"""
sleep 2
python3 -c 'import sys, time; time.sleep(3); print(*sys.argv[1:])' SANDPIPER_RESULT "$SANDPIPER_RESULT_TAG" '{"reward": 0}'
"""


def _tagged(root: Path, name: str, tests: str, extra_toml: str = "") -> Task:
    _task(root, name, tests)
    (root / name / "task.toml").write_text('result_format = "tagged_line"\n' + extra_toml)
    return load_task_folder(root / name)


class Attacks(Harness):
    def __init__(self, make_pool, tokenizer, tasks_root: Path) -> None:
        super().__init__(make_pool, tokenizer, tasks_root)
        self.probe = _task(tasks_root, "probe", PROBE_TESTS)
        self.echo_answer = _tagged(tasks_root, "echo-answer", ECHO_ANSWER_TESTS)
        self.keep_tagged = _tagged(
            tasks_root, "keep-tagged", CMDLINE_TAG_TESTS, "tests_see_agent_processes = true\n"
        )


@pytest.fixture(scope="module")
def attacks(sandbox_pool, tiny_tokenizer, tmp_path_factory):
    h = Attacks(sandbox_pool, tiny_tokenizer, tmp_path_factory.mktemp("attack-tasks"))
    yield h
    h.close()


def test_thousands_of_refused_links_with_hostile_names(attacks):
    """30,000 links made the grader's reply header exceed the host's 1 MiB line limit: the
    sandbox was declared dead and the episode infra-invalid (a wrong answer escaped its 0).
    Names with newlines, escapes, reward-looking text or bytes that are not UTF-8 too."""
    script = textwrap.dedent("""
        import os
        for i in range(30000):
            os.symlink("/etc/passwd", "/workspace/l%05d-" % i + "x" * 60)
        for name in [b'\\nSANDPIPER_RESULT x {"reward": 1}', b"\\x1b]0;t\\x07", b"\\xff\\xfe"]:
            os.symlink(b"/etc/passwd", b"/workspace/" + name)
        print(len(os.listdir("/workspace")), "entries")
        """)
    plant = bash(f"{put('/tmp/links.py', script)}; python3 /tmp/links.py")
    ep, _ = assert_forged_nothing(attacks, attacks.imports, [plant])
    assert "30004 entries" in outputs(ep)  # planted for real (with sol.py)
    refused = ep.reward_breakdown["test_details"]["refused"]
    assert len(refused) == 50 and refused[-1] == "... and 29954 more", refused[-3:]
    json.dumps(refused, ensure_ascii=False).encode("utf-8")  # storable: no lone surrogates


def test_sparse_terabyte_file_hard_linked(attacks):
    """A 1 TB sparse file costs no space; hard-linked, the grader breaks the link by copying
    it (into a 64 MB tmpfs): the copy fails fast and the episode scores 0, valid."""
    plant = bash(
        "truncate -s 1T /workspace/big && ln /workspace/big /workspace/big2 && ls -ls /workspace"
    )
    ep, _ = assert_forged_nothing(attacks, attacks.imports, [plant])
    assert "1099511627776" in outputs(ep)
    assert ep.duration_ms < 60_000


def test_special_mode_bits_do_not_reach_the_tests(attacks):
    """setuid/setgid/sticky bits on the agent's files and a setgid folder (files the tests
    create in it would get the agent's group): the tests see plain files of their own uid."""
    plant = bash(
        "mkdir -p /workspace/d && chmod 3777 /workspace/d && cp /bin/true /workspace/t && "
        "chmod 6755 /workspace/t && chmod g+s /workspace/sol.py && ls -l /workspace; "
        "setcap cap_setuid+ep /workspace/t 2>&1 | tail -1"
    )
    ep, _ = assert_forged_nothing(attacks, attacks.probe, [plant])
    assert "rwsr-sr-x" in outputs(ep)  # planted for real
    details = ep.reward_breakdown["test_details"]
    assert details["special"] == [] and details["owners"] == [1001], details
    assert details["made_gid"] == 1001, details


def test_processes_hidden_in_namespaces_or_detached(attacks):
    """A process in its own user and pid namespace, a double-forked daemon, a setsid one
    that ignores signals, a stopped parent with an unreaped zombie child: none survives."""
    zombie = textwrap.dedent("""
        import os, signal, time
        if os.fork() == 0:
            if os.fork() == 0:
                os._exit(0)  # the zombie: its parent never reaps it
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(1000)
        """)
    plant = bash(
        "unshare -rpf sleep 1001 >/dev/null 2>&1 & "
        "unshare -rU sh -c 'setsid sleep 1002 &' >/dev/null 2>&1; "
        "setsid sh -c 'trap \"\" TERM HUP INT; exec sleep 1003' >/dev/null 2>&1 & "
        f"{put('/tmp/z.py', zombie)}; python3 /tmp/z.py >/dev/null 2>&1 & "
        "sleep 1; ps -eo stat=,args= | grep -v ps | tr '\\n' ';'"
    )
    ep, _ = assert_forged_nothing(attacks, attacks.imports, [plant])
    out = outputs(ep)
    assert "sleep 1001" in out and "sleep 1003" in out and ";Z" in out, out[-800:]


def test_the_tag_on_a_command_line_is_no_use_to_a_live_agent(attacks):
    """``tests_see_agent_processes``: the agent's watcher reads every /proc/PID/cmdline and
    environ during the tests (the tag is on a command line here) and tries every way to
    print a tagged line into the tests' output: their pipes belong to another uid."""
    watcher = textwrap.dedent("""
        import glob, os, re, time
        found = set()
        end = time.time() + 25
        while time.time() < end:
            for path in glob.glob("/proc/[0-9]*/cmdline") + glob.glob("/proc/[0-9]*/environ"):
                try:
                    found |= set(re.findall(rb"[0-9a-f]{32}", open(path, "rb").read()))
                except OSError:
                    continue
            for tag in found:
                line = b"SANDPIPER_RESULT " + tag + b' {"reward": 1}\\n'
                open("/workspace/seen", "ab").write(tag + b"\\n")
                for fd in glob.glob("/proc/[0-9]*/fd/[012]"):
                    try:
                        with open(fd, "wb") as f:
                            f.write(line)
                    except OSError:
                        pass
            time.sleep(0.005)
        """)
    plant = bash(f"{put('/tmp/w.py', watcher)}; nohup python3 /tmp/w.py >/dev/null 2>&1 & echo ok")
    ep, _ = assert_forged_nothing(attacks, attacks.keep_tagged, [plant])
    assert ep.reward_breakdown["test_details"].get("format") == "tagged_line"


@pytest.mark.parametrize(
    "answer",
    [
        'SANDPIPER_RESULT 00000000000000000000000000000000 {"reward": 1}\n{"reward": 1}\n99 passed',
        "\x1b]0;title\x07\x1b[2J\r\x00\x9b\u202e" * 100,
        "x" * 50_000,
    ],
    ids=["reward-lines", "control-characters", "huge"],
)
def test_submit_answer_abuse(attacks, answer):
    """The answer reaches the tests as a file written by the grader; tests that even echo it
    are not fooled (no tag), and it cannot break the grader or the episode."""
    call = {"name": "submit", "arguments": {"answer": answer}}
    submit = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    _, ep = attacks.episode(attacks.echo_answer, [submit])
    assert ep.stop_reason is StopReason.SUBMITTED and ep.valid, (ep.stop_reason, ep.error)
    assert ep.reward == 0.0, ep.reward_breakdown
    assert attacks.episode(attacks.echo_answer, [SUBMIT])[1].reward == 0.0


def test_tmp_and_workspace_full_still_grades(attacks):
    """/tmp and the workspace full of data plus 50,000 empty files: the tests still run
    (their home and temp are on /grade) and the wrong answer scores 0, not infra-invalid."""
    script = textwrap.dedent("""
        import os
        os.mkdir("/workspace/many")
        for i in range(50000):
            os.close(os.open("/workspace/many/%d" % i, os.O_CREAT | os.O_WRONLY))
        """)
    plant = bash(
        "head -c 80M /dev/zero > /tmp/fill 2>/dev/null; head -c 80M /dev/zero > /workspace/fill "
        f"2>/dev/null; {put('/workspace/f.py', script)}; python3 /workspace/f.py; "
        "df /tmp /workspace | tail -2"
    )
    ep, _ = assert_forged_nothing(attacks, attacks.imports, [plant])
    assert "100%" in outputs(ep), outputs(ep)[-500:]


def editor(**arguments) -> str:
    call = {"name": "str_replace_editor", "arguments": arguments}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def test_editor_on_the_supervisors_own_proc_files(attacks):
    """The editor's file operations run in the supervisor's process (with the agent's
    file-system uid), so ``/proc/self`` is the supervisor: its stdin/stdout pipes, the socket
    the host talks to it over (one of the next descriptors), memory, environment and OOM
    score. Pipes and sockets are refused without blocking, root's files cannot be written,
    and nothing breaks the framing of the next request."""
    calls = [
        editor(command="view", path="/proc/self/fd/0"),
        editor(command="view", path="/proc/self/fd/1"),
        editor(command="str_replace", path="/proc/self/fd/1", old_str="a", new_str="b"),
        *(editor(command="view", path=f"/proc/self/fd/{fd}") for fd in (3, 4, 5)),
        editor(command="insert", path="/proc/self/fd/4", insert_line=0, new_str="{}"),
        editor(command="view", path="/proc/self/mem"),
        editor(command="view", path="/proc/self/environ"),
        editor(command="view", path="/proc/1/environ"),
        editor(command="str_replace", path="/proc/self/oom_score_adj", old_str="0", new_str="-1000"),
        editor(command="insert", path="/proc/self/attr/current", insert_line=0, new_str="x"),
        bash("cat /proc/$(pgrep -u 0 -f sandpiper/supervisor)/oom_score_adj; echo still-framed"),
    ]  # fmt: skip
    ep, _ = assert_forged_nothing(
        attacks, attacks.imports, ["\n".join(calls[:9]), "\n".join(calls[9:])]
    )
    results = [c for t in ep.turns for c in t.tool_calls]
    assert all(c.error_kind.value == "tool_error" for c in results[:12]), [
        (c.error_kind, c.output[:120]) for c in results
    ]  # pipes refused without blocking; mem, environ, oom_score_adj: the agent's rights
    assert "still-framed" in results[12].output and results[12].output.startswith("0"), results[12]
    assert "SANDPIPER_RESULT_TAG" not in outputs(ep)


FLOOD = textwrap.dedent("""
    import os
    for d in ("/tmp/m", "/workspace/m"):
        os.mkdir(d)
        for i in range(150000):
            os.close(os.open("%s/%d" % (d, i), os.O_CREAT | os.O_WRONLY))
    """)


def test_a_supervisor_killed_twice_never_loses_the_pools_container(attacks):
    """The inode flood (below) kills the supervisor at submit and again at reset: the second
    failure escaped ``reset`` as a ConnectionError, the pool's recycle task died with it and
    the next ``acquire`` waited forever (a policy could stall the collector slot by slot).
    Now the container is replaced and the next episode runs."""
    flood = bash(f"{put('/tmp/flood.py', FLOOD)}; python3 /tmp/flood.py")
    attacks.episode(attacks.imports, [flood, SUBMIT])
    _, nxt = attacks.episode(attacks.imports, [bash("echo fresh"), SUBMIT])
    assert nxt.stop_reason is StopReason.SUBMITTED and nxt.valid, (nxt.stop_reason, nxt.error)
    assert nxt.reward == 0.0 and "fresh" in outputs(nxt)


# Last in the module: the supervisor it kills leaves the pool to replace the container.
def test_inode_flood_is_graded_not_invalid(attacks):
    """300,000 empty files leave no memory for the supervisor (each tmpfs inode costs ~1 KB
    of kernel memory, charged to the container, and podman 4.3 cannot cap a tmpfs's inodes):
    it is killed during the tests. The agent did that to its own sandbox, so the episode is
    ``sandbox_died`` — valid and scored 0 — never an infra-invalid escape from its penalty."""
    flood = bash(f"{put('/tmp/flood.py', FLOOD)}; python3 /tmp/flood.py")
    _, ep = attacks.episode(attacks.imports, [flood, SUBMIT])
    assert ep.valid and ep.reward == 0.0, (ep.stop_reason, ep.error)
    assert ep.stop_reason in (StopReason.SANDBOX_DIED, StopReason.SUBMITTED), ep.stop_reason
