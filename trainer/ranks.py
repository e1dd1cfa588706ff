"""Keeping the ranks in step without a collective that waits.

A collective that one rank enters long before another fails once it has waited for the
process group's timeout (``learner.collective_timeout_s``; DeepSpeed's default is 10
minutes), and under NCCL the early rank spins a GPU kernel all that while. In the learner,
rank 0 alone does the long waits: it polls the store for a batch (for hours when the
collector is slow), waits for the lease as a standby, writes the weights, registers the
version, prunes old checkpoints. A heartbeat of collectives would keep the early ranks
alive but spinning; instead, before every collective that ranks may reach far apart, each
rank *announces* itself in the process group's key-value store (rank 0's TCPStore, served by
its own thread, so a busy rank 0 still answers) and polls it, sleeping in between, until
every rank has arrived. No rank enters the collective before all are at it, so the
collective itself never waits longer than it takes to run, whatever the wait before it, and
under gloo and NCCL alike. Waiting costs one small store request per poll (at most every
:data:`MAX_POLL_S`), no collective.

A rank that fails with an exception says so in the store (:func:`mark_failed`); the others
then stop waiting for it and raise. A rank killed outright cannot: the launcher
(``deepspeed``, ``torchrun``) stops the others when one of its processes dies.

Each call must be made by every rank in the same order (as collectives are): the n-th call
on every rank meets at key ``n``.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any

MAX_POLL_S = 0.05
"""The longest sleep between two polls of the store (the extra latency of a meeting)."""

_PREFIX = "sandpiper/ranks/"
_FAILED = "failed"
_calls = itertools.count()


def _store() -> Any:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    # The process group's own rendezvous store (private in torch 2.13, stable since 1.x;
    # tests/unit/trainer/test_ranks.py holds it to the pinned version).
    return dist.PrefixStore(_PREFIX, _get_default_store())


def arrive_together(world_size: int, *, rank: int) -> None:
    """Return once every rank of the default group has called this (the n-th time)."""
    if world_size == 1:
        return
    from sandpiper.errors import LearnerError

    store = _store()
    n = next(_calls)
    key = f"arrived/{n}"
    store.add(key, 1)
    pause = 0.001
    while store.add(key, 0) < world_size:
        if store.check([_FAILED]):
            failed = store.get(_FAILED).decode()
            raise LearnerError(f"rank {failed} failed; rank {rank} stops waiting for it")
        time.sleep(pause)
        pause = min(pause * 2, MAX_POLL_S)
    if rank == 0 and n > 0:  # everybody passed meeting n, hence n - 1: nobody reads it again
        store.delete_key(f"arrived/{n - 1}")


def reset() -> None:
    """Start counting meetings afresh (a new process group: every rank calls this once)."""
    global _calls
    _calls = itertools.count()


def mark_failed(rank: int) -> None:
    """Tell the other ranks (waiting in :func:`arrive_together`) that this one failed."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with contextlib.suppress(Exception):  # the store is rank 0's: gone when rank 0 is
        _store().set(_FAILED, str(rank))
