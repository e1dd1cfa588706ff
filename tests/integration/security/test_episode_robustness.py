"""Each crash class and outcome class of issue 14, as a whole episode through the real loop
(``run_pooled_episode``: scripted policy, real parser, Toolbox and podman sandbox), then the
NEXT episode on the same container, which must be clean and correctly graded (it writes the
right answer: reward 1). docs/security.md ("Robustness and outcome classes") lists each.

- Crash classes: every hostile turn that once escaped the episode and stopped the daemon
  (lone surrogates, a >1 MiB folder listing, pre-created answer and test paths, chmod 000
  left behind, ...) is now an observation the agent sees, and the episode is graded.
- Outcome classes: what the agent's commands do to its sandbox is graded (valid, reward 0
  here); only a container lost to the host is invalid (``sandbox_lost``, reward None).

Cost: one pool of one container, ~1-2 s per episode; about a minute in all (the stopped
shell case waits for the host watchdog, ~7 s).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from sandpiper.collector.episode.loop import default_toolbox_factory, run_pooled_episode
from sandpiper.collector.episode.policy import TokenPolicy
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.episode.tools import TOOL_SCHEMAS
from sandpiper.collector.sandbox.containers import read_registry
from sandpiper.collector.sandbox.isolation import SUPERVISOR_MAIN
from sandpiper.collector.tasks.loading import load_task_folder
from sandpiper.config import SamplingLimits
from sandpiper.store.records import StopReason, ToolErrorKind
from sandpiper.testing import ScriptedPolicy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

LABEL = "pytest-robustness"
LIMITS = SamplingLimits(max_turns=8, max_tokens_per_turn=1_000_000, max_episode_tokens=4_000_000,
                       context_limit=5_000_000)  # fmt: skip


def raw(name: str, arguments_json: str) -> str:
    """A tool call whose arguments are written as raw JSON text (escapes kept as sampled)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments_json}}}\n</tool_call>'


def call(name: str, arguments: dict) -> str:
    return raw(name, json.dumps(arguments))


def bash(command: str, timeout: int = 10) -> str:
    return call("execute_bash", {"command": command, "timeout": timeout})


SUBMIT = call("submit", {})
HONEST = [bash("echo 42 > /workspace/answer.txt"), SUBMIT]


