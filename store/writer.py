"""``GroupWriter``: acknowledge a group once it is durable on local disk, commit in batches.

``put(group)`` writes the group into the spool directory (temp file, fsync, rename, fsync of
the directory) and returns: from then on the group survives a crash of this process. A
background thread commits spooled groups in batches — every ``flush_interval_s`` or as soon
as ``flush_max_episodes`` are waiting — each batch in one transaction (Arrow bulk insert,
whole groups only), and deletes the spool files after the commit. A writer started on the
same spool directory after a crash commits what it finds there; ingest is idempotent by
``group_id``, so a group committed just before the crash (spool file not yet deleted) is
stored once (reported ``replayed``).

``put`` checks and converts each group once (:func:`~sandpiper.store.to_arrow.checked_rows`:
the store's ingest check of :mod:`sandpiper.store.validation` on the converted buffers, so
episodes with unusable sampler output become invalid) and spools those rows; the commit
reads the rows back from the spool files and inserts them as they are, whether they were put
by this process or found in the spool after a restart (no ``GroupRecord`` is rebuilt for
the commit). ``on_outcome`` is told the group as checked (for a group read back after a
restart, rebuilt from its rows, and only when there is an ``on_outcome``).

Every group's outcome (:class:`~sandpiper.store.records.WriteOutcome`) is reported back through
``on_outcome(group, outcome)`` (called on the writer thread) and counted. A group the store
refuses — a ``duplicate`` id with other content or a ``superseded`` slot — is logged as an
error, counted in ``rejected_groups`` and moved to ``<spool>/rejected/`` (kept for
inspection, never retried, never silently dropped).

A spool file (``<sha1 of group_id>.group``) is one Arrow IPC stream holding the rows the
group becomes in the store's tables, in the store's Arrow schema, with a format version in
its metadata (:mod:`sandpiper.store.spool` describes the layout). It depends on no Python
class of this code, so an upgrade can always read what an earlier release acknowledged;
the previous release's files (pickles of the ``GroupRecord``) are still read, with an
allow-list of classes. A spool file that cannot be read (truncated, another format version,
not a spool file) never stops the writer: it is logged as an error, counted in
``rejected_groups`` and ``unreadable_files`` and moved to ``<spool>/rejected/``. Leftover
``*.tmp`` files were never acknowledged (``put`` had not returned) and are deleted.

One writer owns a spool directory at a time (a lock file inside it).

Its two typed faces: :class:`GroupSink`, what the collector and the standalone gateway write
groups to (``GroupWriter``, or the test fake ``sandpiper.testing.FakeWriter``), and
:class:`WriterStore`, what the writer needs of the store (``store.Store`` provides it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from filelock import FileLock, Timeout

from sandpiper.errors import StoreError
from sandpiper.store import dead as dead_letters
from sandpiper.store import spool as spool_format
from sandpiper.store import to_arrow
from sandpiper.store.records import GroupRecord, WriteOutcome, WriteReport, utcnow
from sandpiper.store.to_arrow import GroupRows

log = logging.getLogger(__name__)

RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
"""Waits between failed commits (the last repeats); the groups stay spooled meanwhile."""

OnOutcome = Callable[[GroupRecord, WriteOutcome], None]
"""Told each group's outcome once it is settled (called on the writer's thread)."""


class GroupSink(Protocol):
    """What the collector and the standalone gateway write groups to."""

    on_outcome: OnOutcome | None
    """Set by the collector before its first ``put``; None: nobody is told."""

    @property
    def spool(self) -> Path | None:
        """The folder holding the acknowledged groups; None for a sink without one."""
        ...

    def put(self, group: GroupRecord) -> None:
        """Acknowledge ``group``: from the return on it is durable and will be committed."""
        ...

    def pending(self) -> int:
        """Groups acknowledged but not committed yet."""
        ...

    def flush(self, timeout_s: float | None = None) -> None:
        """Commit everything acknowledged so far; raise if it is not done in ``timeout_s``."""
        ...

    def close(self) -> None:
        """Commit everything acknowledged, then stop."""
        ...


class WriterStore(Protocol):
    """What :class:`GroupWriter` needs of the store (``store.Store`` provides it)."""

    def default_spool_dir(self) -> str:
        """The spool folder when the writer is given none."""
        ...

    def write_groups_report(self, groups: Sequence[GroupRecord | GroupRows]) -> WriteReport:
        """Commit whole groups (records, or rows converted at ``put``) in one transaction;
        each group's outcome."""
        ...

    def ping(self) -> None:
        """Raise when the store cannot take writes now."""
        ...

    def record_dead_group(
        self,
        *,
        group_id: str,
        run_id: str,
        source: str,
        error: str,
        spool: bytes | None = None,
        collector_id: str | None = None,
    ) -> None:
        """List a group in ``dead_groups`` (one more attempt, the latest error)."""
        ...


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes | memoryview, *, tmp: Path) -> None:
    """Write ``data`` to ``tmp``, fsync it, rename it to ``path`` and fsync the folder: once
    this returns, ``path`` holds ``data`` whatever crash follows (what ``put`` acknowledges)."""
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


