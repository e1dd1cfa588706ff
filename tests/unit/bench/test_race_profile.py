"""Each side's CPU-seconds profile (bench/race_profile.py): which process counts where, what
an ended child leaves behind, the containers' cgroup usage, and the shares of cores x wall."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from race_profile import (
    CpuSampler,
    _Seen,
    cgroup_usage_s,
    sandpiper_role,
    shares,
    trl_role,
    trl_split,
)

COLLECT = "/venv/bin/python -m sandpiper.cli collect -c run/config.resolved.toml"
LEARN = "/venv/bin/python -m sandpiper.cli learn -c run/config.resolved.toml"


def test_sandpiper_processes_count_by_the_part_that_started_them() -> None:
    vllm = "/venv/bin/python -m vllm.entrypoints.openai.api_server --model m"
    assert sandpiper_role([LEARN]) == "training"
    assert sandpiper_role(["python -c compile", LEARN]) == "training"
    assert sandpiper_role([COLLECT]) == "other"
    assert sandpiper_role([vllm, COLLECT]) == "generation"
    assert sandpiper_role(["VLLM::EngineCore", vllm, COLLECT]) == "generation"
    assert sandpiper_role(["/usr/bin/podman exec -i box bash", COLLECT]) == "tools"
    assert sandpiper_role(["/usr/bin/conmon --api-version 1", COLLECT]) == "tools"
    # the sampler's own podman calls (children of the bench) are not the side's
    assert sandpiper_role(["podman ps -a -q"]) is None
    trl = "/trl-env/bin/python bench/race_trl.py spec.json"
    assert trl_role([trl]) == "other" and trl_role(["podman exec x", trl]) == "tools"
    assert trl_role(["podman ps -a"]) is None


def test_an_ended_child_is_counted_once() -> None:
    """A child sampled and then reaped by its sampled parent is in the parent's reaped
    seconds: counted at its own role as last seen, and only what no sample saw (its last
    second, children never sampled) at the parent's."""
    sampler = CpuSampler(root_pid=1, role_of=lambda chain: "other")
    sampler._seen = {
        (10, 0.0): _Seen("other", parent=1, own_s=5.0, reaped_s=3.5),  # the collector
        (11, 0.0): _Seen("generation", parent=10, own_s=20.0),  # vLLM, alive
        (12, 0.0): _Seen("tools", parent=10, own_s=1.0, alive=False),  # a podman call, ended
        (20, 0.0): _Seen("training", parent=1, own_s=30.0, reaped_s=2.0),  # the learner
    }
    cpu = sampler.cpu_s()
    # the collector reaped 3.5 s: 1.0 of the podman call seen, 2.5 never seen (its calls)
    assert cpu["by_role_s"] == {"generation": 20.0, "training": 32.0, "tools": 3.5, "other": 5.0}
    assert cpu["processes_s"] == pytest.approx(60.5) and cpu["containers_s"] == 0.0


def test_containers_count_from_their_cgroups_on_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "user.slice" / "libpod-abc.scope"
    v2.mkdir(parents=True)
    (v2 / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    assert cgroup_usage_s("/user.slice/libpod-abc.scope", root=tmp_path) == 2.5
    v1 = tmp_path / "cpu,cpuacct" / "libpod_parent" / "libpod-def"
    v1.mkdir(parents=True)
    (v1 / "cpuacct.usage").write_text("1250000000\n")
    assert cgroup_usage_s("/libpod_parent/libpod-def", root=tmp_path) == 1.25
    assert cgroup_usage_s("/nowhere", root=tmp_path) is None


def test_containers_add_to_tools(monkeypatch) -> None:
    import race_profile

    usage = {"/c1": 4.0, "/c2": 1.0}
    calls = {"ps": ["c1"]}

    def podman(*args: str) -> list[str]:
        if args[0] == "ps":
            assert "label=sandpiper.run=race-sandpiper" in args
            return calls["ps"]
        return [f"/{args[-1]}"]

    monkeypatch.setattr(race_profile, "_podman_lines", podman)
    monkeypatch.setattr(race_profile, "cgroup_usage_s", lambda path: usage[path])
    sampler = CpuSampler(root_pid=1, role_of=lambda c: None, run_label="race-sandpiper")
    sampler._sample_containers(baseline=True)  # c1 had used 4.0 s before the side started
    usage["/c1"], usage["/c2"], calls["ps"] = 6.5, 3.0, ["c1", "c2"]
    sampler._sample_containers()  # c2 started during the side: all of its 3.0 s count
    cpu = sampler.cpu_s()
    assert cpu["containers_s"] == pytest.approx(2.5 + 3.0) and cpu["containers"] == 2
    assert cpu["containers_unread"] == 0
    assert cpu["by_role_s"]["tools"] == pytest.approx(5.5)


BURN = textwrap.dedent(
    """
    import subprocess, sys, time
    def burn(s):
        t = time.process_time()
        while time.process_time() - t < s:
            pass
    burn(0.4)
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\n"
                    "while time.process_time() - t < 0.3: pass"])  # ended between samples
    time.sleep(1.0)
    """
)


def test_the_sampler_reads_a_real_process_tree() -> None:
    """A child that burns 0.4 s and runs a grandchild that burns 0.3 s and ends: both counted
    (the grandchild through its parent's reaped seconds), nothing of this test process."""

    def role(chain: list[str]) -> str | None:
        return "training" if "burn(0.4)" in chain[-1] else None

    import os

    sampler = CpuSampler(os.getpid(), role, interval_s=0.2).start()
    subprocess.run([sys.executable, "-c", BURN], check=True)
    cpu = sampler.stop()
    assert 0.65 <= cpu["by_role_s"]["training"] < 2.0, cpu
    assert cpu["by_role_s"]["other"] == 0.0 and cpu["wall_s"] > 1.0


def test_shares_of_cores_times_wall() -> None:
    profile = shares({"generation": 60.0, "training": 30.0, "tools": 10.0, "other": 20.0},
                     cores=2, wall_s=100.0)  # fmt: skip
    assert profile["capacity_cpu_s"] == 200.0 and profile["cpu_s"]["idle"] == 80.0
    assert profile["share"] == {"generation": 0.3, "training": 0.15, "tools": 0.05,
                                "other": 0.1, "idle": 0.4}  # fmt: skip
    assert sum(profile["share"].values()) == pytest.approx(1.0)
    over = shares({"training": 300.0}, cores=2, wall_s=100.0)
    assert over["cpu_s"]["idle"] == 0.0


def test_trl_splits_its_process_by_phase() -> None:
    """TRL's one process: generation and training from the step log's phase CPU seconds,
    the rest of its seconds (start-up, saves) other; its podman calls and containers tools."""
    total = {"by_role_s": {"generation": 0.0, "training": 0.0, "tools": 7.0, "other": 100.0}}
    steps = [{"generate_cpu_s": 20.0, "train_cpu_s": 30.0},
             {"generate_cpu_s": 10.0, "train_cpu_s": 25.0}]  # fmt: skip
    assert trl_split(total, steps) == {"generation": 30.0, "training": 55.0, "tools": 7.0,
                                       "other": 15.0}  # fmt: skip
