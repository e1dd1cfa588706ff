"""The ``sandpiper`` command line: a thin typer app over each part's Python API.

Each module in :mod:`sandpiper.commands` defines ``register(app)`` and adds its commands.
Modules import heavy libraries (torch, vLLM, transformers, duckdb) only inside command
bodies, so ``sandpiper --help`` stays fast (a test holds it under one second).
"""

from __future__ import annotations

import importlib
import pkgutil

import typer

import sandpiper.commands

app = typer.Typer(
    name="sandpiper",
    help="Local-first RL for LLM agents: collector, sandboxes, trajectory store, GRPO learner.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_all() -> None:
    for info in sorted(pkgutil.iter_modules(sandpiper.commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"sandpiper.commands.{info.name}")
        module.register(app)


_register_all()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
