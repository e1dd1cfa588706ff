"""The durable group-sequence counter behind deterministic group ids ``run/task/seq``.

A group's ``seq`` is taken from a small JSON state file in the run directory, rewritten
atomically (temp file, fsync, rename, fsync of the directory) on every change, holding
``next_seq`` per task and the groups started but not yet acknowledged by the store writer.

Why this gives "no duplicate, no wrong skip" across crashes:

- ``start`` records the group as pending *before* any episode runs, so after a SIGKILL the
  restarted collector knows which sequence numbers were handed out.
- A pending group that the store already has (the crash came between the writer's
  acknowledgement and ``done``) is marked done on restart (``reconcile``); the writer's ingest
  is idempotent by group id anyway, so even a re-run would be stored once.
- A pending group that never reached the store is run again *with the same seq* (``start``
  hands pending seqs out first): no seq is skipped and none is reused for a committed group.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path


class SeqJournal:
    """Per-task sequence numbers with crash recovery (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.next_seq: dict[str, int] = {}
        self.pending: dict[str, tuple[str, int]] = {}
        """group_id -> (task_id, seq) of groups started and not acknowledged."""
        self._retry: dict[str, list[int]] = {}
        if self.path.exists():
            state = json.loads(self.path.read_text())
            self.next_seq = {k: int(v) for k, v in state["next_seq"].items()}
            self.pending = {g: (t, int(s)) for g, (t, s) in state["pending"].items()}
        for task_id, seq in self.pending.values():
            self._retry.setdefault(task_id, []).append(seq)
        for seqs in self._retry.values():
            seqs.sort()

    def reconcile(self, committed_group_ids: Iterable[str]) -> int:
        """Mark pending groups that the store already holds as done; returns how many."""
        committed = set(committed_group_ids) & set(self.pending)
        for group_id in committed:
            task_id, seq = self.pending.pop(group_id)
            self._retry[task_id].remove(seq)
        if committed:
            self._save()
        return len(committed)

    def peek(self, task_id: str) -> int:
        """The seq ``start(task_id)`` would hand out next."""
        retry = self._retry.get(task_id)
        return retry[0] if retry else self.next_seq.get(task_id, 0)

    def start(self, task_id: str, group_id_of) -> tuple[int, str]:
        """Hand out the next seq of ``task_id`` (a crashed group's first) and mark it pending.

        ``group_id_of(seq)`` builds the group id, so the journal stays agnostic of its format.
        """
        retry = self._retry.get(task_id)
        if retry:
            seq = retry.pop(0)
        else:
            seq = self.next_seq.get(task_id, 0)
            self.next_seq[task_id] = seq + 1
        group_id = group_id_of(seq)
        self.pending[group_id] = (task_id, seq)
        self._save()
        return seq, group_id

    def done(self, group_id: str) -> None:
        """The store writer acknowledged the group (durable): forget it."""
        if self.pending.pop(group_id, None) is not None:
            self._save()

    def abandon(self, group_id: str) -> None:
        """The group was cancelled before completion: hand its seq out again later."""
        entry = self.pending.get(group_id)
        if entry is not None:
            task_id, seq = entry
            self._retry.setdefault(task_id, []).append(seq)
            self._retry[task_id].sort()
            # it stays pending on disk so that a crash now also re-runs it

    def _save(self) -> None:
        state = {"next_seq": self.next_seq, "pending": self.pending}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
