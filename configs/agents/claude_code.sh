#!/usr/bin/env bash
# One Claude Code episode (`claude -p`) against the episode's gateway: the collector runs this
# as a task's agent_command with ANTHROPIC_BASE_URL (the episode URL without /v1),
# ANTHROPIC_API_KEY, SANDPIPER_MODEL and SANDPIPER_TASK set and HOME a fresh temporary folder
# (collector/gateway/external.py). CLAUDE overrides the binary (default: `claude` on PATH,
# else runs/agents/node_modules/.bin). The short system prompt and the one Bash tool suit the
# small models this project runs on CPU; drop --system-prompt and --tools for a large model.
# Claude Code runs its tools on the collector's host, not in the episode's podman sandbox: in
# -p mode without --allowedTools it asks no one and runs no Bash command (the model is told
# the permission was denied).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
claude=${CLAUDE:-$(command -v claude || echo "$here/../../runs/agents/node_modules/.bin/claude")}
export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1
exec "$claude" -p --model "$SANDPIPER_MODEL" \
    --system-prompt "You are an agent in a Linux sandbox. Use the Bash tool, one command per turn." \
    --tools Bash -- "$SANDPIPER_TASK"
