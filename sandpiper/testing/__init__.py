"""Test doubles and synthetic data, in one place: one fake per Protocol.

- :class:`FakeSandbox` (``ToolSandbox``): a temp folder standing in for a container;
  ``scripted=True`` answers ``ran: <command>`` instead of running anything.
- :class:`ScriptedPolicy` / :class:`ReloadablePolicy` (``PolicyClient``): canned replies with
  fake logprobs and versions.
- :class:`FakeToolbox` (``ToolRunner``), :class:`FakeStore` / :class:`FakeWriter` (the
  collector's store and writer), :class:`FakePool` (``Pool``).
- :class:`MemoryStore` (the learner's ``LearnerStore``): claims, leases and fences in memory.
- :func:`make_group` / :func:`expected_tokens`: deterministic synthetic ``GroupRecord``s for
  store tests and benchmarks.
- :mod:`sandpiper.testing.synthetic`: a whole synthetic run that looks like real collection
  (``synthetic_run``, ``populate``), for the analysis tests and trying the report.

Used by the project's tests and benchmarks and available to users testing their own task
formats or agents. The top layer: it imports the parts, no part imports it.
"""

from sandpiper.testing.collector import (
    FAKE_TOOL_SCHEMAS,
    FakePool,
    FakeStore,
    FakeToolbox,
    FakeWriter,
    ReloadablePolicy,
    ScriptedPolicy,
    scripted_sandbox,
)
from sandpiper.testing.groups import expected_tokens, make_group
from sandpiper.testing.learner import MemoryStore, to_train_group
from sandpiper.testing.sandbox import FakeSandbox

__all__ = [
    "FAKE_TOOL_SCHEMAS",
    "FakePool",
    "FakeSandbox",
    "FakeStore",
    "FakeToolbox",
    "FakeWriter",
    "MemoryStore",
    "ReloadablePolicy",
    "ScriptedPolicy",
    "expected_tokens",
    "make_group",
    "scripted_sandbox",
    "to_train_group",
]
