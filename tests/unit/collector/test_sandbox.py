"""Host-side pieces of the podman runtime that need no podman: flags, ranges, framing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from sandpiper.collector.sandbox.base import ExecOutcome, Sandbox
from sandpiper.collector.sandbox.client import PodmanSandbox, join_capped
from sandpiper.collector.sandbox.image_build import ImageRecipe
from sandpiper.collector.sandbox.isolation import container_argv
from sandpiper.collector.sandbox.uids import UidSlots, register_subid_range
from sandpiper.config import SandboxConfig
from sandpiper.errors import SandboxError
from sandpiper.testing import FakeSandbox


def test_container_argv_has_every_isolation_flag():
    cfg = SandboxConfig(memory_mb=300, cpus=0.5, pids_limit=99, workspace_size_mb=32)
    argv = container_argv(cfg, name="n", labels={"sandpiper.run": "r"}, uid_base=1_065_536)
    joined = " ".join(argv)
    for flag in ["--network=none", "--cap-drop=all", "--security-opt=no-new-privileges",
                 "--read-only", "--memory=300m", "--memory-swap=300m", "--cpus=0.5",
                 "--pids-limit=99", "--uidmap 0:1065536:65536", "--gidmap 0:1065536:65536",
                 "/workspace:rw,size=32m", "--label sandpiper.run=r"]:  # fmt: skip
        assert flag in joined, flag
    entry = argv[argv.index("--entrypoint") + 1]
    assert json.loads(entry) == ["/.sandpiper/catatonit", "-P"]
    assert argv[-1] == cfg.image


def test_rootless_has_no_uidmap():
    argv = container_argv(SandboxConfig(), name="n", labels={}, uid_base=None)
    assert "--uidmap" not in argv


def test_join_capped_marks_the_cut():
    assert join_capped(b"ab", b"cd", 4) == "abcd"
    assert join_capped(b"ab", b"yz", 30) == "ab\n[... 26 bytes of output omitted ...]\nyz"


def test_uid_slots_are_exclusive_across_allocators(tmp_path):
    cfg = SandboxConfig(uid_base=2_000_000, uid_slots=2)
    a, b = UidSlots(cfg, tmp_path), UidSlots(cfg, tmp_path)
    first, second = a.acquire(), b.acquire()
    assert {first, second} == {0, 1}
    assert a.base(first) != b.base(second)
    with pytest.raises(SandboxError, match="uid ranges are in use"):
        a.acquire()
    a.release(first)
    assert b.acquire() == first


def test_subid_registration_is_idempotent(tmp_path):
    files = (str(tmp_path / "subuid"), str(tmp_path / "subgid"))
    (tmp_path / "subuid").write_text("other:100000:65536")
    cfg = SandboxConfig(uid_base=1_000_000, uid_slots=4)
    register_subid_range(cfg, files)
    register_subid_range(cfg, files)
    assert (tmp_path / "subuid").read_text() == "other:100000:65536\nroot:1000000:262144\n"
    assert (tmp_path / "subgid").read_text() == "root:1000000:262144\n"


def test_recipe_hash_changes_with_the_recipe():
    assert ImageRecipe().digest() == ImageRecipe().digest()
    assert ImageRecipe().digest() != ImageRecipe(packages=("python3",)).digest()


def test_implementations_satisfy_the_protocol():
    fake = FakeSandbox()
    assert isinstance(fake, Sandbox)
    asyncio.run(fake.close())
    assert issubclass(PodmanSandbox, object) and hasattr(PodmanSandbox, "exec")
    assert ExecOutcome("oom_killed") is ExecOutcome.OOM_KILLED


def test_socket_paths_fit_a_unix_address_whatever_tmpdir(monkeypatch, tmp_path):
    """The host connects to ``socket_dir(name)/s``: a Unix socket address holds 107 bytes,
    so a long ``TMPDIR`` (a run folder deep in a checkout) must not push it past that."""
    import tempfile

    from sandpiper.collector.sandbox.host_state import SOCKET_NAME, socket_dir

    name = "sandpiper-0123456789ab"
    for tmp in (tmp_path, tmp_path / ("x" * 120)):
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        assert len(str(socket_dir(name, None) / SOCKET_NAME).encode()) <= 107
    monkeypatch.setattr(tempfile, "tempdir", "/tmp")
    assert socket_dir(name, None) == Path("/tmp/sandpiper-sockets") / name


def test_cgroup_removal_survives_another_collector_removing_the_same_folders(tmp_path, monkeypatch):
    """Two collectors on one host sweep at once (two pool starts; CI saw it): a folder that
    goes between listing and removal is gone, not an error that stops the pool's start."""
    import pathlib

    from sandpiper.collector.sandbox import host_state

    root = tmp_path / "cgroup"
    (root / "cpu" / "libpod_parent").mkdir(parents=True)
    for controller in ("cpu", "memory"):
        (root / controller / "sandpiper-abc" / "libpod-1").mkdir(parents=True)
    monkeypatch.setattr(host_state, "CGROUP_V1_ROOT", root)
    monkeypatch.setattr(host_state, "PODMAN_V1_PARENT", root / "cpu" / "libpod_parent")
    real_rglob = pathlib.Path.rglob

    def rglob_while_another_sweep_removes(self, pattern):
        if self.parent.name == "memory":  # the other collector removes it first
            (self / "libpod-1").rmdir()
            self.rmdir()
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real_rglob(self, pattern)

    monkeypatch.setattr(pathlib.Path, "rglob", rglob_while_another_sweep_removes)
    assert host_state.remove_cgroup_parent("sandpiper-abc") is False
    assert not (root / "cpu" / "sandpiper-abc").exists()
    assert not (root / "memory" / "sandpiper-abc").exists()
