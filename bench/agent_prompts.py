"""How many tokens each agent CLI's own prompt takes as it reaches the gateway.

Runs each agent of ``configs/agents/`` once, unmodified, against a gateway whose policy
records the first prompt it is sent and answers ``Done.`` (the agent then exits), with the
episode's MCP route served over a scripted fake sandbox (no podman, no model). The prompt is
what the run's chat template rendered from the agent's request: its system instructions,
its tool definitions and the task (one short line). Counted in two vocabularies:

- ``tiny``: the tiny model's 2,048-token BPE (``runs/tiny-model``, the Qwen2.5-style
  template every count here is rendered with);
- ``smollm2``: SmolLM2-135M's 49,152-token BPE (``runs/smollm2-135m``, from ``make setup``),
  the same rendered text re-encoded: the size a real model's vocabulary gives.

``tools_*`` is the part inside the template's ``<tools>`` block. Variants per CLI:
``default`` (the shipped example: the CLI's own instructions, its host tools off, the
sandbox's tools over MCP), ``small`` (``--small-model``), and for Codex CLI and Claude Code
``stock`` (the CLI as installed, its own built-in tools on and no MCP server: what it sends
on a developer's machine; never used for an episode).

    python bench/agent_prompts.py [--json] [--write]

``--write`` stores the figures in bench/results/agent_prompts/prompt_tokens.json (docs/gateway.md
quotes them). Takes ~1 minute (the CLIs' start-up).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
AGENTS = REPO / "configs" / "agents"
NODE_BIN = REPO / "runs" / "agents" / "node_modules" / ".bin"
RESULTS = REPO / "bench" / "results" / "agent_prompts" / "prompt_tokens.json"
TASK = "Create the file /workspace/hello.txt containing the single line `hello`, then submit."
CONTEXT = 1 << 20


class FirstPrompt:
    """A PolicyClient that keeps the prompts it is sent and answers ``Done.``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.convert_tokens_to_ids(tokenizer.eos_token))
        self.prompts: list[list[int]] = []

    @property
    def policy_version(self) -> int:
        return 0

    async def generate(self, prompt_ids: list[int], params: Any) -> Any:
        from sandpiper.collector.inference.base import Generation

        self.prompts.append(list(prompt_ids))
        ids = [*self.tokenizer.encode("Done.", add_special_tokens=False), self.eos_id]
        n = len(ids)
        return Generation(np.asarray(ids, np.int32), np.zeros(n, np.float32),
                          np.zeros(n, np.int32), "stop")  # fmt: skip


def _binary(name: str) -> str | None:
    local = NODE_BIN / name
    return shutil.which(name) or (str(local) if local.exists() else None)


def variants() -> dict[str, list[str]]:
    """Name → argv of each agent run measured."""
    out: dict[str, list[str]] = {}
    codex, claude = _binary("codex"), _binary("claude")
    if codex:
        out["codex/default"] = ["bash", str(AGENTS / "codex.sh")]
        out["codex/small"] = ["bash", str(AGENTS / "codex.sh"), "--small-model"]
        out["codex/stock"] = ["bash", "-c", _STOCK_CODEX, "_", codex]
    if claude:
        out["claude_code/default"] = ["bash", str(AGENTS / "claude_code.sh")]
        out["claude_code/small"] = ["bash", str(AGENTS / "claude_code.sh"), "--small-model"]
        out["claude_code/stock"] = [claude, "-p", "--model", "policy", "--", TASK]
    out["openai_agents/mcp"] = [sys.executable, str(AGENTS / "openai_agents.py"), "--mcp"]
    return out


_STOCK_CODEX = """set -e
mkdir -p "$HOME/.codex"
cat > "$HOME/.codex/config.toml" <<EOF
model_provider = "sandpiper"
approval_policy = "never"
[model_providers.sandpiper]
name = "gateway"
wire_api = "responses"
env_key = "OPENAI_API_KEY"
base_url = "$OPENAI_BASE_URL"
EOF
exec "$1" exec --skip-git-repo-check -m policy -- "$SANDPIPER_TASK"
"""


