#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with the wheels scripts/gpu_check.sh installs on a GPU machine,
# which has Python 3.12, torch and transformers but no network and none of these:
#
#   deepspeed          PyPI has only its sdist: built here into a py3-none-any wheel (no ops
#                      compiled ahead; the GPU machine JIT-builds any it needs, nvcc and ninja
#                      are there)
#   hjson              deepspeed's config parser
#   pydantic, pydantic-core, annotated-types, typing-inspection
#                      deepspeed's config models and sandpiper.config
#   typing-extensions  the image has one, perhaps older than pydantic's >=4.16.0; gpu_check.sh
#                      installs a carried wheel only where the machine's copy is older
#
# Everything else these need (numpy, packaging, psutil, py-cpuinfo, einops, msgpack, ninja,
# tqdm, torch) is in the GPU image (docs/gpu.md, "The GPU check"). Versions are this venv's, so
# the GPU run imports what the tests here ran against; binaries are cp312 manylinux x86-64.
#
#   scripts/gpu_wheels.sh        # then carry .whl with the tree: run(carry=[".whl"], ...)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=.whl
CARRIED=(hjson pydantic pydantic_core annotated_types typing_inspection typing_extensions)
# what the GPU image holds of the carried wheels' requirements (KINDS.md's package list)
IMAGE_HAS="torch numpy packaging psutil py-cpuinfo einops msgpack ninja tqdm"

version() { "$PY" -c 'import sys; from importlib.metadata import version; print(version(sys.argv[1]))' "$1"; }

mkdir -p "$OUT"
rm -f "$OUT"/*.whl # one version of each: two stop the whole install there
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# deepspeed: fetch the sdist, then build it with no index at all (the venv's setuptools + torch)
"$PY" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$tmp" \
  "deepspeed==$(version deepspeed)"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$OUT" \
  "$tmp"/deepspeed-*.tar.gz

pins=()
for name in "${CARRIED[@]}"; do pins+=("$name==$(version "$name")"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$OUT" "${pins[@]}"

# every requirement of a carried wheel is carried or in the image; only pure or cp312 wheels
"$PY" - "$IMAGE_HAS" "$OUT"/*.whl <<'EOF'
import re
import sys
import zipfile
from pathlib import Path


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


image, wheels = set(sys.argv[1].split()), [Path(p) for p in sys.argv[2:]]
carried = {norm(w.name.split("-")[0]) for w in wheels}
problems = []
for wheel in wheels:
    tag = wheel.name.rsplit("-", 3)[-3:]
    if not (tag[:2] == ["py3", "none"] or tag[0] == "cp312"):
        problems.append(f"{wheel.name}: not a py3-none or cp312 wheel")
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line:
                need = norm(re.split(r"[ ;<>=!~\[(]", line.split(":", 1)[1].strip())[0])
                if need not in carried and need not in image:
                    problems.append(f"{wheel.name} needs {need}: neither carried nor in the image")
for problem in problems:
    print(f"gpu_wheels.sh: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
ls -1 "$OUT"
du -sh "$OUT"
