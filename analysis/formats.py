"""Write a polars DataFrame as a rich table, CSV, JSON (one object per row) or Parquet.

CSV and tables cannot hold nested values (token-id arrays, structs): those columns are
written as JSON text. JSON keeps them nested; Parquet keeps every type as it is.

Stored text is the policy's (tool outputs, model text): tables show it through
:func:`sandpiper.analysis.terminal.neutralize` as plain text (never rich markup); JSON escapes the
characters a terminal acts on (losslessly); CSV is written raw to a file or a pipe and
neutralized when it goes to a terminal.
"""

from __future__ import annotations

import sys
from enum import StrEnum
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

from sandpiper.analysis.query import QueryError
from sandpiper.analysis.terminal import json_safe, neutralize

if TYPE_CHECKING:
    import polars as pl


class OutputFormat(StrEnum):
    TABLE = "table"
    CSV = "csv"
    JSON = "json"
    PARQUET = "parquet"


MAX_TABLE_ROWS = 1000
"""A table prints at most this many rows (use csv/json/parquet for everything)."""

MAX_CELL_CHARS = 80
"""Longer cells are shortened in tables (with an ellipsis)."""


def flatten_nested(df: pl.DataFrame) -> pl.DataFrame:
    """Nested columns (lists, arrays, structs) as JSON text; other columns unchanged."""
    import polars as pl

    nested = [n for n, t in df.schema.items() if t.is_nested()]
    if not nested:
        return df
    return df.with_columns(pl.col(n).map_elements(_to_json, return_dtype=pl.String) for n in nested)


def _to_json(value: object) -> str:
    import json

    if hasattr(value, "to_list"):
        value = value.to_list()
    return json.dumps(value, default=str)


def _cell(value: object) -> str:
    if value is None:
        return "∅"
    if isinstance(value, float):
        return f"{value:.4g}"
    text = neutralize(str(value))
    return text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 1] + "…"


def print_table(df: pl.DataFrame, *, file: IO[str] | None = None, title: str | None = None) -> None:
    """A rich table of the first :data:`MAX_TABLE_ROWS` rows, with the row count below."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(file=file or sys.stdout, soft_wrap=False)
    table = Table(title=title, show_lines=False, header_style="bold")
    numeric = {n for n, t in df.schema.items() if t.is_numeric()}
    for name in df.columns:
        justify: Literal["right", "left"] = "right" if name in numeric else "left"
        table.add_column(Text(neutralize(name)), justify=justify, overflow="fold")
    shown = flatten_nested(df.head(MAX_TABLE_ROWS))
    for row in shown.iter_rows():  # Text: a cell is never read as rich markup
        table.add_row(*(Text(_cell(v)) for v in row))
    console.print(table)
    more = (
        f" (showing {MAX_TABLE_ROWS}; use --format csv/json/parquet for all)"
        if df.height > MAX_TABLE_ROWS
        else ""
    )
    console.print(f"[dim]{df.height} row{'s' if df.height != 1 else ''}{more}[/dim]")


def write_frame(
    df: pl.DataFrame,
    fmt: OutputFormat,
    *,
    out: Path | None = None,
    file: IO[str] | None = None,
) -> None:
    """Write ``df`` in ``fmt`` to ``out`` (a file) or ``file`` (default stdout)."""
    if fmt == OutputFormat.PARQUET:
        if out is None:
            raise QueryError("--format parquet needs --out FILE (Parquet is binary)")
        df.write_parquet(out)
        return
    if fmt == OutputFormat.TABLE:
        if out is not None:
            with out.open("w") as fh:
                print_table(df, file=fh)
        else:
            print_table(df, file=file)
        return
    csv = fmt == OutputFormat.CSV
    text = flatten_nested(df).write_csv() if csv else json_safe(df.write_json())
    if out is not None:
        out.write_text(text)
        return
    stream = file or sys.stdout
    if csv and stream.isatty():  # raw bytes would drive the terminal
        text = neutralize(text)
    stream.write(text if text.endswith("\n") else text + "\n")
