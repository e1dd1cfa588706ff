"""Understand a run from its store: SQL views, ``sandpiper sql``/``show``/``report``, polars API.

- :mod:`sandpiper.analysis.views`      the SQL views (DuckDB and PostgreSQL), created lazily by readers
- :mod:`sandpiper.analysis.query`      read-only connections, ``run_sql`` (what ``sandpiper sql`` runs)
- :mod:`sandpiper.analysis.api`        functions returning polars DataFrames, for notebooks
- :mod:`sandpiper.analysis.transcript` one episode as a rich transcript (``sandpiper show``)
- :mod:`sandpiper.analysis.plots`, :mod:`sandpiper.analysis.report`  the HTML report (``sandpiper report``)

See ``docs/analysis.md`` for examples.
"""
