"""The CLI stays thin: fast --help, no heavy imports, help text on every command."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import click
import typer.main
from typer.testing import CliRunner

from sandpiper.cli import app

HEAVY = ("torch", "vllm", "transformers", "deepspeed", "duckdb", "polars", "matplotlib", "mlflow")
SANDPIPER = Path(sys.executable).parent / "sandpiper"


def _child_cpu_s(argv: list[str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(argv, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert out.returncode == 0, out.stderr
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_help_is_fast() -> None:
    """CPU seconds of the child (user + sys), best of three, against a baseline measured in
    the same loop: the interpreter with the CLI's own libraries (typer, pydantic, rich).

    Wall time on this shared 2-core machine measures the other processes' load as much as
    ours, and so, less, does CPU time: a fixed 1.0 s bound failed at 1.17 s under a full
    suite's load (0.8 s quiet, before and after this change). The CLI's modules may cost at
    most 0.8 s beyond the baseline (0.25 s quiet); importing torch alone costs ~3.4 s."""
    base = [sys.executable, "-c", "import typer, pydantic, rich.console"]
    best_help = best_base = float("inf")
    for _ in range(3):
        best_base = min(best_base, _child_cpu_s(base))
        best_help = min(best_help, _child_cpu_s([str(SANDPIPER), "--help"]))
    assert best_help - best_base < 0.8, (
        f"sandpiper --help used {best_help:.2f} CPU seconds, {best_help - best_base:.2f} more "
        f"than the interpreter with typer and pydantic ({best_base:.2f})"
    )


def test_help_imports_no_heavy_library() -> None:
    probe = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from sandpiper.cli import app\n"
        "r = CliRunner().invoke(app, ['--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"--help imported: {out.stdout.strip()}"


def _walk(command: click.Command, path: tuple[str, ...] = ()):
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _walk(sub, (*path, name))


def test_every_command_has_help_text() -> None:
    root = typer.main.get_command(app)
    missing = [" ".join(p) for p, c in _walk(root) if p and not (c.help or c.short_help)]
    assert not missing, f"commands without help: {missing}"


def test_every_command_answers_help() -> None:
    root = typer.main.get_command(app)
    runner = CliRunner()
    for path, _ in _walk(root):
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, f"sandpiper {' '.join(path)} --help: {result.output}"


def test_bad_override_is_one_clear_line() -> None:
    result = CliRunner().invoke(app, ["config", "show", "--learner.nope", "1"])
    assert result.exit_code == 1
    assert "nope" in result.output


def test_the_deepspeed_launchers_local_rank_is_stripped(monkeypatch):
    from sandpiper.cli import strip_local_rank

    # set, then deleted: the undo then removes what strip_local_rank writes (a bare
    # delenv of an absent variable records nothing, and LOCAL_RANK=0 leaked into later
    # tests of the same process: accelerate then took it for a distributed launch)
    monkeypatch.setenv("LOCAL_RANK", "")
    monkeypatch.delenv("LOCAL_RANK")
    argv = ["learn", "-c", "run.toml", "--learner.lr", "1e-3", "--local_rank=1"]
    assert strip_local_rank(argv) == argv[:-1]
    import os

    assert os.environ["LOCAL_RANK"] == "1"
    assert strip_local_rank(["learn", "--local-rank", "0", "--x", "1"]) == ["learn", "--x", "1"]
