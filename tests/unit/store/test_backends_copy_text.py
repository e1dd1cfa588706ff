"""PostgreSQL text COPY formatting (store/backends.py) against a per-value reference."""

from __future__ import annotations

import pyarrow as pa
import pytest

from sandpiper.store.backends import _bytea_hex, _copy_text


def _reference_line(row: dict) -> str:
    def field(v) -> str:
        if v is None:
            return "\\N"
        if isinstance(v, bytes):
            return "\\\\x" + v.hex()
        if isinstance(v, str):
            return v.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
        return str(v)

    return "\t".join(field(v) for v in row.values())


@pytest.mark.parametrize("kind", [pa.binary(), pa.large_binary()])
def test_bytea_hex_matches_per_value_hex_on_slices_and_nulls(kind):
    col = pa.array([b"\x00\x01\xff", None, b"", b"abc", None, bytes(range(256))], kind)
    for part in (col, col.slice(1), col.slice(2, 3), col.slice(4, 0)):
        want = [None if v is None else "\\\\x" + v.hex() for v in part.to_pylist()]
        assert _bytea_hex(part).to_pylist() == want


def test_copy_text_is_one_escaped_line_per_row():
    batch = pa.record_batch(
        {
            "s": pa.array(["a\tb", None, "back\\slash\nnewline", "plain"]),
            "n": pa.array([1, 2, None, -4]),
            "blob": pa.array([b"\x01\x02", None, b"", b"\xff"], pa.large_binary()),
        }
    )
    for part in (batch, batch.slice(1), batch.slice(3, 1)):
        want = "".join(_reference_line(r) + "\n" for r in part.to_pylist())
        assert bytes(_copy_text(part)).decode() == want
    assert bytes(_copy_text(batch.slice(0, 0))) == b""
