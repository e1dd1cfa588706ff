"""The collector: runs agent episodes in sandboxes on the served policy and stores them.

- :mod:`.daemon` — the ``sandpiper collect`` process (launch, the Collector, stop, status,
  evaluation mode).
- :mod:`.episode` — one episode: the loop, the policies, the renderer, the parsers, the tools.
- :mod:`.gateway` — an OpenAI-compatible gateway for unmodified agents (``sandpiper gateway``).
- :mod:`.tasks` — the task model, its sources, ``sandpiper tasks import``, the peer formats.
- :mod:`.rewards` — every scorer (reference, answers, test results, peer scorers, the worker).
- :mod:`.inference` — the policy client and the local vLLM servers (under a lifeline).
- :mod:`.sandbox` — podman sandboxes, their pools, image and host checks.
- :mod:`.run_setup` — what every process of a run opens the same way (store, local servers);
  at this level because the daemon and the gateway both use it.
"""
