"""``sandbox.host_state_dir``: a collector in a container driving the host's podman through its
socket hands podman only bind sources in the folder shared at the same path on both sides, and
keeps there what every collector of that podman host must share (no podman needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from sandpiper.collector.sandbox import check, host_state, isolation, uids
from sandpiper.config import SandboxConfig


def _volume_sources(argv: list[str]) -> list[str]:
    return [argv[i + 1].split(":")[0] for i, arg in enumerate(argv) if arg == "--volume"]


def test_every_bind_source_lies_in_the_shared_folder(short_tmp_path):
    shared = short_tmp_path / "srv"  # its sockets' paths must fit a Unix socket address
    catatonit = short_tmp_path / "image-catatonit"  # the collector image's own, not on the host
    catatonit.write_bytes(b"\x7fELF static init")
    config = SandboxConfig(host_state_dir=str(shared), catatonit_path=str(catatonit))
    name = "sandpiper-0123456789ab"
    host_state.make_socket_dir(name, None, config.host_state_dir)
    argv = isolation.container_argv(config, name=name, labels={}, uid_base=1_065_536)

    sources = _volume_sources(argv)
    assert len(sources) == 3  # catatonit, the supervisor's folder, the shell's socket folder
    assert all(source.startswith(f"{shared}/") for source in sources), sources
    copy = next(s for s in sources if s.endswith("/catatonit"))
    assert Path(copy).read_bytes() == catatonit.read_bytes()
    assert "--cgroup-parent" not in argv  # the host's cgroup tree is not visible in a container
    assert host_state.socket_dir(name, config.host_state_dir).is_dir()
    assert uids.lock_dir(config) == shared / "uid-locks"
    assert check.cache_dir(config) == shared / "checks"


def test_without_it_the_podman_hosts_own_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(isolation, "MOUNTED_FILES_ROOT", tmp_path / "files")
    config = SandboxConfig()
    argv = isolation.container_argv(config, name="sandpiper-x", labels={}, uid_base=None)
    assert _volume_sources(argv)[0] == config.catatonit_path
    assert uids.lock_dir(config) == uids.LOCK_DIR and check.cache_dir(config) == check.CACHE_DIR


@pytest.mark.parametrize("bad", ["relative/dir", "/" + "x" * 60])
def test_the_folder_is_absolute_and_short_enough_for_a_socket_address(bad):
    with pytest.raises(ValidationError, match="107 bytes"):
        SandboxConfig(host_state_dir=bad)
