"""Checkpoint retention: which policy folders the learner in charge may delete, and deleting.

A registered version is kept when any of these holds (config ``learner.checkpoint_*``):

- it is version 0 (the reference model of the KL term and the run's starting point);
- it is one of the last ``checkpoint_keep_last`` versions (the latest is always among them);
- ``checkpoint_keep_every`` > 0 and the version is a multiple of it;
- it is still referenced by work in flight: at or after the oldest ``min_policy_version`` of
  the run's groups that are READY or CLAIMED (sampled but not yet consumed);
- a collector of the run serves it or is loading it: every collector announces the version
  in its heartbeat row (``collectors.policy_version``) *before* it reloads, and its
  reference counts while it has not stopped and its heartbeat is younger than
  ``collector.heartbeat_ttl_s + checkpoint_grace_s`` (a collector that is only slow keeps
  its version; a dead one's reference lapses after that);
- its successor was registered less than ``checkpoint_grace_s`` ago: this covers the moment
  between a collector reading the latest version and announcing it;
- it is the newest version with a training state (``train_state/``, written every
  ``learner.train_state_every`` versions): the one a restarted learner resumes from.

Only that newest version with a training state keeps it (the optimiser moments and RNG a
learner resumes from, :mod:`.resume`): vLLM and the KL reference read weights only. An older
kept version loses that folder at the first prune after a newer one got its own; with Adam
that is two thirds of a float32 folder (SmolLM2-135M: 2.5 GB a version with it, 0.6 GB
without), which at a version a minute and a 10-minute grace filled a 50 GB disk within the
hour.

Everything else that the retention may delete lies inside the checkpoint dir (a registered
``checkpoint_uri`` elsewhere, such as an initial model, is never touched). Folders of terms
older than the current one that were never registered (a deposed learner's work) and their
temporary folders are deleted too; the current term's own folders are left alone. A folder is
renamed out of the way before it is removed, so nobody sees a half-deleted checkpoint under
its name. The policy rows stay: the history of versions remains queryable.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sandpiper.store.records import PolicyRecord, utcnow
from sandpiper.trainer.checkpoint import FOLDER_RE
from sandpiper.trainer.resume import STATE_DIR, newest_with_state

log = logging.getLogger("sandpiper.learner")


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    keep_last: int
    keep_every: int
    grace_s: float
    collector_ttl_s: float = 60.0
    """``collector.heartbeat_ttl_s``: with ``grace_s``, how long a silent collector's
    announced version stays protected."""


def versions_to_keep(
    policies: Iterable[PolicyRecord],
    rule: RetentionPolicy,
    *,
    in_flight_from: int | None,
    now: datetime,
    referenced: Iterable[int] = (),
    resume_from: int | None = None,
) -> set[int]:
    """The registered versions that must stay (see the module docstring); ``referenced``:
    versions live collectors announced; ``resume_from``: the newest version with a
    training state."""
    ordered = sorted(policies, key=lambda p: p.version)
    if not ordered:
        return set()
    versions = [p.version for p in ordered]
    keep = {0, *versions[-max(rule.keep_last, 1) :]}
    if resume_from is not None:
        keep.add(resume_from)
    if rule.keep_every > 0:
        keep |= {v for v in versions if v % rule.keep_every == 0}
    if in_flight_from is not None:
        keep |= {v for v in versions if v >= in_flight_from}
    keep |= set(referenced) & set(versions)
    grace = timedelta(seconds=rule.grace_s)
    for p, successor in itertools.pairwise(ordered):
        if now - successor.created_at < grace:
            keep.add(p.version)
    return keep


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def _remove(folder: Path, trash: Path) -> None:
    """Rename ``folder`` to ``trash`` (a ``.trash-`` name in the checkpoint dir), then delete
    it: a crash in between leaves trash the next prune removes, never a half-deleted folder
    under its own name."""
    folder.rename(trash)
    shutil.rmtree(trash)


def _strip_train_state(
    policies: list[PolicyRecord], keep: set[int], root: Path, resume_from: int | None
) -> int:
    """Delete ``train_state/`` of every kept version but ``resume_from`` (the newest that has
    one); returns how many."""
    stripped = 0
    for p in policies:
        state = Path(p.checkpoint_uri) / STATE_DIR
        if p.version == resume_from or p.version not in keep or not state.is_dir():
            continue
        if not _inside(state, root):
            continue
        try:
            _remove(state, root / f".trash-{state.parent.name}-{STATE_DIR}")
        except OSError as e:
            log.warning("could not delete the training state of v%d: %s", p.version, e)
            continue
        stripped += 1
    return stripped


def prune_checkpoints(
    store,
    *,
    run_id: str,
    checkpoint_dir: Path,
    term: int,
    rule: RetentionPolicy,
    now: datetime | None = None,
) -> list[Path]:
    """Delete the folders retention allows and the training state of every version but the
    newest that has one; returns the folders deleted (call as the leader)."""
    now = now or utcnow()
    policies = store.policy_versions.all(run_id)
    newest_state = newest_with_state(policies)
    resume_from = None if newest_state is None else newest_state.version
    referenced = store.slots.referenced_versions(
        run_id=run_id, within_s=rule.collector_ttl_s + rule.grace_s
    )
    keep = versions_to_keep(
        policies, rule, in_flight_from=store.policy_versions.oldest_in_flight(run_id), now=now,
        referenced=referenced, resume_from=resume_from,
    )  # fmt: skip
    registered = {Path(p.checkpoint_uri).resolve() for p in policies}
    doomed = [
        Path(p.checkpoint_uri)
        for p in policies
        if p.version not in keep and _inside(Path(p.checkpoint_uri), checkpoint_dir)
    ]
    if checkpoint_dir.is_dir():
        for child in checkpoint_dir.iterdir():
            m = FOLDER_RE.match(child.name)
            if m and int(m["term"]) < term and child.resolve() not in registered:
                doomed.append(child)  # a deposed learner's unregistered work
            elif child.name.startswith(".trash-"):  # a deletion interrupted by a crash
                shutil.rmtree(child, ignore_errors=True)
    deleted = []
    for folder in doomed:
        if not folder.exists():
            continue
        try:
            _remove(folder, folder.with_name(f".trash-{folder.name}"))
        except OSError as e:  # another process removed it first, or a permission problem
            log.warning("could not delete old checkpoint %s: %s", folder, e)
            continue
        deleted.append(folder)
    if deleted:
        log.info("retention: deleted %d old checkpoint folder(s)", len(deleted))
    if stripped := _strip_train_state(policies, keep, checkpoint_dir, resume_from):
        log.info("retention: deleted the training state of %d older version(s)", stripped)
    return deleted
