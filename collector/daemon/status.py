"""Collector metrics: a rolling window, a live status line (rich) and a JSONL metrics file.

Every ``status_interval_s`` the daemon calls :meth:`CollectorMetrics.snapshot`, which
returns one flat dict (rates over the last interval, totals since start) that is appended
to the metrics file and rendered as the status line::

    v3 lag 1 | 2.4 ep/s 310 tok/s | reward 0.41 (valid 98%) | in flight 16 ep, queue 12 grp
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from sandpiper.store.records import EpisodeRecord, GroupRecord, Split


@dataclass(slots=True)
class CollectorMetrics:
    """Counters updated by the daemon; ``snapshot`` turns them into rates."""

    started_s: float = field(default_factory=time.monotonic)
    episodes_total: int = 0
    groups_total: int = 0
    """Groups the store reported newly stored (the only ones counted as done)."""
    groups_rejected: int = 0
    """Groups the store refused (duplicate id, superseded slot): errors, see the log."""
    groups_dead: int = 0
    """Groups set aside: the store failed on each alone (``sandpiper store dead``)."""
    invalid_total: int = 0
    completion_tokens_total: int = 0
    policy_version: int = 0
    unconsumed_groups: int = 0
    """Train groups written but not consumed by the learner (plus those in flight)."""
    episodes_in_flight: int = 0
    reloads: int = 0
    validation_reward_mean: float | None = None
    validation_version: int | None = None
    _window_rewards: list[float] = field(default_factory=list)
    _window_valid: list[bool] = field(default_factory=list)
    _window_min_versions: list[int] = field(default_factory=list)
    _last_s: float = field(default_factory=time.monotonic)
    _last_episodes: int = 0
    _last_tokens: int = 0

    def add_group(self, group: GroupRecord) -> None:
        self.groups_total += 1
        for episode in group.episodes:
            self._add_episode(episode, train=group.split is Split.TRAIN)

    def _add_episode(self, episode: EpisodeRecord, *, train: bool) -> None:
        self.episodes_total += 1
        self.completion_tokens_total += episode.completion_tokens
        if not episode.valid:
            self.invalid_total += 1
        if not train:
            return
        self._window_valid.append(episode.valid)
        if episode.reward is not None:
            self._window_rewards.append(episode.reward)
        versions = episode.policy_version_range
        if versions is not None:
            self._window_min_versions.append(versions[0])

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        dt = max(now - self._last_s, 1e-9)
        rewards, valid = self._window_rewards, self._window_valid
        oldest = min(self._window_min_versions, default=None)
        snap = {
            "time_s": round(now - self.started_s, 3),
            "policy_version": self.policy_version,
            "lag_versions": None if oldest is None else self.policy_version - oldest,
            "episodes_per_s": (self.episodes_total - self._last_episodes) / dt,
            "tokens_per_s": (self.completion_tokens_total - self._last_tokens) / dt,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "valid_fraction": sum(valid) / len(valid) if valid else None,
            "episodes_total": self.episodes_total,
            "groups_total": self.groups_total,
            "groups_rejected": self.groups_rejected,
            "groups_dead": self.groups_dead,
            "invalid_total": self.invalid_total,
            "episodes_in_flight": self.episodes_in_flight,
            "unconsumed_groups": self.unconsumed_groups,
            "reloads": self.reloads,
            "validation_reward_mean": self.validation_reward_mean,
            "validation_version": self.validation_version,
        }
        self._last_s, self._last_episodes = now, self.episodes_total
        self._last_tokens = self.completion_tokens_total
        self._window_rewards, self._window_valid, self._window_min_versions = [], [], []
        return snap


def status_line(snap: dict[str, Any]) -> str:
    reward = "-" if snap["reward_mean"] is None else f"{snap['reward_mean']:.3f}"
    valid = "-" if snap["valid_fraction"] is None else f"{100 * snap['valid_fraction']:.0f}%"
    lag = "-" if snap["lag_versions"] is None else str(snap["lag_versions"])
    return (
        f"v{snap['policy_version']} lag {lag} | {snap['episodes_per_s']:.2f} ep/s "
        f"{snap['tokens_per_s']:.0f} tok/s | reward {reward} (valid {valid}) | "
        f"in flight {snap['episodes_in_flight']} ep, queue {snap['unconsumed_groups']} grp | "
        f"total {snap['episodes_total']} ep"
        + (f" | DEAD {snap['groups_dead']} grp" if snap.get("groups_dead") else "")
        + (f" | REFUSED {snap['groups_rejected']} grp" if snap.get("groups_rejected") else "")
    )


class StatusReporter:
    """Appends snapshots to the metrics file and shows the status line (live on a TTY)."""

    def __init__(self, metrics_path: str | Path, *, live: bool | None = None) -> None:
        from rich.console import Console

        self.path = Path(metrics_path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = self.path.open("a")
        self.console = Console(stderr=True)
        self._live = None
        if live if live is not None else self.console.is_terminal:
            from rich.live import Live

            self._live = Live("starting…", console=self.console, auto_refresh=False)
            self._live.start()

    def report(self, snap: dict[str, Any]) -> None:
        self._file.write(json.dumps(snap) + "\n")
        self._file.flush()
        line = status_line(snap)
        if self._live is not None:
            self._live.update(line, refresh=True)
        else:
            self.console.print(line, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
        self._file.close()
