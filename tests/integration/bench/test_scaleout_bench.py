"""``bench/scaleout_bench.py`` still runs (a smoke test with tiny phases against the session's
PostgreSQL; the figures themselves need a quiet machine and are not asserted). 13 s at load
average 5, 50 s at load average 23 on 2 cores (it spawns 5 writer processes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.integration.store.test_store import _fresh_pg_db

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def test_scaleout_bench_runs_and_prints_its_figures(postgres_url) -> None:
    cmd = [
        sys.executable, str(REPO / "bench" / "scaleout_bench.py"), "--json",
        "--url", _fresh_pg_db(postgres_url), "--seconds", "1", "--rounds", "1", "--batch", "2",
        "--turns", "2", "--tokens", "16",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["traj_per_s_1_writer"] > 0 and result["traj_per_s_4_writers"] > 0, result
    assert result["pg_writer_scaling"] > 0 and result["claims"] > 0, result
    assert result["claim_ms_p50_under_write"] > 0, result
    assert result["client_cpu_s_per_1k_traj_1_writer"] > 0, result
    assert result["server_cpu_s_per_1k_traj_1_writer"] is None  # not our server: not measured
