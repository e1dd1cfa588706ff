#!/usr/bin/env bash
# One Codex CLI episode (`codex exec`) against the episode's gateway: the collector runs this as
# a task's agent_command with OPENAI_BASE_URL, OPENAI_API_KEY, SANDPIPER_MODEL, SANDPIPER_MCP_URL
# and SANDPIPER_TASK set and HOME a fresh temporary folder (collector/gateway/external.py).
# Codex's shell is off; its commands, reads and edits go to the episode's podman sandbox through
# the MCP server `sandbox` (codex.toml). Its own instructions and tools are kept: a first prompt
# with a one-line task is 9,894 SmolLM2 tokens, 17,921 tiny-model tokens. `--small-model`
# replaces the instructions with two lines and drops the sub-agent, goal and skill tools (2,011
# and 3,296 tokens), for the small models this project runs on CPU. Figures measured by
# bench/agent_prompts.py, in bench/results/agent_prompts/prompt_tokens.json.
# CODEX overrides the binary (default: `codex` on PATH, else runs/agents/node_modules/.bin).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
codex=${CODEX:-$(command -v codex || echo "$here/../../runs/agents/node_modules/.bin/codex")}
small=()
if [ "${1:-}" = "--small-model" ]; then
    cat >"$HOME/instructions.md" <<'TEXT'
You are an agent in a Linux sandbox. Use the sandbox's tools: execute_bash runs a command,
str_replace_editor views and edits files; call submit when you are done.
TEXT
    small=(-c "model_instructions_file=\"$HOME/instructions.md\""
        -c include_environment_context=false -c include_permissions_instructions=false
        -c include_apps_instructions=false -c features.multi_agent=false
        -c features.goals=false -c features.apps=false -c features.skill_search=false
        -c skills.include_instructions=false -c skills.bundled.enabled=false
        -c agents.enabled=false)
    shift
fi
export CODEX_HOME="$HOME/.codex"
mkdir -p "$CODEX_HOME"
cp "$here/codex.toml" "$CODEX_HOME/config.toml"
exec "$codex" exec --skip-git-repo-check \
    -c "model_providers.sandpiper.base_url=\"$OPENAI_BASE_URL\"" \
    -c "mcp_servers.sandbox.url=\"$SANDPIPER_MCP_URL\"" \
    -c "model=\"$SANDPIPER_MODEL\"" \
    "${small[@]}" "$@" -- "$SANDPIPER_TASK"
