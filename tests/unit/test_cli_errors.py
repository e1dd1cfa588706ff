"""The mistakes users make end in one line that says what to do, from the real CLI.

One test per class of mistake (a model path that is no model, a store URL with an unknown
scheme or no server behind it, a missing or empty task source, a port in use, podman or the
sandbox image missing, a full disk, a checkpoint folder that cannot be written, a run name
taken by another config); ``--verbose`` adds the traceback; options, overrides and arguments
go in any order. Each runs ``sandpiper`` as a subprocess (none gets as far as torch or vLLM).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SANDPIPER = str(Path(sys.executable).parent / "sandpiper")
REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, cwd: Path | None = None, env: dict | None = None):
    return subprocess.run(
        [SANDPIPER, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


def _one_line_error(done: subprocess.CompletedProcess, *phrases: str) -> str:
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A folder that passes the model check (the commands stop before they load it)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    url = f"duckdb:///{tmp_path / 'store.duckdb'}"
    assert _run("store", "init", "--url", url).returncode == 0
    return url


def test_a_model_path_that_does_not_exist_or_is_no_model(tmp_path: Path) -> None:
    _one_line_error(
        _run("learn", "--learner.model", "/nonexistent"),
        "learner.model = '/nonexistent': no such model folder", "sandpiper model init-tiny",
    )  # fmt: skip
    _one_line_error(
        _run("learn", "--learner.model", str(tmp_path)),
        "is not a model folder (no config.json and no weights in it)",
    )
    (tmp_path / "config.json").write_text("{}")
    _one_line_error(
        _run("learn", "--learner.model", str(tmp_path)), "is not a model folder (no weights in it)"
    )
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    _one_line_error(_run("collect", "--learner.model", str(gguf), "--collector.tasks",
                         str(REPO / "tasks/demo.jsonl")), "sandpiper model import")  # fmt: skip


def test_a_store_url_with_an_unknown_scheme_or_no_server(tmp_path: Path) -> None:
    _one_line_error(
        _run("sql", "--store.url", "mysql://me:pw@h/db", "SELECT 1"),
        "store.url", "use duckdb:///path/store.duckdb or postgresql+psycopg://",
    )  # fmt: skip
    with socket.socket() as sock:  # a port nothing listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        line = _one_line_error(
            _run("sql", "--store.url", f"postgresql+psycopg://me:s3cret@127.0.0.1:{port}/db",
                 "SELECT 1"),
            "cannot reach the store", "is the server running",
        )  # fmt: skip
        # `store ... --url` replaces the config's URL, and the error names the one it tried
        line_init = _one_line_error(
            _run("store", "init", "--url", f"postgresql+psycopg://me:s3cret@127.0.0.1:{port}/db"),
            f"cannot reach the store postgresql+psycopg://me:***@127.0.0.1:{port}/db",
        )  # fmt: skip
    assert "s3cret" not in line + line_init and "me:***@" in line
    _one_line_error(
        _run("store", "stats", "--url", "redis://localhost/0"),
        "unsupported store URL", "use duckdb:///path or postgresql+psycopg://",
    )  # fmt: skip
    _one_line_error(
        _run("sql", "--store.url", f"duckdb:///{tmp_path}/none.duckdb", "SELECT 1"),
        "no store at", "sandpiper store init",
    )  # fmt: skip


def test_an_eval_endpoint_with_no_server_behind_it(tmp_path: Path) -> None:
    # Before the check, every episode was stored as a model_error and the command exited 0.
    with socket.socket() as sock:  # bound, never listening
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        _one_line_error(
            _run("collect", "--eval", "--endpoint", url, "--model", "m",
                 "--collector.tasks", str(REPO / "tasks/demo.jsonl"), "--runs_dir", str(tmp_path)),
            f"--endpoint = '{url}': nothing answers at", "is the model server running",
        )  # fmt: skip


def test_a_task_source_that_is_missing_or_empty(tmp_path: Path) -> None:
    _one_line_error(
        _run("collect", "--collector.tasks", str(tmp_path / "none.jsonl")),
        "collector.tasks", "no such file or folder", "sandpiper tasks import",
    )  # fmt: skip
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "empty").mkdir()
    for source in ("empty.jsonl", "empty"):
        _one_line_error(
            _run("collect", "--collector.tasks", str(tmp_path / source)), "is empty: no tasks"
        )
        _one_line_error(_run("tasks", "list", str(tmp_path / source)), "no tasks")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a\tb}\n')
    _one_line_error(
        _run("tasks", "list", str(tmp_path / "broken.jsonl")),
        "broken.jsonl:1: invalid JSON at column", "one JSON object a line",
    )  # fmt: skip
    for args in (["tasks", "import", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")],
                 ["tasks", "list", str(tmp_path / "empty.jsonl")]):  # fmt: skip
        _one_line_error(_run(*args), "SRC = ", "docs/tasks.md lists the formats")
    _one_line_error(
        _run("tasks", "list", str(REPO / "configs")),
        "no tasks found in",
        "a folder of task folders",
    )


def test_a_port_in_use(model_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        _one_line_error(
            _run("gateway", "--port", str(port), "--learner.model", str(model_dir)),
            f"port {port} on 127.0.0.1 is in use", "pick another",
        )  # fmt: skip
        line = _one_line_error(
            _run("collect", "--collector.tasks", str(REPO / "tasks/demo.jsonl"),
                 "--learner.model", str(model_dir), "--inference.base_port", str(port),
                 "--runs_dir", str(tmp_path)),
            "inference.base_port + 0 = ", "is in use",
        )  # fmt: skip
        assert "0 = any free port" not in line  # base_port refuses 0: do not offer it


def test_podman_or_the_sandbox_image_missing(model_dir: Path, tmp_path: Path) -> None:
    no_podman = {**os.environ, "PATH": str(tmp_path / "empty-path")}
    for args in (["sandbox", "ls"], ["sandbox", "check"]):
        _one_line_error(_run(*args, env=no_podman), "podman is not installed")
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed: the missing-image case needs it")
    _one_line_error(
        _run("collect", "--collector.tasks", str(REPO / "tasks/demo.jsonl"),
             "--learner.model", str(model_dir),
             "--inference.server_urls", '["http://127.0.0.1:9"]',
             "--sandbox.image", "localhost/sandpiper-no-such-image:1", "--runs_dir", str(tmp_path)),
        "sandbox.image = 'localhost/sandpiper-no-such-image:1' is not on this host",
        "sandpiper sandbox build-image",
    )  # fmt: skip


def test_a_disk_that_fills(store_url: str) -> None:
    # /dev/full answers every write with ENOSPC, as a full disk does.
    _one_line_error(
        _run("sql", "--format", "csv", "--out", "/dev/full", "--store.url", store_url,
             "SELECT 1 AS x"),
        "no space left on the device", "free some space",
    )  # fmt: skip


def test_an_out_folder_that_does_not_exist_yet_is_created(store_url: str, tmp_path: Path) -> None:
    out = tmp_path / "new" / "x.csv"
    done = _run("sql", "-f", "csv", "-o", str(out), "--store.url", store_url, "SELECT 1 AS x")
    assert done.returncode == 0, done.stderr
    assert out.read_text().split() == ["x", "1"]


def test_demo_options_out_of_range_are_refused_before_anything_starts() -> None:
    for option, value in (("--tasks", "0"), ("--compute-fraction", "3"), ("--minutes", "-1")):
        done = _run("demo", option, value)
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"Invalid value for '{option}'" in done.stderr
        assert "Traceback" not in done.stderr


def test_a_checkpoint_folder_that_cannot_be_written(model_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _one_line_error(
        _run("learn", "--learner.model", str(model_dir),
             "--learner.checkpoint_dir", str(blocker / "policies")),
        "learner.checkpoint_dir = ", "is not a folder this process can write",
    )  # fmt: skip


def test_a_run_name_taken_by_another_config(model_dir: Path, tmp_path: Path) -> None:
    from sandpiper.config import load_config
    from sandpiper.store import Store
    from sandpiper.store.records import RunRecord

    url = f"duckdb:///{tmp_path / 'store.duckdb'}"
    common = ["--name", "exp", "--store.url", url, "--runs_dir", str(tmp_path / "runs"),
              "--learner.model", str(model_dir)]  # fmt: skip
    first = load_config(None, [*common, "--collector.group_size", "4"])
    store = Store(url)
    store.init()
    store.ensure_run(RunRecord("exp", first.model_dump_json(), "test"))
    line = _one_line_error(
        _run("learn", *common, "--collector.group_size", "8"),
        "run 'exp' already exists", "collector.group_size = 4 (this config: 8)", "new --name",
    )  # fmt: skip
    assert "--verbose" not in line
    _one_line_error(
        _run("gateway", "--port", "0", *common, "--collector.group_size", "8"),
        "run 'exp' already exists", "new --name",
    )  # fmt: skip


def test_a_config_file_missing_or_an_override_without_value_says_what_to_write() -> None:
    _one_line_error(_run("config", "show", "-c", "configs/nope.toml"),
                    "config file not found: configs/nope.toml", "configs/ holds the shipped ones")  # fmt: skip
    _one_line_error(_run("sandbox", "check", "--nope"),
                    "override --nope has no value", "--part.field VALUE", "its --help")  # fmt: skip


def test_verbose_adds_the_traceback() -> None:
    for args in (["--verbose", "learn", "--learner.model", "/nonexistent"],
                 ["learn", "--learner.model", "/nonexistent", "--verbose"]):  # fmt: skip
        done = _run(*args)
        assert done.returncode == 1
        assert "Traceback (most recent call last)" in done.stderr
        assert "SetupError" in done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith("error: learner.model")


def test_options_overrides_and_arguments_in_any_order(store_url: str) -> None:
    orders = (
        ["sql", "--store.url", store_url, "SELECT 41 + 1 AS x", "--format", "csv"],
        ["sql", "SELECT 41 + 1 AS x", "--store.url", store_url, "--format", "csv"],
        ["sql", "--format=csv", f"--store.url={store_url}", "SELECT 41 + 1 AS x"],
        ["sql", "-f", "csv", "SELECT 41 + 1 AS x", "--store.url", store_url, "-v"],
    )
    for args in orders:
        done = _run(*args)
        assert done.returncode == 0, (args, done.stderr)
        assert done.stdout.split() == ["x", "42"], (args, done.stdout)
    line = _one_line_error(_run("sql", "--store.url", store_url, "SELECT 1", "stray"))
    assert "'stray'" in line


def test_split_overrides_leaves_a_commands_own_options_and_their_values() -> None:
    from sandpiper.commands._common import split_overrides

    own = {"--format": True, "-f": True, "--views": False, "--out": True}
    args = ["--out", "--name", "--name", "x", "q", "--learner.lr=1e-3", "--views", "--seed", "3",
            "--", "--learner.x", "1"]  # fmt: skip
    overrides, rest = split_overrides(args, own)
    assert overrides == ["--name", "x", "--learner.lr=1e-3", "--seed", "3"]
    assert rest == ["--out", "--name", "q", "--views", "--", "--learner.x", "1"]


@pytest.mark.parametrize(
    ("error", "phrase"),
    [
        (OSError(errno.ENOSPC, "No space left on device", "/runs/x"), "no space left on the device (/runs/x)"),
        (PermissionError(errno.EACCES, "Permission denied", "/ro/p"), "permission denied (/ro/p)"),
        (OSError(errno.EROFS, "Read-only file system", "/ro"), "permission denied (/ro)"),
        (OSError(errno.EADDRINUSE, "Address already in use"), "a port this command needs is in use"),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "podman"), "podman is not installed"),
        (RuntimeError("IO Error: No space left on device"), "no space left on the device"),
        # polars (Rust) leaves errno and filename empty and words them into the message
        (OSError("Read-only file system (os error 30): /ro/x.parquet"), "permission denied (/ro/x.parquet)"),
        (OSError("No space left on device (os error 28): /full/x"), "no space left on the device (/full/x)"),
    ],
)  # fmt: skip
def test_library_failures_of_the_setup_read_as_one_line(error: BaseException, phrase: str) -> None:
    from sandpiper.commands._failures import explain

    wrapped = RuntimeError("while saving the checkpoint")
    wrapped.__cause__ = error
    for exc in (error, wrapped):
        line = explain(exc)
        assert line is not None and phrase in line and "\n" not in line
    assert explain(ValueError("a bug")) is None
