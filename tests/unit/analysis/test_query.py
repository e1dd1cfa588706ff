"""The read-only guard of ``sandpiper sql`` and the view SQL, without a database."""

from __future__ import annotations

import pytest

from sandpiper.analysis.query import QueryError, check_read_only, db_error_line
from sandpiper.analysis.views import MARKER_VIEW, VIEW_DOCS, VIEW_NAMES, view_statements


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT 1",
        "  select * from episodes;  ",
        "WITH x AS (SELECT 1) SELECT * FROM x",
        "-- a comment\nSELECT 1",
        "/* DELETE FROM runs */ SELECT 1",
        "EXPLAIN SELECT 1",
        "SELECT ';' AS semi",
        "FROM episodes",
        "(SELECT 1)",
    ],
)
def test_reading_statements_pass(sql: str) -> None:
    assert check_read_only(sql) == sql.strip().rstrip(";").strip()


@pytest.mark.parametrize(
    ("sql", "message"),
    [
        ("DELETE FROM episodes", "DELETE statements are refused"),
        ("insert into runs values (1)", "INSERT statements are refused"),
        ("  drop table runs", "DROP"),
        ("ATTACH 'x.db'", "ATTACH"),
        ("SET threads = 1", "SET"),
        ("SELECT 1; DROP TABLE runs", "one statement"),
        ("-- only a comment", "empty"),
        ("", "empty"),
    ],
)
def test_writes_and_batches_are_refused(sql: str, message: str) -> None:
    with pytest.raises(QueryError, match=message):
        check_read_only(sql)


def test_query_error_is_a_value_error_and_a_project_error() -> None:
    from sandpiper.errors import SandpiperError

    assert issubclass(QueryError, ValueError) and issubclass(QueryError, SandpiperError)


def test_db_error_line_keeps_the_first_line() -> None:
    class Wrapped(Exception):
        orig = RuntimeError('Parser Error: syntax error at or near "SELEC"\n\nLINE 1: SELEC 1')

    assert db_error_line(Wrapped()) == 'Parser Error: syntax error at or near "SELEC"'


@pytest.mark.parametrize("dialect", ["duckdb", "postgresql"])
def test_every_view_has_a_statement_and_a_doc(dialect: str) -> None:
    statements = view_statements(dialect)
    assert len(statements) == len(VIEW_NAMES) + 1  # + the version marker, created last
    assert statements[-1].startswith(f"CREATE OR REPLACE VIEW {MARKER_VIEW} ")
    for name, statement in zip(VIEW_NAMES, statements, strict=False):
        assert statement.startswith(f"CREATE OR REPLACE VIEW {name} AS"), name
        assert VIEW_DOCS[name]


def test_json_access_is_per_dialect() -> None:
    duck = "\n".join(view_statements("duckdb"))
    pg = "\n".join(view_statements("postgresql"))
    assert "TRY_CAST(ls.metrics ->> 'is/ess' AS DOUBLE)" in duck
    assert "CAST(ls.metrics ->> 'is/ess' AS DOUBLE PRECISION)" in pg
    assert "TRY_CAST" not in pg


def test_temporary_views_and_unknown_dialects() -> None:
    assert all(" TEMP VIEW " in s for s in view_statements("duckdb", temporary=True))
    with pytest.raises(ValueError, match="sqlite"):
        view_statements("sqlite")
