"""The janitor's verdict on ``sandpiper sandbox check`` containers (labelled with an expiry)."""

from __future__ import annotations

from sandpiper.collector.sandbox.containers import EXPIRES_LABEL, PURPOSE_LABEL, ContainerInfo
from sandpiper.collector.sandbox.janitor import Verdict, judge

NOW = 1_000_000.0


def _box(labels: dict[str, str], created_s: float = NOW - 10) -> ContainerInfo:
    return ContainerInfo("c", "running", "", {"sandpiper.managed": "1", **labels}, created_s)


def test_a_check_container_is_kept_until_its_expiry_then_removed():
    box = _box({PURPOSE_LABEL: "check", EXPIRES_LABEL: str(int(NOW + 60))})
    running = judge(box, store_id="s", live={}, grace_s=3600, now_s=NOW)
    expired = judge(box, store_id="s", live={}, grace_s=3600, now_s=NOW + 61)
    assert running is Verdict.CHECK_RUNNING and not running.orphan
    assert expired is Verdict.CHECK_EXPIRED and expired.orphan


def test_an_older_check_container_without_expiry_goes_by_its_age():
    box = _box({PURPOSE_LABEL: "check"}, created_s=NOW - 100)
    assert judge(box, store_id="s", live={}, grace_s=3600, now_s=NOW) is Verdict.CHECK_RUNNING
    assert judge(box, store_id="s", live={}, grace_s=50, now_s=NOW) is Verdict.CHECK_EXPIRED


def test_a_collector_label_wins_over_a_purpose_label():
    """A collector's container cannot pass as a check to dodge (or hasten) the janitor."""
    box = _box({PURPOSE_LABEL: "check", EXPIRES_LABEL: "0", "sandpiper.collector": "h:1:2:3"})
    assert judge(box, store_id="s", live={"h:1:2:3": True}, grace_s=3600, now_s=NOW) is (
        Verdict.LIVE
    )
