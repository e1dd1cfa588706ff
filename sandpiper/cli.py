"""The ``sandpiper`` command line: a thin typer app over each part's Python API.

Each module in :mod:`sandpiper.commands` defines ``register(app)`` and adds its commands.
Modules import heavy libraries (torch, vLLM, transformers, duckdb) only inside command
bodies, so ``sandpiper --help`` stays fast (a test holds it under one second).
"""

from __future__ import annotations

import atexit
import importlib
import os
import pkgutil
import sys
import threading
from typing import NoReturn

import typer

import sandpiper.commands
from sandpiper.logs import setup_logging

app = typer.Typer(
    name="sandpiper",
    help="Local-first RL for LLM agents: collector, sandboxes, trajectory store, GRPO learner.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstrings wrap at 100 columns: reflow them to the terminal
)


@app.callback()
def _main(
    verbose: bool = typer.Option(
        False,
        "--verbose",
        "-v",
        help="Also show other libraries' INFO logs (HTTP requests, MLflow, DeepSpeed, ...), "
        "and the traceback behind an error's one line. Also accepted after the command.",
    ),
) -> None:
    """Local-first RL for LLM agents: collector, sandboxes, trajectory store, GRPO learner."""
    setup_logging(verbose=verbose or None)


def _register_all() -> None:
    for info in sorted(pkgutil.iter_modules(sandpiper.commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"sandpiper.commands.{info.name}")
        module.register(app)


_register_all()


def strip_local_rank(argv: list[str]) -> list[str]:
    """``argv`` without the ``--local_rank=N`` the DeepSpeed launcher appends (PLATFORM.md).

    The launcher passes the rank in the environment too (``LOCAL_RANK``), which is what the
    learner reads; the value is copied there in case a launcher only passed the option.
    """
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in ("--local_rank", "--local-rank"):
            if not eq and i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            os.environ.setdefault("LOCAL_RANK", value)
        else:
            out.append(arg)
        i += 1
    return out


def main() -> None:
    """Entry point of the ``sandpiper`` script."""
    sys.argv[1:] = strip_local_rank(sys.argv[1:])
    try:
        app()
    except SystemExit as done:
        _exit(done.code)
    _exit(0)


def _exit(code: object) -> NoReturn:
    """Exit with ``code``, skipping the interpreter's module teardown when torch and DuckDB
    are both loaded: there DuckDB's nanobind bindings (held by duckdb_engine) print ~40
    harmless "nanobind: leaked instances" lines at the end of every learner, collector and
    demo process. Everything else a normal exit does still happens, in the same order:
    non-daemon threads are joined, exit handlers run, output is flushed."""
    if "torch" not in sys.modules or "_duckdb" not in sys.modules:
        raise SystemExit(code)
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    main()
