"""Stopping a collector on time whatever the store does.

A stop (SIGTERM, SIGINT) must end the collector within ``collector.drain_timeout_s`` even
when the store is down (PostgreSQL stopped), locked by another process (a DuckDB file held
elsewhere: every call waits ``store.lock_timeout_s``) or hung (a server that accepts and
never answers). Three things could hold it past that:

- a flush without a deadline (the writer retries a failing commit forever, by design: the
  groups are safe in the spool meanwhile). Every flush on the stop path here has one
  (:func:`flush_until_stopped` at start-up, :func:`final_commit` at the end), and a writer
  that still holds groups is not closed (closing flushes without a deadline): its groups
  stay in the spool and the next collector started on it commits them;
- a store call blocked in a thread: :func:`call_bounded` waits for it at most until the
  deadline, on a daemon thread;
- the interpreter's exit, which joins every thread of asyncio's default executor: a store
  call started with ``asyncio.to_thread`` before the stop (a poll, a heartbeat) and still
  blocked would hold the process for as long as the store does. :func:`run_process` (the
  ``sandpiper collect`` process) does not wait for them: once the collector has returned,
  it exits without joining threads that are still blocked (:func:`exit_now_if_stuck`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from sandpiper.errors import StoreError

if TYPE_CHECKING:
    from sandpiper.collector.daemon.store_role import CollectorStore
    from sandpiper.store.writer import GroupSink, GroupWriter

log = logging.getLogger(__name__)

T = TypeVar("T")


async def call_bounded(fn: Callable[..., T], *args: Any, timeout_s: float) -> T:
    """``fn(*args)`` on a daemon thread, waited for at most ``timeout_s`` (then
    :class:`TimeoutError`). A call blocked on a DuckDB lock or a hung server is abandoned
    (its thread ends with the call or with the process) instead of holding the stop."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # handed to the awaiting coroutine
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    name = f"bounded-{getattr(fn, '__name__', 'call')}"
    threading.Thread(target=run, name=name, daemon=True).start()
    return await asyncio.wait_for(asyncio.shield(done), max(timeout_s, 0.0))


async def flush_until_stopped(
    writer: GroupSink, stop: asyncio.Event, *, step_s: float = 1.0
) -> bool:
    """Commit what ``writer`` holds, retrying until it is committed (True) or ``stop`` is set
    (False: the groups stay in the spool). For start-up, where an unbounded flush would let
    a store that is down hold a SIGTERM forever."""
    while True:
        try:
            await asyncio.to_thread(writer.flush, step_s)
            return True
        except StoreError as e:
            if stop.is_set():
                log.warning("stopping before the spool was committed: %s", e)
                return False


async def unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> tuple[bool, T | None]:
    """``(True, result)`` of ``work``, or ``(False, None)`` when ``stop`` is set first (then
    ``work`` is cancelled; a thread it waits on is abandoned). For start-up steps that take
    minutes (vLLM servers, the sandbox pool's self-check) and store calls that may block (a
    slot claim waiting on a locked store): a SIGTERM then stops the collector at once."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False, None


async def final_commit(
    writer: GroupSink, store: CollectorStore, collector_id: str, deadline: float
) -> None:
    """Commit the spool and free the collector's unfinished task slots, both by ``deadline``
    (``time.monotonic()``). Groups not committed by then stay in the spool, said in one log
    line; their slots stay leased until the heartbeat lapses, then they are re-issued."""
    try:
        await asyncio.to_thread(writer.flush, max(deadline - time.monotonic(), 0.0))
    except StoreError as e:
        log.warning("stop: %s; the next collector started on this spool commits them", e)
        return
    try:
        # frees the slots of cancelled groups and unstarted leases for others at once
        freed = await call_bounded(
            store.slots.stop, collector_id, timeout_s=deadline - time.monotonic()
        )
    except Exception as e:  # the store failed or hung: the heartbeat TTL frees them
        log.warning(
            "stop: could not release this collector's task slots (%s); they are re-issued "
            "once its heartbeat lapses", str(e) or type(e).__name__,
        )  # fmt: skip
        return
    if freed:
        log.info("released %d unfinished task slots", freed)


def close_writer(writer: GroupWriter) -> None:
    """Close ``writer`` if it has committed everything; otherwise abandon it (closing would
    flush without a deadline): its groups stay in the spool and the spool is released."""
    left = writer.pending()
    if left:
        log.debug("leaving %d uncommitted groups in %s", left, writer.spool)  # said once
        writer.abandon()
        return
    writer.close()


def run_process(main: Callable[[asyncio.Event], Coroutine[Any, Any, T]]) -> T:
    """Run ``main(stop)`` in a new event loop, ``stop`` set by SIGTERM or SIGINT, and return
    its result without waiting for threads still blocked in the default executor (see the
    module docstring); call :func:`exit_now_if_stuck` when done with the result."""
    loop = asyncio.new_event_loop()
    executor = ThreadPoolExecutor(thread_name_prefix="asyncio")
    loop.set_default_executor(executor)
    try:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return loop.run_until_complete(main(stop))
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
            loop.close()


def stuck_threads() -> list[threading.Thread]:
    """Non-daemon threads still running besides the main one (the interpreter's exit would
    join them)."""
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]


def exit_now_if_stuck(code: int = 0) -> None:
    """Exit with ``code`` at once if threads are still blocked (in a store call), after
    flushing the logs and standard streams; return otherwise (a normal exit follows)."""
    deadline = time.monotonic() + 1.0  # idle executor threads are on their way out
    while (stuck := stuck_threads()) and time.monotonic() < deadline:
        stuck[0].join(timeout=0.05)
    if not stuck:
        return
    log.warning(
        "exiting without waiting for %d calls still blocked (%s)",
        len(stuck), ", ".join(t.name for t in stuck),
    )  # fmt: skip
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
