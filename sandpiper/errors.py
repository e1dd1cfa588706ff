"""The one exception hierarchy of the project.

Every project exception derives from :class:`SandpiperError` and also from the built-in it
resembles, so callers can catch either ``SandpiperError`` or, say, ``TimeoutError``.
Collector, store, trainer and analysis all import from here (a leaf module with no imports).
"""


class SandpiperError(Exception):
    """Base class of every error raised on purpose by Sandpiper."""


class ConfigError(SandpiperError, ValueError):
    """A config file or override is malformed or names a field that does not exist."""


class SetupError(SandpiperError, RuntimeError):
    """The host is not ready for what the config asks: a model folder or task source that is
    missing, a port in use, podman or the sandbox image missing, a folder that cannot be
    written, a full disk. The message says what to do."""


class StoreError(SandpiperError, RuntimeError):
    """The trajectory store cannot do what was asked."""


class StoreLockTimeout(StoreError, TimeoutError):
    """Another process held the store's lock for longer than the configured wait."""


class NotLeaderError(StoreError, PermissionError):
    """A learner wrote under a term that is no longer the run's current one (it was deposed)."""


class PolicyConflictError(StoreError):
    """A policy version is already registered, or its parent is not the latest version."""


class DuplicateGroupError(StoreError):
    """A group id is already stored with other content, or its task slot was re-issued."""


class SchemaVersionError(StoreError):
    """The store was written by another schema version; the message says what to do."""


class SandboxError(SandpiperError, RuntimeError):
    """A sandbox could not be started, reached or cleaned up (an infrastructure failure)."""


class SandboxLostError(SandboxError):
    """The sandbox's container is gone or stopped for a reason outside the agent's reach
    (removed or killed by the host, podman failed): the episode is an infra failure
    (stop reason ``sandbox_lost``), never the policy's outcome."""


class SandboxLimitsNotEnforced(SandboxError):
    """The host does not enforce a resource limit the config asks for."""


class InferenceError(SandpiperError, RuntimeError):
    """The inference server failed or returned something unusable."""


class TaskError(SandpiperError, ValueError):
    """A task file or task folder is malformed."""


class LearnerError(SandpiperError, RuntimeError):
    """The learner cannot continue (bad checkpoint, inconsistent store state, ...)."""
