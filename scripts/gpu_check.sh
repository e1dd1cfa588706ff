#!/usr/bin/env bash
# The learner on one CUDA GPU (e.g. one H200), prepared for a short session on a GPU machine:
# bf16 + gradient checkpointing + chunked logprobs on a randomly initialised Qwen3-4B (built
# from configs/models/qwen3-4b/config.json, no weights), peak memory against `sandpiper plan`,
# tokens/s, and the checkpointing equality. One JSON line on stdout; under 8 minutes.
#
#   scripts/gpu_wheels.sh             # here, once: fills .whl/ (carry it with the tree)
#   scripts/gpu_check.sh              # on the GPU machine (one H200: ~105 GiB, see docs/gpu.md)
#   scripts/gpu_check.sh --dry-run    # here, on CPU with the tiny model (what the test runs)
#
# The GPU machine has torch and transformers but no deepspeed, hjson or pydantic: each wheel in
# .whl/ (else shared/wheels/) whose package this Python lacks, or has at a lower version, is
# installed into a throw-away target put first on PYTHONPATH. Here the venv has them all.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
shopt -s nullglob
wheels=(.whl/*.whl)
[ ${#wheels[@]} -gt 0 ] || wheels=(shared/wheels/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  # the wheels this Python lacks or has older (all of them if it cannot tell)
  list=$("$PY" - "${wheels[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.version import Version

for path in sys.argv[1:]:
    name, wanted = Path(path).name.split("-")[:2]
    try:
        if Version(version(name)) >= Version(wanted):
            continue
    except PackageNotFoundError:
        pass
    print(path)
EOF
  ) || list=$(printf '%s\n' "${wheels[@]}")
  mapfile -t needed < <(printf '%s' "$list" | grep .)
  if [ ${#needed[@]} -gt 0 ]; then
    target=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$target" "${needed[@]}" >&2 \
      || echo "gpu_check.sh: installing ${needed[*]} failed" >&2
    export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false
exec timeout -s KILL 470 "$PY" scripts/gpu_check.py "$@"
