"""Codex CLI, Claude Code and the OpenAI Agents SDK act on the episode's sandbox: each runs
unmodified as a task's ``agent_command`` through ``sandpiper collect``, with its built-in
shell and file tools off and the episode's sandbox tools over the gateway's MCP route
(``configs/agents/``, their default prompts), and a scripted policy behind the same gateway
and token capture makes it

1. run a command with ``execute_bash`` that writes the answer, and also aims at the host: a
   file in the agent's own temp folder (its ``HOME`` on the collector's host, found there and
   named exactly), a file in a folder this test made on the host, a ``sleep`` left running;
2. read the answer back with ``str_replace_editor``;
3. ``submit``; then answer in prose.

Checked: the task's tests (``tasks/folders/write-hello``) pay 1 through the episode's own
grading; the stored episode holds every call's exact sampled ids; nothing the command aimed
at the host is there (looked for while the agent still runs, and after); the tools the agent
offered the model are the sandbox's, not its own shell. The first prompt's size (each CLI's
default system prompt and tools, rendered) is printed for docs/gateway.md.

No model weights run: the policy is scripted, so the test costs the agents' start-up and
the sandbox (~20-40 s per agent). A client that is not installed fails the test in CI.
"""

from __future__ import annotations

import asyncio
import glob
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

from sandpiper.config import load_config
from tests.conftest import REPO, require
from tests.fixtures.vllm import tiny_model_copy

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

AGENTS = REPO / "configs" / "agents"
NODE_BIN = REPO / "runs" / "agents" / "node_modules" / ".bin"
TASK = REPO / "tasks" / "folders" / "write-hello"
CONTEXT = 131_072
"""The gateway's window here: the CLIs' default prompts in the tiny model's small vocabulary."""
SLEEP_S = 4242.5
"""The host process the policy tries to leave running (looked for by its command line)."""


class SandboxActor:
    """A scripted PolicyClient that acts through whichever sandbox tools the prompt offers
    (``execute_bash`` or Claude Code's ``mcp__sandbox__execute_bash``), by the number of tool
    results in the prompt: bash (answer + host attacks), view, submit, then prose."""

    def __init__(self, tokenizer, host_dir: Path) -> None:
        self.tokenizer, self.host_dir = tokenizer, host_dir
        self.eos_id = int(tokenizer.convert_tokens_to_ids(tokenizer.eos_token))
        self.prompts: list[str] = []
        self.prompt_lens: list[int] = []
        self.replies: list[str] = []
        self.aimed_at: list[Path] = []
        """Host paths a command of the policy tried to write."""
        self.seen_on_host: list[str] = []
        """What of those the policy found on the host at its next call (must stay empty)."""

    @property
    def policy_version(self) -> int:
        return 0

    async def reload(self, checkpoint_dir: str, version: int) -> None:
        """No weights."""

    async def generate(self, prompt_ids, params):
        from sandpiper.collector.inference.base import Generation

        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        self.prompts.append(text)
        self.prompt_lens.append(len(prompt_ids))
        self._look_at_host()
        reply = self._reply(text)
        self.replies.append(reply)
        ids = [*self.tokenizer.encode(reply, add_special_tokens=False), self.eos_id]
        n = len(ids)
        return Generation(np.asarray(ids, np.int32), np.zeros(n, np.float32),
                          np.zeros(n, np.int32), "stop")  # fmt: skip

    def _reply(self, text: str) -> str:
        if "execute_bash" not in text:  # a side call of the agent's (a title, a summary)
            return "Done."
        prefix = "mcp__sandbox__" if '"mcp__sandbox__execute_bash"' in text else ""
        turn = text.count("<tool_response>")
        if turn == 0:
            return _call(prefix + "execute_bash", {"command": self._command()})
        if turn == 1:
            return _call(prefix + "str_replace_editor",
                         {"command": "view", "path": "/workspace/hello.txt"})  # fmt: skip
        if turn == 2:
            return _call(prefix + "submit", {})
        return "I wrote hello to /workspace/hello.txt and submitted."

    def _command(self) -> str:
        # the agent's own temp folders on this host, by their exact names
        targets = [Path(d) / "pwned" for d in glob.glob("/tmp/sandpiper-agent-*")]
        targets.append(self.host_dir / "pwned")
        self.aimed_at += targets
        writes = " ; ".join(f"mkdir -p {t.parent} && echo pwned > {t}" for t in targets)
        return (f"echo hello > /workspace/hello.txt ; {writes} ; "
                f"(nohup sleep {SLEEP_S:g} >/dev/null 2>&1 &) ; cat /workspace/hello.txt")  # fmt: skip

    def _look_at_host(self) -> None:
        self.seen_on_host += [str(p) for p in self.aimed_at if p.exists()]
        if _host_sleepers():
            self.seen_on_host.append(f"sleep {SLEEP_S:g}")


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _host_sleepers() -> list[int]:
    """The policy's ``sleep`` processes in this host's pid namespace (the sandbox's own are in
    the container's namespace, visible from here in /proc too)."""
    ours = os.readlink("/proc/self/ns/pid")
    found = []
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            argv = Path(proc, "cmdline").read_bytes().split(b"\0")
            mine = argv[:2] == [b"sleep", f"{SLEEP_S:g}".encode()]
            if mine and os.readlink(f"{proc}/ns/pid") == ours:
                found.append(int(proc.split("/")[2]))
        except OSError:
            continue
    return found