async def measure(argv: list[str], tokenizers: dict[str, Any]) -> dict[str, Any]:
    """One agent run; the first prompt's size in each tokenizer."""
    from sandpiper.collector.episode.loop import default_toolbox_factory
    from sandpiper.collector.episode.render import ChatRenderer
    from sandpiper.collector.gateway.mcp_server import EpisodeTools
    from sandpiper.collector.gateway.server import Gateway, GatewaySettings
    from sandpiper.config import SamplingLimits
    from sandpiper.testing import FakeSandbox

    tiny = tokenizers["tiny"]
    policy = FirstPrompt(tiny)
    limits = SamplingLimits(context_limit=CONTEXT, max_tokens_per_turn=16)
    gw = Gateway(client=policy, renderer=ChatRenderer(tiny),
                 settings=GatewaySettings(model_names=("policy",), sampling=limits))  # fmt: skip
    await gw.serve()
    task = _task()
    box = FakeSandbox(scripted=True)
    toolbox = default_toolbox_factory(exec_timeout_s=5.0, test_timeout_s=5.0)(box, task)
    url = gw.open_episode("bench", tools=EpisodeTools(task, box, toolbox, score_on_submit=False))
    with tempfile.TemporaryDirectory(prefix="sandpiper-agent-") as home:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OPENAI_", "ANTHROPIC_", "SANDPIPER_"))}  # fmt: skip
        env.update(
            HOME=home, OPENAI_BASE_URL=url, OPENAI_API_KEY="x", SANDPIPER_MODEL="policy",
            ANTHROPIC_BASE_URL=url.removesuffix("/v1"), ANTHROPIC_API_KEY="x",
            SANDPIPER_MCP_URL=gw.mcp_url("bench"), SANDPIPER_TASK=TASK,
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1",
            PYTHONPATH=str(REPO),
            PATH=os.pathsep.join([str(NODE_BIN), str(Path(sys.executable).parent),
                                  env.get("PATH", "")]),
        )  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=home, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        await asyncio.wait_for(proc.wait(), 180)
    gw.close_episode("bench")
    await gw.aclose()
    await box.close()
    if not policy.prompts:
        return {"error": f"no model call (exit status {proc.returncode})"}
    # the largest of the agent's calls: its main loop (Claude Code also asks side questions)
    text = max((tiny.decode(p, skip_special_tokens=False) for p in policy.prompts), key=len)
    block = text.split("\n</tools>\n\nFor each function call", 1)[0]
    tools = block.rsplit("<tools>", 1)[1] if "<tools>" in block else ""
    out: dict[str, Any] = {"chars": len(text), "tools_chars": len(tools)}
    for name, tok in tokenizers.items():
        out[f"{name}_tokens"] = len(tok.encode(text, add_special_tokens=False))
        out[f"tools_{name}_tokens"] = len(tok.encode(tools, add_special_tokens=False))
    out["tools"] = sorted({json.loads(line)["function"]["name"] for line in tools.splitlines()
                           if line.strip()})  # fmt: skip
    return out


def _task() -> Any:
    from sandpiper.collector.tasks.loading import load_tasks

    return next(iter(load_tasks(REPO / "tasks" / "folders" / "write-hello")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    parser.add_argument("--write", action="store_true", help=f"store the figures in {RESULTS}")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizers = {"tiny": AutoTokenizer.from_pretrained(REPO / "runs" / "tiny-model")}
    smollm = REPO / "runs" / "smollm2-135m"
    if (smollm / "tokenizer.json").is_file():
        tokenizers["smollm2"] = AutoTokenizer.from_pretrained(smollm)
    figures = {name: asyncio.run(measure(argv, tokenizers)) for name, argv in variants().items()}
    for name, fig in figures.items():
        if not args.json:
            print(name, {k: v for k, v in fig.items() if k != "tools"})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    record = {"commit": commit, "date": datetime.date.today().isoformat(), "figures": figures}
    if args.write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    if args.json:
        print(json.dumps(record))


if __name__ == "__main__":
    main()
