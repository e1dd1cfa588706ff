"""Understand a run from its store: SQL views, ``sandpiper sql``/``show``/``report``, polars API.

- :mod:`analysis.views`      the SQL views (DuckDB and PostgreSQL), created lazily by readers
- :mod:`analysis.query`      read-only connections, ``run_sql`` (what ``sandpiper sql`` runs)
- :mod:`analysis.api`        functions returning polars DataFrames, for notebooks
- :mod:`analysis.transcript` one episode as a rich transcript (``sandpiper show``)
- :mod:`analysis.plots`, :mod:`analysis.report`  the HTML report (``sandpiper report``)
- :mod:`analysis.synthetic`  a realistic synthetic run for tests, docs and demos

See ``docs/analysis.md`` for examples.
"""