@dataclass(slots=True)
class _Spooled:
    """A group acknowledged and not committed yet: its spool file holds its rows."""

    group_id: str
    n_episodes: int
    path: Path
    group: GroupRecord | None
    """As checked by ``put`` (for ``on_outcome``); None when found in the spool at start."""
    rows: GroupRows | None = None
    """Kept only for a file of the release before format 1 (converted when read at start);
    the others' rows are read from their file at the commit (not held twice in memory)."""


_Item = tuple[_Spooled, GroupRows]
"""A group of a commit batch, with the rows the commit inserts."""


class GroupWriter:
    """Durable, batched, idempotent group writer (see module docstring). A context manager."""

    def __init__(
        self,
        store: WriterStore,
        *,
        flush_interval_s: float,
        flush_max_episodes: int,
        spool_dir: str | None,
        on_outcome: OnOutcome | None = None,
    ) -> None:
        self.store = store
        self.on_outcome = on_outcome
        self.flush_interval_s = flush_interval_s
        self.flush_max_episodes = flush_max_episodes
        self.spool: Path = Path(spool_dir or store.default_spool_dir())
        self.spool.mkdir(parents=True, exist_ok=True)
        self._owner = FileLock(str(self.spool / ".owner.lock"), thread_local=False)
        try:
            self._owner.acquire(timeout=0)
        except Timeout:
            raise StoreError(f"spool {self.spool} is in use by another writer") from None
        self._cond = threading.Condition()
        self._pending: dict[str, _Spooled] = {}
        self._pending_episodes = 0
        self._flush_requested = False
        self._closed = False
        self._abandoned = False
        self.last_error: BaseException | None = None
        self.committed_groups = 0
        """Groups newly stored by this writer (re-sent duplicates are not counted)."""
        self.replayed_groups = 0
        """Groups found already stored with the same episodes (a replayed spool)."""
        self.rejected_groups = 0
        """Groups the store refused (duplicate id or superseded slot) and spool files that
        could not be read (``unreadable_files``): errors, kept in ``<spool>/rejected/``."""
        self.unreadable_files = 0
        """Spool files found unreadable at start (also counted in ``rejected_groups``)."""
        self.dead_groups = 0
        """Groups set aside: the store failed on each alone while it took the others."""
        for path in sorted(self.spool.glob("*.group")):
            try:
                data = path.read_bytes()
                rows = spool_format.read(data)
            except spool_format.SpoolFormatError as e:
                self._quarantine_unreadable(path, e)
                continue
            legacy = data[:4] != b"\xff\xff\xff\xff"  # a pickle, converted just now
            self._pending[rows.group_id] = _Spooled(
                rows.group_id, rows.n_episodes, path, None, rows if legacy else None
            )
            self._pending_episodes += rows.n_episodes
        for tmp in self.spool.glob("*.tmp"):
            tmp.unlink()  # never acknowledged: put() had not returned
        spool_format.warm_up()  # before the first put() (see its docstring)
        self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self._thread.start()

    # ---- caller side -------------------------------------------------------------------------

    def put(self, group: GroupRecord) -> None:
        """Spool ``group`` durably and return (acknowledged); it is committed later."""
        if self._closed:
            raise StoreError("put() on a closed GroupWriter")
        name = hashlib.sha1(group.group_id.encode()).hexdigest()
        path = self.spool / f"{name}.group"
        with self._cond:
            if group.group_id in self._pending:
                return  # already acknowledged and waiting
        # checked and converted once (the ingest check logs here): the spool file holds the
        # rows the commit inserts, whether this process commits them or a restart does
        rows, group = to_arrow.checked_rows(group, utcnow())  # raises if the store cannot take it
        data = spool_format.encode_rows(rows)
        write_durably(path, data, tmp=self.spool / f"{name}.{threading.get_ident()}.tmp")
        with self._cond:
            self._pending[group.group_id] = _Spooled(group.group_id, rows.n_episodes, path, group)
            self._pending_episodes += rows.n_episodes
            self._cond.notify_all()  # starts the batch's clock, or commits a full batch now

    def pending(self) -> int:
        """Groups acknowledged but not committed yet."""
        with self._cond:
            return len(self._pending)

    def flush(self, timeout_s: float | None = None) -> None:
        """Commit everything acknowledged so far; raise if the commit keeps failing."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self._flush_requested = True
            self._cond.notify_all()
            while self._pending:
                if self.last_error is not None and not self._thread.is_alive():
                    raise StoreError(f"writer thread died: {self.last_error}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise StoreError(
                        f"{len(self._pending)} groups not committed after {timeout_s} s "
                        f"(last error: {self.last_error}); they stay in {self.spool}"
                    )
                self._cond.wait(timeout=0.1 if left is None else min(left, 0.1))

    def close(self) -> None:
        """Flush, stop the thread and release the spool."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join()
            self._owner.release()

    def abandon(self) -> int:
        """Stop without committing what is left (a stop whose deadline passed while the
        store does not answer): the groups stay in the spool, acknowledged, for the next
        writer on it; the spool is released at once. A commit already under way may still
        finish (its groups are then stored and their files removed). Returns the groups
        left uncommitted."""
        with self._cond:
            if self._closed:
                return len(self._pending)
            self._closed = self._abandoned = True
            left = len(self._pending)
            self._cond.notify_all()
        self._owner.release()
        return left

    def __enter__(self) -> GroupWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- background thread ------------------------------------------------------------------

    def _take_batch(self) -> list[_Spooled] | None:
        """Wait until a batch is due: ``flush_interval_s`` after the oldest waiting group came
        (or at once on a flush, a close or ``flush_max_episodes``); None when closed with
        nothing left. With nothing waiting it sleeps until :meth:`put` (or a flush, close or
        abandon) wakes it: a timeout that ran out with nothing pending spun a core."""
        with self._cond:
            due = time.monotonic() + self.flush_interval_s if self._pending else None
            while True:
                if self._abandoned:
                    return None
                if self._pending:
                    due = due if due is not None else time.monotonic() + self.flush_interval_s
                    if (
                        self._flush_requested
                        or self._closed
                        or self._pending_episodes >= self.flush_max_episodes
                        or time.monotonic() >= due
                    ):
                        self._flush_requested = False
                        return list(self._pending.values())
                elif self._closed:
                    return None
                self._cond.wait(timeout=None if due is None else max(0.0, due - time.monotonic()))

    def _run(self) -> None:
        failures = 0
        self._record_local_dead()  # dead letters a previous run could not list in the store
        while (taken := self._take_batch()) is not None:
            batch = self._rows_of(taken)
            if not batch or self._commit(batch):
                failures = 0
                self.last_error = None
                continue
            log.warning(
                "store commit failed (%s); retrying, %d groups stay spooled in %s",
                self.last_error, len(batch), self.spool,
            )  # fmt: skip
            time.sleep(RETRY_BACKOFF_S[min(failures, len(RETRY_BACKOFF_S) - 1)])
            failures += 1

    def _rows_of(self, taken: list[_Spooled]) -> list[_Item]:
        """The rows of each taken group, read from its spool file. A file gone or damaged
        under the writer: a group ``put`` by this process is converted again from memory;
        one found at start (nothing else holds it) is quarantined, like an unreadable file."""
        out: list[_Item] = []
        for s in taken:
            if s.rows is not None:
                out.append((s, s.rows))
                continue
            try:
                out.append((s, spool_format.read(s.path.read_bytes())))
            except (OSError, spool_format.SpoolFormatError) as e:
                if s.group is None:
                    self._quarantine_unreadable(s.path, e)
                    self._forget([s])
                    continue
                log.warning("spool file of %s unreadable (%s); committing it from memory",
                            s.group_id, e)  # fmt: skip
                out.append((s, to_arrow.checked_rows(s.group, utcnow())[0]))
        return out

    def _commit(self, batch: list[_Item]) -> bool:
        """Commit ``batch``; when that fails, split it and commit the halves, down to the one
        group that fails alone, which is set aside (:meth:`_set_aside`). False when the store
        itself is unavailable (nothing set aside; the caller backs off and retries)."""
        try:
            report = self.store.write_groups_report([rows for _, rows in batch])
        except Exception as e:
            self.last_error = e
            if not self._store_answers():
                return False
            if len(batch) == 1:
                return self._set_aside(batch[0], e)
            mid = len(batch) // 2
            return self._commit(batch[:mid]) and self._commit(batch[mid:])
        for item in batch:
            self._settle(item, report.outcomes.get(item[0].group_id, WriteOutcome.REPLAYED))
        self._forget([s for s, _ in batch])
        return True

    def _store_answers(self) -> bool:
        """Whether the store takes an empty write now (an outage is no reason to give up a
        group: only a group that fails while the store answers is set aside)."""
        try:
            self.store.ping()
        except Exception as e:
            log.debug("store does not answer: %s", e)
            return False
        return True

    def _set_aside(self, item: _Item, error: Exception) -> bool:
        """The group of ``item`` failed alone while the store answers: try it once more
        (a transient conflict), then move it to ``<spool>/dead/`` and ``dead_groups`` so
        that the groups behind it are committed (no poison pill)."""
        spooled, rows = item
        path = spooled.path
        try:
            report = self.store.write_groups_report([rows])
        except Exception as again:
            error = again
        else:
            self._settle(item, report.outcomes.get(rows.group_id, WriteOutcome.REPLAYED))
            self._forget([spooled])
            return True
        self.dead_groups += 1
        dead_dir = self.spool / "dead"
        dead_dir.mkdir(exist_ok=True)
        kept = dead_dir / path.name
        message = dead_letters.short_error(error)
        if path.exists():
            path.replace(kept)
        else:  # the file went missing: keep the rows the commit had
            write_durably(kept, spool_format.encode_rows(rows), tmp=dead_dir / "new.tmp")
        write_durably(kept.with_suffix(".error"), message.encode(), tmp=dead_dir / "err.tmp")
        _fsync_dir(self.spool)
        log.error(
            "group %s set ASIDE: the store failed on it alone (%s); the others are committed. "
            "Kept in %s and in the store's dead_groups; `sandpiper store retry-dead` "
            "re-submits it after a fix", rows.group_id, message, kept,
        )  # fmt: skip
        self._record_local_dead()
        self._forget([spooled])
        self._tell(item, WriteOutcome.DEAD)
        return True

    def _record_local_dead(self) -> None:
        """List ``<spool>/dead/`` files in the store's ``dead_groups`` and delete each one
        listed; what cannot be listed now stays on disk for the next try."""
        dead_dir = self.spool / "dead"
        for kept in sorted(dead_dir.glob("*.group")) if dead_dir.is_dir() else ():
            try:
                data = kept.read_bytes()
                group = spool_format.read(data)
                err = kept.with_suffix(".error")
                message = err.read_text("utf-8", "replace") if err.exists() else "unknown"
                self.store.record_dead_group(
                    group_id=group.group_id, run_id=group.run_id, source=dead_letters.WRITER,
                    error=message, spool=data, collector_id=group.collector_id,
                )  # fmt: skip
            except Exception as e:
                log.warning("dead letter %s not listed in the store yet (%s)", kept.name, e)
                return
            kept.unlink()
            kept.with_suffix(".error").unlink(missing_ok=True)

    def _forget(self, settled: list[_Spooled]) -> None:
        """Drop settled groups from the pending set (their files are gone or set aside)."""
        _fsync_dir(self.spool)
        with self._cond:
            for s in settled:
                if s.group_id in self._pending:
                    self._pending_episodes -= s.n_episodes
                    del self._pending[s.group_id]
            self._cond.notify_all()

    def _quarantine_unreadable(self, path: Path, error: Exception) -> None:
        """Move a spool file this release cannot read to ``rejected/`` (never retried)."""
        self.unreadable_files += 1
        rejected = self._reject(path)
        log.error("spool file %s is UNREADABLE (%s); moved to %s", path.name, error, rejected)
        _fsync_dir(self.spool)

    def _reject(self, path: Path) -> Path:
        """Count a rejected group and keep its spool file in ``rejected/`` (never retried)."""
        self.rejected_groups += 1
        rejected = self.spool / "rejected"
        rejected.mkdir(exist_ok=True)
        if path.exists():
            path.replace(rejected / path.name)
        return rejected

    def _settle(self, item: _Item, outcome: WriteOutcome) -> None:
        """Count and report one committed group's outcome; clear (or quarantine) its file."""
        spooled, _ = item
        if outcome is WriteOutcome.STORED:
            self.committed_groups += 1
        elif outcome is WriteOutcome.REPLAYED:
            self.replayed_groups += 1
        else:
            rejected = self._reject(spooled.path)
            log.error(
                "group %s REFUSED by the store (%s); kept in %s",
                spooled.group_id, outcome, rejected,
            )  # fmt: skip
        spooled.path.unlink(missing_ok=True)
        self._tell(item, outcome)

    def _tell(self, item: _Item, outcome: WriteOutcome) -> None:
        """``on_outcome`` of one settled group: the group as ``put`` checked it, or, for one
        found in the spool at start, rebuilt from its rows (only here, only with a callback)."""
        if self.on_outcome is None:
            return
        spooled, rows = item
        try:
            group = spooled.group if spooled.group is not None else spool_format.group_of(rows)
            self.on_outcome(group, outcome)
        except Exception:  # a broken callback must not stop commits
            log.exception("on_outcome callback failed for %s", spooled.group_id)