def _npm_client(name: str) -> str | None:
    found = shutil.which(name)
    local = NODE_BIN / name
    return found or (str(local) if local.exists() else None)


def _task(tmp_path: Path, command: str, env: dict[str, str]) -> Path:
    """write-hello with the agent as its agent_command."""
    task = tmp_path / "tasks" / "write-hello"
    shutil.copytree(TASK, task)
    with (task / "task.toml").open("a") as f:
        f.write(f"agent_command = {json.dumps(command)}\nagent_timeout_s = 300\n")
        f.write("agent_env = {" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items())
                + "}\n")  # fmt: skip
    return task.parent


def _config(tmp_path: Path, tasks: Path, model_dir: Path, sandbox_image: str, name: str) -> Path:
    cfg = {
        "name": name,
        "runs_dir": str(tmp_path / "runs"),
        "store": {"url": f"duckdb:///{tmp_path / 'store.duckdb'}", "flush_interval_s": 0.2},
        "sandbox": {"image": sandbox_image, "pool_size": 1, "memory_mb": 256,
                    "workspace_size_mb": 64},
        "inference": {"max_model_len": CONTEXT},
        "learner": {"model": str(model_dir), "algo": "sft", "micro_batch_tokens": CONTEXT},
        "collector": {
            "tasks": str(tasks), "group_size": 1, "max_turns": 12, "max_tokens_per_turn": 256,
            "max_concurrent_episodes": 1, "max_groups": 1, "max_unconsumed_groups": 100,
            "status_interval_s": 5.0, "policy_poll_s": 0.5, "drain_timeout_s": 600.0,
        },
        "tracking": {"enabled": False},
    }  # fmt: skip
    lines = [f"{k} = {json.dumps(v)}" for k, v in cfg.items() if not isinstance(v, dict)]
    for key, value in cfg.items():
        if isinstance(value, dict):
            lines += [f"[{key}]", *(f"{k} = {json.dumps(v)}" for k, v in value.items())]
    path = tmp_path / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _act(tmp_path: Path, sandbox_image: str, name: str, command: str, env: dict) -> SandboxActor:
    """One episode of ``command`` through ``sandpiper collect`` with :class:`SandboxActor`
    as the policy; checks the reward, the stored tokens and the host; returns the policy."""
    from transformers import AutoTokenizer

    from sandpiper.collector.daemon.launch import collect
    from sandpiper.store import Store
    from sandpiper.store.claims import load_episodes

    model_dir = tiny_model_copy(tmp_path / "tiny-model")
    host_dir = tmp_path / "host-target"
    host_dir.mkdir()
    tasks = _task(tmp_path, command, env)
    config = load_config(_config(tmp_path, tasks, model_dir, sandbox_image, name))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = SandboxActor(tokenizer, host_dir)
    metrics = asyncio.run(
        collect(config.for_collector(), stop=asyncio.Event(), live_status=False, client=policy)
    )
    assert metrics.episodes_total == 1

    store = Store(config.store.url)
    query = "SELECT episode_id, valid, stop_reason, error, reward, reward_breakdown FROM episodes"
    with store.connect_readonly() as conn:
        (episode,) = conn.execute(sa.text(query)).all()
        (trained,) = load_episodes(conn, episode_ids=[episode.episode_id])
    report = {
        "agent": name,
        "replies": policy.replies,
        "episode": str(episode),
        "last_prompt_end": policy.prompts[-1][-2500:],
    }
    assert episode.valid and episode.stop_reason == "submitted", report
    assert episode.reward == 1.0, report  # the task's tests, through the episode's grading
    breakdown = episode.reward_breakdown
    stats = (json.loads(breakdown) if isinstance(breakdown, str) else breakdown)["gateway"]
    assert stats["calls"] >= 4, (stats, report)
    # every scripted reply is stored as sampled, token for token
    sampled = trained.token_ids_T[trained.loss_mask_T].tolist()
    for reply in policy.replies:
        ids = tokenizer.encode(reply, add_special_tokens=False)
        assert _contains(sampled, ids), (reply, report)

    assert policy.aimed_at, report
    assert policy.seen_on_host == [], report  # while the agent ran
    assert not [p for p in policy.aimed_at if p.exists()], report  # and after
    assert _host_sleepers() == [], report
    first = next(p for p in policy.prompts if "execute_bash" in p)
    print(json.dumps({"agent": name, **_prompt_size(first, model_dir)}))
    return policy


