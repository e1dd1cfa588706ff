"""Sandboxes: the Protocol (``base``); one podman container and the host's connection to the
persistent shell in it (``client``); the ``podman run`` flags and mounts that isolate it
(``isolation``); podman CLI calls, listing and removal of containers (``containers``); the
program that runs inside every container, standard library only (``supervisor/``: server,
commands, launcher, files, reset, grader); what the host keeps per container
(``host_state``) and the uid ranges (``uids``); a warm pool (``pool``) and one pool per task
image (``images``), the base image's build (``image_build``), host checks (``check``) and
the janitor (``janitor``). The in-process fake for unit tests is
:mod:`sandpiper.testing.sandbox`.

Importing this package is cheap (standard library and pydantic only).
"""