class Harness:
    """One event loop and one single-container pool for the module."""

    def __init__(self, make_pools, tokenizer, root: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self._cm = make_pools()
        self.pool = self.loop.run_until_complete(self._cm.__aenter__())
        self.renderer = ChatRenderer(tokenizer, TOOL_SCHEMAS)
        self.tokenizer = tokenizer
        root.mkdir(parents=True, exist_ok=True)
        (root / "instruction.md").write_text("Write 6*7 to /workspace/answer.txt, then submit.")
        (root / "task.toml").write_text(
            'reward = "exact"\nanswer = "42"\nanswer_file = "/workspace/answer.txt"\n'
        )
        self.task = load_task_folder(root)
        self.toolboxes = default_toolbox_factory(exec_timeout_s=10, test_timeout_s=20)
        self.n = 0
        self.uid = uuid.uuid4().hex[:8]
        """Unique per harness, so a registry entry names this module run's episode only."""

    @property
    def episode_id(self) -> str:
        """Id of the episode running (or last run)."""
        return f"r{self.n}-{self.uid}"

    def episode(self, replies: list, policy=None):
        self.n += 1
        client = policy or ScriptedPolicy(self.tokenizer, replies)
        return self.loop.run_until_complete(
            run_pooled_episode(
                self.pool,
                episode_id=self.episode_id,
                sample_index=0,
                task=self.task,
                policy=TokenPolicy(client, self.renderer),
                make_toolbox=self.toolboxes,
                limits=LIMITS,
            )
        )

    def close(self) -> None:
        self.loop.run_until_complete(self._cm.__aexit__(None, None, None))
        self.loop.close()


@pytest.fixture(scope="module")
def harness(sandbox_config, sandbox_image, tiny_tokenizer, tmp_path_factory):
    import contextlib

    from sandpiper.collector.sandbox.images import ImagePools

    @contextlib.asynccontextmanager
    async def make():
        config = sandbox_config.model_copy(update={"pool_size": 1, "exec_timeout_s": 10.0})
        pools = ImagePools(config, labels={"sandpiper.run": LABEL})
        try:
            await pools.start()
            yield pools
        finally:
            await pools.close()

    h = Harness(make, tiny_tokenizer, tmp_path_factory.mktemp("robust") / "answer-task")
    yield h
    h.close()


def observations(episode) -> list[tuple[ToolErrorKind, str]]:
    return [(c.error_kind, c.output) for t in episode.turns for c in t.tool_calls]


def assert_next_is_clean(h: Harness, box_id: str | None, *, same_box: bool = True):
    check = bash("ls -A /workspace /tmp | tr '\\n' ' '; echo; ps -eo stat= | grep -c '^T' || true")
    nxt = h.episode([check, *HONEST])
    assert nxt.stop_reason is StopReason.SUBMITTED and nxt.reward == 1.0, (nxt.error, nxt)
    listing, stopped = observations(nxt)[0][1].split("\n")[:2]
    assert sorted(listing.split()) == ["/tmp:", "/workspace:"], listing  # both empty
    assert stopped == "0", stopped  # no stopped process left
    assert (nxt.sandbox_id == box_id) is same_box, (nxt.sandbox_id, box_id)
    return nxt


CRASHES = {
    # lone surrogates, as a model writes them: JSON escapes (UnicodeEncodeError before)
    "surrogate-in-bash": [raw("execute_bash", '{"command": "echo \\ud800"}')],
    "surrogate-in-editor-path": [
        raw("str_replace_editor", '{"command": "view", "path": "/workspace/\\ud800"}'),
        raw(
            "str_replace_editor",
            '{"command": "create", "path": "/workspace/a", "file_text": "x\\udfff"}',
        ),
    ],
    "surrogate-in-name-and-answer": [raw("\\ud800", "{}"), raw("submit", '{"answer": "\\ud800"}')],
    "deep-nan-and-long-numbers": [
        raw("execute_bash", "[" * 50_000 + "]" * 50_000),
        raw("execute_bash", '{"command": "ls", "timeout": NaN}'),
        raw("execute_bash", '{"command": "ls", "timeout": 1e999}'),
        raw("execute_bash", '{"command": "ls", "timeout": ' + "9" * 5000 + "}"),
    ],
    # a listing over the reply reader's 1 MiB line limit (LimitOverrunError before)
    "editor-view-of-a-huge-folder": [
        bash(
            'mkdir /workspace/big && cd /workspace/big && python3 -c "import os\n'
            "for i in range(6000): os.mkdir('d' * 240 + str(i))\""
        ),
        call("str_replace_editor", {"command": "view", "path": "/workspace/big"}),
    ],
    "answer-file-is-a-folder": [bash("mkdir -p /workspace/answer.txt/x")],
    "answer-file-is-a-fifo": [bash("mkfifo /workspace/answer.txt")],
    "answer-file-is-a-read-only-folder": [
        bash("mkdir /workspace/answer.txt; chmod 000 /workspace/answer.txt")
    ],
    "answer-file-links-to-dev-zero": [bash("ln -s /dev/zero /workspace/answer.txt")],
    "tests-destinations-pre-created": [
        bash(
            "mkdir -p /grade/tests /tests/x 2>&1; mkdir -p /tmp/.sandpiper-tests; "
            "chmod 000 /tmp/.sandpiper-tests; mkfifo /tmp/.sandpiper-answer; echo rc=$?"
        ),
    ],
    "chmod-000-left-behind": [
        bash(
            "chmod 000 /workspace /tmp 2>&1; mkdir -p /workspace/a/b /tmp/c/d; "
            "chmod 000 /workspace/a /tmp/c /workspace/a/b 2>&1; echo done"
        ),
    ],
    "editor-on-devices-fifos-and-proc": [
        bash("mkfifo /workspace/f"),
        *[
            call("str_replace_editor", {"command": c, "path": p})
            for c, p in [
                ("view", "/workspace/f"),
                ("view", "/dev/zero"),
                ("view", "/dev/stdin"),
                ("view", "/proc/self/mem"),
                ("view", "/proc/1/environ"),
            ]
        ],
    ],
}


@pytest.mark.parametrize("attack", list(CRASHES), ids=list(CRASHES))
def test_hostile_turn_is_an_observation_and_the_episode_is_graded(harness, attack):
    ep = harness.episode([*CRASHES[attack], SUBMIT])
    assert ep.stop_reason is StopReason.SUBMITTED and ep.valid, (ep.stop_reason, ep.error)
    assert ep.reward == 0.0 and ep.error is None
    seen = observations(ep)
    assert len(seen) == len(CRASHES[attack]) + 1, seen  # every call answered, then submit
    assert_next_is_clean(harness, ep.sandbox_id)


def test_an_agent_that_breaks_its_path_can_still_run_commands(harness):
    ep = harness.episode([bash("export PATH=/nowhere; ls"), bash("echo still-here"), SUBMIT])
    outputs = [o for _, o in observations(ep)]
    assert "command not found" in outputs[0] and outputs[1] == "still-here", outputs
    assert_next_is_clean(harness, ep.sandbox_id)


def test_an_agent_cannot_kill_or_stop_its_supervisor_and_is_graded(harness):
    """docs/security.md, outcome classes: the agent's attempts on its own supervisor (after
    a chmod 000 of what it can reach) are graded like any failure, never an infra escape."""
    attack = bash(
        "chmod 000 /workspace 2>/dev/null; mkdir -p /workspace/x; chmod 000 /workspace/x; "
        "for p in /proc/[0-9]*; do p=${p#/proc/}; [ $p = $$ ] || kill -STOP $p 2>/dev/null; "
        "kill -9 $p 2>/dev/null; done; echo survived",
        timeout=3,
    )
    ep = harness.episode([attack, bash("echo after"), SUBMIT])
    assert ep.stop_reason is StopReason.SUBMITTED and ep.valid and ep.reward == 0.0, ep.error
    assert observations(ep)[1][1] == "after"
    assert_next_is_clean(harness, ep.sandbox_id)


def test_exhausting_memory_and_pids_is_the_policys_outcome(harness):
    hog = bash("python3 -c 'x = bytearray(2**31)'", timeout=10)
    bomb = bash("f() { f | f & }; f; sleep 2; echo bombed", timeout=3)
    ep = harness.episode([hog, bomb, bash("echo alive"), SUBMIT])
    assert ep.valid and ep.reward == 0.0, (ep.stop_reason, ep.error)
    kinds = [k for k, _ in observations(ep)]
    assert kinds[0] in (ToolErrorKind.OOM_KILLED, ToolErrorKind.NONE), observations(ep)[0]
    assert_next_is_clean(
        harness, ep.sandbox_id, same_box=ep.stop_reason is not StopReason.SANDBOX_DIED
    )


class _OnTurn(ScriptedPolicy):
    """A scripted policy that runs ``action()`` on the host before its turn ``at``."""

    def __init__(self, tokenizer, replies, *, at: int, action) -> None:
        super().__init__(tokenizer, replies)
        self.at, self.action = at, action

    async def generate(self, prompt_ids, params):
        if self._next == self.at:
            await asyncio.to_thread(self.action)
        return await super().generate(prompt_ids, params)


def _container(episode_id: str) -> str:
    """The container running ``episode_id``, as the pool's registry says. Others of the run
    may be listed beside it: the one the pool replaced after an earlier test on its way out,
    or its successor starting (CI saw both)."""
    names = subprocess.run(
        ["podman", "ps", "--format", "{{.Names}}", "--filter", f"label=sandpiper.run={LABEL}"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    mine = [n for n in names if read_registry(n).get("episode") == episode_id]
    assert len(mine) == 1, (episode_id, names, mine)
    return mine[0]


def test_a_stopped_shell_is_detected_by_the_host_watchdog_and_the_episode_goes_on(harness):
    """A supervisor that stops answering (SIGSTOP, here from the host: the agent cannot
    signal it) is caught by the host's deadline (timeout + grace), restarted with a
    takeover, and the call reported as timed out; the episode continues and is graded."""

    def stop_supervisor():
        box = _container(harness.episode_id)
        subprocess.run(["podman", "exec", box, "pkill", "-STOP", "-f", SUPERVISOR_MAIN], check=True)

    replies = [bash("echo one"), bash("echo two", timeout=1), bash("echo three"), SUBMIT]
    ep = harness.episode(
        [], policy=_OnTurn(harness.tokenizer, replies, at=1, action=stop_supervisor)
    )
    seen = observations(ep)
    assert seen[1][0] is ToolErrorKind.TIMED_OUT and seen[2] == (ToolErrorKind.NONE, "three")
    assert ep.stop_reason is StopReason.SUBMITTED and ep.valid and ep.reward == 0.0
    assert_next_is_clean(harness, ep.sandbox_id)


def test_a_container_removed_by_the_host_is_sandbox_lost_and_replaced(harness):
    def remove():
        """As an operator would: ``podman rm -f``, again while the container still exists
        (podman 4.3's removal racing the pool's own ``podman exec`` can fail with "device
        or resource busy", the race ``remove_containers_by_name`` retries in the collector)."""
        name, errors = _container(harness.episode_id), []
        for attempt in range(5):
            done = subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True,
                                  text=True)  # fmt: skip
            gone = subprocess.run(["podman", "container", "exists", name]).returncode == 1
            if gone:
                return
            errors.append(done.stderr.strip())
            time.sleep(0.2 * 2**attempt)
        raise AssertionError(f"podman rm -f {name} kept failing: {errors}")

    replies = [bash("echo one"), bash("echo two"), SUBMIT]
    ep = harness.episode([], policy=_OnTurn(harness.tokenizer, replies, at=1, action=remove))
    assert ep.stop_reason is StopReason.SANDBOX_LOST, (ep.stop_reason, ep.error)
    assert not ep.valid and ep.reward is None
    assert observations(ep)[-1][0] is ToolErrorKind.SANDBOX_LOST
    assert_next_is_clean(harness, ep.sandbox_id, same_box=False)  # a fresh container
