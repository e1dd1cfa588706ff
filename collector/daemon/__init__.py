"""The collector process: ``sandpiper collect`` and ``sandpiper collect --eval``.

- :mod:`.launch` — builds the real parts from the settings and runs the collector.
- :mod:`.core` — :class:`~sandpiper.collector.daemon.core.Collector`: groups from store slots,
  backpressure, hot reload, validation, drain on stop.
- :mod:`.shutdown` — a stop that keeps to its deadline whatever the store does.
- :mod:`.status` — the metrics and the live status line.
- :mod:`.journal` — the durable group-sequence counter (evaluation's group ids).
- :mod:`.eval` — evaluation mode against any OpenAI-compatible chat endpoint.
"""
