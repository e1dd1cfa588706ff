"""The ``sandpiper store`` commands, run as the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.dataset as ds
import pytest

from sandpiper.store import Store
from sandpiper.testing import make_group
from tests.conftest import REPO

pytestmark = pytest.mark.integration


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sandpiper.cli", "store", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_every_store_command_has_help():
    for name in ("init", "stats", "migrate", "export"):
        out = _cli(name, "--help")
        assert out.returncode == 0 and "--url" in out.stdout, out.stderr


def test_init_stats_migrate_export(tmp_path):
    url = f"duckdb:///{tmp_path / 's.duckdb'}"
    out = _cli("stats", "--url", url)
    assert out.returncode == 1 and "store init" in out.stderr
    assert _cli("init", "--url", url).returncode == 0
    assert "up to date" in _cli("migrate", "--url", url).stdout
    Store(url).write_groups([make_group("a", policy_version=0), make_group("b", policy_version=2)])
    stats = json.loads(_cli("stats", "--url", url).stdout)
    assert stats["rows"]["groups"] == 2 and stats["groups_by_status"] == {"ready": 2}
    out = _cli("export", "--url", url, "--parquet", str(tmp_path / "pq"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["turns"] == 2 * 4 * 3
    turns = ds.dataset(tmp_path / "pq" / "turns", partitioning="hive").to_table()
    assert sorted(set(turns["policy_version"].to_pylist())) == [0, 2]
