"""The code version stored with every run (``runs.code_version``): one string for the
collector and the learner, so a reader can tell which release wrote a run."""

from __future__ import annotations


def code_version() -> str:
    """``sandpiper <version>`` of the installed package, ``sandpiper (unknown)`` from a bare
    source tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"sandpiper {version('sandpiper')}"
    except PackageNotFoundError:
        return "sandpiper (unknown)"
