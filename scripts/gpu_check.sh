#!/usr/bin/env bash
# The learner on one CUDA GPU (e.g. one H200), prepared for a short session on a GPU machine:
# bf16 + gradient checkpointing + chunked logprobs on a randomly initialised Qwen3-4B (built
# from configs/models/qwen3-4b/config.json, no weights), peak memory against `sandpiper plan`,
# tokens/s, and the checkpointing equality. One JSON line on stdout; under 8 minutes.
#
#   scripts/gpu_check.sh              # on the GPU machine
#   scripts/gpu_check.sh --dry-run    # here, on CPU with the tiny model (what the test runs)
#
# The GPU machine has torch and transformers but no deepspeed: a wheel carried with the tree
# under shared/wheels/ (or wheels/) is installed into a throw-away target first.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
if ! "$PY" -c "import deepspeed" 2>/dev/null; then
  wheel=$(ls shared/wheels/deepspeed-*.whl wheels/deepspeed-*.whl shared/wheels/deepspeed-*.tar.gz 2>/dev/null | head -1)
  if [ -n "$wheel" ]; then
    target=$(mktemp -d)
    "$PY" -m pip install --quiet --no-deps --no-index --target "$target" "$wheel" >&2 || true
    export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false
exec timeout -s KILL 470 "$PY" scripts/gpu_check.py "$@"
