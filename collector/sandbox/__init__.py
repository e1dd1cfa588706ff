"""Sandboxes: the Protocol (``base``), podman containers with a persistent shell (``podman``),
a warm pool (``pool``), the base image (``image``), host checks (``check``), the janitor
(``janitor``) and an in-process fake for unit tests (``fake``).

Importing this package is cheap (standard library and pydantic only).
"""
