"""A collector that cannot read the folder the latest policy names refuses to start, and
says what to share."""

from __future__ import annotations

import pytest

from sandpiper.collector.daemon.launch import check_checkpoints_readable
from sandpiper.errors import ConfigError
from sandpiper.store.records import PolicyRecord
from sandpiper.testing import MemoryStore


def _store_with(latest: PolicyRecord | None) -> MemoryStore:
    store = MemoryStore()
    store.registered = [latest] if latest else []
    return store


def test_unreadable_checkpoint_folder_fails_with_what_to_share(tmp_path):
    check_checkpoints_readable(_store_with(None), "r")  # nothing registered yet: fine
    here = tmp_path / "v000001-t0001"
    here.mkdir()
    check_checkpoints_readable(_store_with(PolicyRecord("r", 1, str(here), 0, 1)), "r")
    elsewhere = PolicyRecord("r", 2, "/mnt/learner-host-only/v000002-t0001", 1, 2)
    with pytest.raises(ConfigError, match="shared filesystem") as err:
        check_checkpoints_readable(_store_with(elsewhere), "r")
    assert "learner.checkpoint_dir" in str(err.value) and "v000002-t0001" in str(err.value)
