"""Distinct host uid ranges for root podman containers (``--uidmap 0:BASE:65536``).

``--userns=auto`` deadlocks on podman 4.3.1 when containers are created concurrently, so
each container gets its own 65536-uid range picked here. Slot ``i`` covers host uids
``uid_base + i * 65536 …``; a slot is held with an exclusive ``flock`` on a lock file, so
several collectors on one host never share a range, and a crashed collector's slots free up
when its process dies. The whole span is registered for ``root`` in /etc/subuid and
/etc/subgid (idempotently), so other tools see it as taken.

The locks must be shared by every collector driving the same podman: under
``sandbox.host_state_dir`` (collectors in containers, each with its own ``/run``) they live in
that folder. The subid registration is then written into the collector's own /etc, where no
other tool of the host reads it (root podman's explicit ``--uidmap`` does not need it).

Rootless podman (not root, or ``rootless = "always"``) maps uids itself: no slots.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from sandpiper.config import SandboxConfig
from sandpiper.errors import SandboxError

UIDMAP_SIZE = 65536
LOCK_DIR = Path("/run/lock/sandpiper-uids")
"""Where the slots' lock files live without a ``sandbox.host_state_dir`` (:func:`lock_dir`)."""


def uses_uidmap(config: SandboxConfig) -> bool:
    """Root podman with explicit ranges, unless rootless podman is asked for."""
    return os.geteuid() == 0 and config.rootless != "always"


def register_subid_range(config: SandboxConfig, files=("/etc/subuid", "/etc/subgid")) -> None:
    """Add ``root:uid_base:span`` to /etc/subuid and /etc/subgid when missing."""
    line = f"root:{config.uid_base}:{config.uid_slots * UIDMAP_SIZE}"
    for name in files:
        path = Path(name)
        text = path.read_text() if path.exists() else ""
        if line not in text.splitlines():
            with path.open("a") as f:
                f.write(("" if not text or text.endswith("\n") else "\n") + line + "\n")


def lock_dir(config: SandboxConfig) -> Path:
    """The folder of the slots' lock files that every collector of this podman host sees."""
    if config.host_state_dir is not None:
        return Path(config.host_state_dir) / "uid-locks"
    return LOCK_DIR


class UidSlots:
    """Allocator of uid-range slots; ``base(slot)`` is the first host uid of a slot."""

    def __init__(self, config: SandboxConfig, lock_dir: Path | None) -> None:
        self.config = config
        self.lock_dir = lock_dir
        self._held: dict[int, int] = {}  # slot -> fd holding its flock

    @classmethod
    def for_host(cls, config: SandboxConfig) -> UidSlots:
        if not uses_uidmap(config):
            return cls(config, None)
        register_subid_range(config)
        locks = lock_dir(config)
        locks.mkdir(mode=0o700, parents=True, exist_ok=True)
        return cls(config, locks)

    def acquire(self) -> int:
        if self.lock_dir is None:
            return -1
        for slot in range(self.config.uid_slots):
            if slot in self._held:
                continue
            fd = os.open(self.lock_dir / f"{self.config.uid_base}-{slot}", os.O_CREAT | os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._held[slot] = fd
            return slot
        raise SandboxError(f"all {self.config.uid_slots} uid ranges are in use on this host")

    def base(self, slot: int) -> int | None:
        """First host uid of ``slot``; None under rootless podman."""
        return None if slot < 0 else self.config.uid_base + slot * UIDMAP_SIZE

    def release(self, slot: int) -> None:
        fd = self._held.pop(slot, None)
        if fd is not None:
            os.close(fd)  # closing drops the flock
