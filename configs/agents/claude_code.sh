#!/usr/bin/env bash
# One Claude Code episode (`claude -p`) against the episode's gateway: the collector runs this
# as a task's agent_command with ANTHROPIC_BASE_URL (the episode URL without /v1),
# ANTHROPIC_API_KEY, SANDPIPER_MODEL, SANDPIPER_MCP_URL and SANDPIPER_TASK set and HOME a fresh
# temporary folder (collector/gateway/external.py).
# Every built-in tool is off (`--tools ""`: no Bash, Read, Edit, Write on the collector's host)
# and the only MCP server is the episode's sandbox (`--strict-mcp-config` ignores any other
# config): its commands, reads and edits run in the episode's podman sandbox. Its own system
# prompt is kept (3,123 SmolLM2 / 5,268 tiny-model tokens with its tools, measured in
# bench/results/agent_prompts/prompt_tokens.json); `--small-model` replaces it with one line
# (1,596 / 2,496), for the small models this project runs on CPU. CLAUDE overrides the binary (default: `claude` on PATH, else
# runs/agents/node_modules/.bin).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
claude=${CLAUDE:-$(command -v claude || echo "$here/../../runs/agents/node_modules/.bin/claude")}
small=()
if [ "${1:-}" = "--small-model" ]; then
    small=(--system-prompt "You are an agent in a Linux sandbox. Use the sandbox's tools, one \
call per turn; call submit when you are done.")
    shift
fi
export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1
# MCP start-up and call timeouts (ms): submit runs the task's tests (120 s by default)
export MCP_TIMEOUT=${MCP_TIMEOUT:-60000} MCP_TOOL_TIMEOUT=${MCP_TOOL_TIMEOUT:-600000}
mcp_config="{\"mcpServers\": {\"sandbox\": {\"type\": \"http\", \"url\": \"$SANDPIPER_MCP_URL\"}}}"
tools=mcp__sandbox__execute_bash,mcp__sandbox__str_replace_editor,mcp__sandbox__submit
exec "$claude" -p --model "$SANDPIPER_MODEL" --tools "" \
    --mcp-config "$mcp_config" --strict-mcp-config --allowedTools "$tools" \
    "${small[@]}" "$@" -- "$SANDPIPER_TASK"