def _contains(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def _prompt_size(prompt: str, model_dir: Path) -> dict:
    """The first prompt's tokens (system instructions + tool definitions + the task) in the
    tiny model's 2,048-token vocabulary and in SmolLM2's 49,152-token one (``make setup``'s
    runs/smollm2-135m), as the run's ChatML template rendered it."""
    from transformers import AutoTokenizer

    sizes = {"chars": len(prompt),
             "tiny_tokens": len(AutoTokenizer.from_pretrained(model_dir).encode(prompt))}  # fmt: skip
    smollm = REPO / "runs" / "smollm2-135m"
    if (smollm / "tokenizer.json").is_file():
        sizes["smollm2_tokens"] = len(AutoTokenizer.from_pretrained(smollm).encode(prompt))
    return sizes


def _path_with(*dirs: str) -> str:
    return os.pathsep.join([*dirs, str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def _tools_offered(policy: SandboxActor) -> set[str]:
    """The tool names in the agent's first tool-using prompt (the template's <tools> block)."""
    prompt = next(p for p in policy.prompts if "execute_bash" in p)
    block = prompt.split("\n</tools>\n\nFor each function call", 1)[0].rsplit("<tools>", 1)[1]
    return {json.loads(line)["function"]["name"] for line in block.splitlines() if line.strip()}


HOST_TOOLS = {"exec_command", "shell", "local_shell", "apply_patch", "write_stdin", "view_image",
              "Bash", "Read", "Edit", "Write", "Glob", "Grep", "NotebookEdit", "WebFetch"}  # fmt: skip
"""The CLIs' built-in tools that act on the host they run on."""


def test_codex_cli_acts_in_the_sandbox(sandbox_image, tmp_path):
    codex = _npm_client("codex")
    require("Codex CLI", codex is not None, "npm @openai/codex: run scripts/setup.sh")
    assert codex is not None
    env = {"PATH": _path_with(str(Path(codex).parent))}
    policy = _act(tmp_path, sandbox_image, "sandbox-codex", f"bash {AGENTS / 'codex.sh'}", env)
    offered = _tools_offered(policy)
    assert {"execute_bash", "str_replace_editor", "submit"} <= offered, offered
    assert not offered & HOST_TOOLS, offered


def test_claude_code_acts_in_the_sandbox(sandbox_image, tmp_path):
    claude = _npm_client("claude")
    require("Claude Code", claude is not None, "npm @anthropic-ai/claude-code: scripts/setup.sh")
    assert claude is not None
    env = {"PATH": _path_with(str(Path(claude).parent))}
    command = f"bash {AGENTS / 'claude_code.sh'}"
    policy = _act(tmp_path, sandbox_image, "sandbox-claude", command, env)
    offered = _tools_offered(policy)
    expected = {"mcp__sandbox__execute_bash", "mcp__sandbox__str_replace_editor",
                "mcp__sandbox__submit"}  # fmt: skip
    assert expected <= offered, offered
    assert not offered & HOST_TOOLS, offered


def test_the_agents_sdk_acts_in_the_sandbox_over_mcp(sandbox_image, tmp_path):
    require("the OpenAI Agents SDK", importlib.util.find_spec("agents") is not None,
            "PyPI openai-agents: the dev extra")  # fmt: skip
    command = f"{sys.executable} {AGENTS / 'openai_agents.py'} --mcp"
    policy = _act(tmp_path, sandbox_image, "sandbox-sdk", command, {"PYTHONPATH": str(REPO)})
    assert _tools_offered(policy) == {"execute_bash", "str_replace_editor", "submit"}
