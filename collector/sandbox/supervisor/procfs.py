"""The kernel's small files, read cheaply: ``/proc`` and the container's memory cgroup
(how many of its processes the OOM killer took)."""

import os

OOM_CONTROL = "/sys/fs/cgroup/memory/memory.oom_control"
OOM_EVENTS_V2 = "/sys/fs/cgroup/memory.events"


def read_small(path: str) -> str:
    """A small kernel file (``/proc``, cgroup) in three system calls; ``open()`` makes
    seven (stat, isatty, seek...), and these are read several times per command."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536).decode()
    finally:
        os.close(fd)


def oom_kills() -> int:
    """OOM kills in this container so far (cgroup v1 or v2); -1 when neither says."""
    for path in (OOM_CONTROL, OOM_EVENTS_V2):
        try:
            text = read_small(path)
        except OSError:
            continue
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    return -1
