"""The learner's side of leadership: wait as a hot standby, then keep the lease renewed.

Only rank 0 talks to the store. :func:`wait_for_leadership` keeps every rank in step while
rank 0 polls the run's lease (one small broadcast per poll, so the other ranks never sit in
a collective long enough for it to time out). Once in charge, a :class:`LeaseKeeper` thread
on rank 0 renews the lease every third of ``leader_lease_s``, so a long training step never
lets it lapse; if the store says another learner took over, the keeper records why and the
learner stops at its next store call (which the store would refuse anyway: the term fences
it). See docs/scaleout.md, "Learner leadership".
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from datetime import UTC, datetime
from typing import Any

from sandpiper.errors import NotLeaderError, StoreError
from sandpiper.store.records import Fence
from sandpiper.trainer.engine import broadcast_from_main

log = logging.getLogger("sandpiper.learner")


def new_learner_id() -> str:
    """``host:pid:start:random``: unique per process, also across hosts and PID namespaces."""
    return f"{socket.gethostname()}:{os.getpid()}:{int(time.time())}:{secrets.token_hex(3)}"


def wait_for_leadership(
    store: Any, *, run_id: str, learner_id: str, lease_s: float, poll_s: float, world: Any
) -> Fence:
    """Block until this learner holds the run's lease; every rank returns the same fence."""
    waiting_for: tuple[str, int] | None = None
    while True:
        state = None
        if world.is_main:
            # A read first: a standby must not take the (DuckDB) write lock at every poll.
            lease = store.leases.current(run_id)
            if lease is None or lease.expires_at <= datetime.now(UTC):
                lease = store.leases.acquire(run_id=run_id, learner_id=learner_id, lease_s=lease_s)
            state = (lease.held, lease.learner_id, lease.term, str(lease.expires_at))
        held, holder, term, expires = broadcast_from_main(state, world)
        if held:
            if world.is_main:
                log.info("learner %s is in charge of run %s (term %d)", learner_id, run_id, term)
            return Fence(run_id, learner_id, term)
        if world.is_main and waiting_for != (holder, term):
            log.info(
                "standby: run %s is led by learner %s (term %d, lease until %s); learner %s "
                "waits and takes over from the last registered version if that lease lapses",
                run_id, holder, term, expires, learner_id,
            )  # fmt: skip
            waiting_for = (holder, term)
        time.sleep(poll_s)


class LeaseKeeper:
    """Renews the lease in a daemon thread (rank 0); ``lost`` says why leadership ended."""

    def __init__(self, store: Any, fence: Fence, *, lease_s: float) -> None:
        self.store, self.fence, self.lease_s = store, fence, lease_s
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.store.leases.renew(self.fence, lease_s=self.lease_s)
            except NotLeaderError as e:
                self.lost = str(e)
                log.error("%s", e)
                return
            except StoreError as e:  # e.g. the DuckDB lock was busy: try again soon
                log.warning("could not renew the learner lease (will retry): %s", e)

    def check(self) -> None:
        """Raise :class:`NotLeaderError` once the keeper learnt that another learner leads."""
        if self.lost is not None:
            raise NotLeaderError(self.lost)

    def close(self, *, release: bool) -> None:
        """Stop renewing; with ``release`` let the lease lapse now so a standby takes over."""
        self._stop.set()
        self._thread.join(timeout=30)
        if release and self.lost is None:
            try:
                self.store.leases.release(self.fence)
            except StoreError as e:
                log.warning("could not release the learner lease: %s", e)
