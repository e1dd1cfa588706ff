#!/usr/bin/env bash
# One Codex CLI episode (`codex exec`) against the episode's gateway URL: the collector runs
# this as a task's agent_command with OPENAI_BASE_URL, OPENAI_API_KEY, SANDPIPER_MODEL and
# SANDPIPER_TASK set and HOME a fresh temporary folder (collector/gateway/external.py).
# CODEX overrides the binary (default: `codex` on PATH, else runs/agents/node_modules/.bin).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
codex=${CODEX:-$(command -v codex || echo "$here/../../runs/agents/node_modules/.bin/codex")}
export CODEX_HOME="$HOME/.codex"
mkdir -p "$CODEX_HOME"
cp "$here/codex.toml" "$CODEX_HOME/config.toml"
cat >"$CODEX_HOME/instructions.md" <<'TEXT'
You are an agent in a Linux sandbox. Run one shell command per turn with exec_command.
When you are done, answer with a short summary.
TEXT
exec "$codex" exec --skip-git-repo-check \
    -c "model_providers.sandpiper.base_url=\"$OPENAI_BASE_URL\"" \
    -c "model=\"$SANDPIPER_MODEL\"" \
    -c "model_instructions_file=\"$CODEX_HOME/instructions.md\"" \
    -- "$SANDPIPER_TASK"
