"""What a sandbox may see of the host, and what a killed ``sandpiper sandbox check`` leaves.

- ``/proc/self/mountinfo`` in a sandbox names no path of the project's checkout: the
  supervisor and grader are mounted from content-addressed copies (``isolation.mounted_files``).
- A ``sandpiper sandbox check`` killed with SIGKILL mid-run leaves its container labelled as
  a check with an expiry: the janitor keeps it while the check could still be running and
  removes it after (not "unknown" for an hour).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.integration]


def test_mountinfo_names_no_host_checkout_path(sandbox_pool):
    from sandpiper.collector.sandbox.isolation import MOUNTED_FILES_ROOT, SUPERVISOR_DIR

    async def mountinfo() -> str:
        async with (
            sandbox_pool(pool_size=1) as pool,
            pool.session(episode_id="e", task_id="t") as box,
        ):
            r = await box.exec("cat /proc/self/mountinfo", timeout_s=10)
            assert r.ok, r
            return r.stdout

    text = asyncio.run(mountinfo())
    for path in {str(REPO), os.path.realpath(REPO)}:
        assert path not in text, [line for line in text.splitlines() if path in line]
    # the supervisor and grader are there, from the copies
    assert f" {SUPERVISOR_DIR} " in text
    assert str(MOUNTED_FILES_ROOT.name) in text


def _check_containers() -> list[dict]:
    from sandpiper.collector.sandbox.containers import list_containers

    return [
        {"name": c.name, "labels": c.labels, "info": c}
        for c in asyncio.run(list_containers({"sandpiper.purpose": "check"}))
    ]


def test_a_killed_sandbox_check_leaves_a_container_the_janitor_knows(sandbox_image, tmp_path):
    from sandpiper.collector.sandbox.check import CHECK_DEADLINE_S
    from sandpiper.collector.sandbox.containers import EXPIRES_LABEL, remove_containers_by_name
    from sandpiper.collector.sandbox.janitor import Verdict, judge

    before = {c["name"] for c in _check_containers()}
    log = tmp_path / "check.log"
    t0 = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandpiper.cli", "sandbox", "check"],
        cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    ours: list[dict] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            ours = [c for c in _check_containers() if c["name"] not in before]
            if ours:
                break
            time.sleep(0.2)
        assert ours, f"no check container appeared:\n{log.read_text()[-2000:]}"
        proc.send_signal(signal.SIGKILL)  # mid-run: its finally never runs
        proc.wait(timeout=30)
        (left,) = [c for c in _check_containers() if c["name"] not in before]
        expires = float(left["labels"][EXPIRES_LABEL])
        assert t0 + CHECK_DEADLINE_S - 5 <= expires <= time.time() + CHECK_DEADLINE_S
        info = left["info"]
        assert judge(info, store_id="s", live={}, grace_s=3600, now_s=time.time()) is (
            Verdict.CHECK_RUNNING
        )
        expired = judge(info, store_id="s", live={}, grace_s=3600, now_s=expires + 1)
        assert expired is Verdict.CHECK_EXPIRED and expired.orphan
    finally:
        if proc.poll() is None:
            proc.kill()
        names = [c["name"] for c in _check_containers() if c["name"] not in before]
        if names:
            asyncio.run(remove_containers_by_name(names, state_dir=None))
