"""Shared CLI plumbing: config loading with dotted overrides, and errors as one line.

Dotted overrides (``--learner.lr 1e-6``, ``--name x``) may stand anywhere among a command's
own options and arguments: :class:`OverridesCommand` takes them out before click parses the
rest, so ``sandpiper sql --store.url URL "SELECT 1"`` and ``sandpiper sql "SELECT 1"
--store.url URL`` are the same command.

Errors: a :class:`~sandpiper.errors.SandpiperError`, or a library failure that
:mod:`sandpiper.commands._failures` recognises (a full disk, a port in use, a store that does
not answer, ...), is printed as ``error: <one line>`` with exit status 1; ``--verbose`` adds
the traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperCommand

from sandpiper.config import RunConfig, load_config
from sandpiper.errors import SandpiperError
from sandpiper.logs import is_verbose, setup_logging

ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="Run config (TOML). Defaults are used when omitted."),
]

VERBOSE_FLAGS = ("--verbose", "-v")

# Commands that take a config accept dotted overrides: --learner.lr 1e-6
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}

TOP_LEVEL = frozenset(
    name
    for name, info in RunConfig.model_fields.items()
    if not hasattr(info.annotation, "model_fields")
)
"""Overrides without a dot: ``--name``, ``--runs_dir`` (or ``--runs-dir``), ``--seed``."""

_STORE_URL: list[str] = []
"""The store URL of the config a command resolved (named in a store error)."""


def split_overrides(args: list[str], own: dict[str, bool]) -> tuple[list[str], list[str]]:
    """``(overrides, the rest)`` of ``args``. ``own`` maps the command's own option strings to
    whether they take a value (their values are never mistaken for overrides)."""
    overrides: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest += args[i:]
            break
        name = arg.partition("=")[0]
        if name in own:
            take = 2 if own[name] and "=" not in arg else 1
            rest += args[i : i + take]
            i += take
            continue
        key = name[2:].replace("-", "_")
        if name.startswith("--") and ("." in key or key in TOP_LEVEL):
            take = 1 if "=" in arg else 2
            overrides += args[i : i + take]
            i += take
            continue
        rest.append(arg)
        i += 1
    return overrides, rest


class VerboseCommand(TyperCommand):
    """A command that takes ``--verbose`` / ``-v`` after its name too (unless it has an
    option of that name), as ``sandpiper --verbose`` before it."""

    def own_options(self) -> dict[str, bool]:
        """The command's option strings, each with whether it takes a value."""
        return {
            opt: p.param_type_name == "option" and not (p.is_flag or p.count)  # type: ignore[attr-defined]
            for p in self.params
            for opt in (*p.opts, *p.secondary_opts)
            if opt.startswith("-")
        }

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        own = self.own_options()
        kept = [a for a in args if a not in VERBOSE_FLAGS or a in own]
        if len(kept) != len(args):
            setup_logging(verbose=True)
        return super().parse_args(ctx, kept)


class OverridesCommand(VerboseCommand):
    """A command whose dotted config overrides may stand anywhere in its arguments."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        overrides, rest = split_overrides(args, self.own_options())
        remaining = super().parse_args(ctx, rest)
        ctx.args = [*overrides, *ctx.args]
        return remaining


def resolve_config(config: Path | None, ctx: typer.Context) -> RunConfig:
    """Load ``config`` and apply the dotted ``--part.field value`` arguments of ``ctx``."""
    with cli_errors():
        cfg = load_config(config, list(ctx.args))
    name_store_in_errors(cfg.store.url)
    return cfg


def name_store_in_errors(url: str) -> None:
    """Name ``url`` in a store error from now on: the config's URL, or a command's ``--url``
    that replaces it."""
    _STORE_URL[:] = [url]


def fail(message: str) -> NoReturn:
    """Print ``message`` as ``error: ...`` lines (after the traceback, with --verbose), exit 1."""
    if is_verbose() and sys.exc_info()[0] is not None:
        traceback.print_exc()
    for line in message.splitlines() or [""]:
        typer.secho(f"error: {line}", fg=typer.colors.RED, err=True)
    sys.exit(1)


@contextmanager
def cli_errors() -> Iterator[None]:
    """Print project errors and setup failures as one red line and exit 1 (see the module
    docstring); other exceptions pass through with their traceback."""
    from sandpiper.commands._failures import explain

    try:
        yield
    except SandpiperError as e:
        fail(str(e))
    except Exception as e:
        if type(e).__module__.startswith(("typer", "click")):
            raise  # usage errors and exits: typer prints them
        line = explain(e, store_url=_STORE_URL[0] if _STORE_URL else None)
        if line is None:
            raise
        fail(line)


def command(app: typer.Typer, name: str, **kwargs: Any) -> Callable[[Callable], Callable]:
    """``app.command`` that also accepts dotted config overrides, anywhere."""
    return app.command(name, cls=OverridesCommand, context_settings=OVERRIDES, **kwargs)
