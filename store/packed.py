"""The packed-array codec: token ids, logprobs and policy versions as one BLOB per turn.

A packed column (``store.schema.Packed``) holds little-endian int32 token ids or float32
logprobs. Token arrays never pass through Python lists: a column is built from one
concatenated numpy buffer plus byte offsets (:func:`pack`) and read back as one
``np.frombuffer`` of the Arrow binary buffer (:func:`unpack`). Per-token policy versions
travel as a per-turn scalar plus change points (:func:`version_runs` / :func:`expand_versions`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa


def pack(arrays: Sequence[np.ndarray | None], dtype: str) -> pa.Array:
    """One packed little-endian BLOB per row (None → null) from one concatenated buffer."""
    n = len(arrays)
    item = np.dtype(dtype).itemsize
    lengths = np.fromiter((0 if a is None else len(a) * item for a in arrays), np.int64, n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    present = [np.asarray(a, dtype) for a in arrays if a is not None]
    values = np.concatenate(present) if present else np.zeros(0, dtype)
    # the numpy buffer itself (no ``tobytes`` copy of the batch's ~100 MB of tokens)
    nulls = np.fromiter((a is None for a in arrays), bool, n)
    validity = pa.py_buffer(np.packbits(~nulls, bitorder="little")) if nulls.any() else None
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(),
        n,
        [validity, pa.py_buffer(offsets), pa.py_buffer(values)],
        null_count=int(nulls.sum()),
    )


def version_runs(versions_T: np.ndarray | None) -> tuple[int | None, list[int] | None]:
    """(version of the first token, [offset, version, ...] where it changes or None)."""
    if versions_T is None or len(versions_T) == 0:
        return None, None
    v = np.asarray(versions_T)
    at = np.flatnonzero(v[1:] != v[:-1]) + 1
    if len(at) == 0:
        return int(v[0]), None
    return int(v[0]), np.column_stack([at, v[at]]).ravel().tolist()


def expand_versions(version: int | None, changes: Sequence[int] | None, n: int) -> np.ndarray:
    """Per-token versions (int32) of one turn from :func:`version_runs`' encoding."""
    out = np.full(n, -1 if version is None else version, np.int32)
    for offset, v in zip(changes[::2], changes[1::2], strict=True) if changes else ():
        out[offset:] = v
    return out


def chunks(col: pa.ChunkedArray | pa.Array) -> list[pa.Array]:
    return list(col.chunks) if isinstance(col, pa.ChunkedArray) else [col]


def offsets(chunk: pa.Array) -> np.ndarray:
    """The value offsets (bytes) of a binary chunk, one more than its rows."""
    wide = pa.types.is_large_binary(chunk.type) or pa.types.is_large_string(chunk.type)
    raw = np.frombuffer(chunk.buffers()[1], np.int64 if wide else np.int32)
    return raw[chunk.offset : chunk.offset + len(chunk) + 1].astype(np.int64)


def packed_lengths(col: pa.ChunkedArray | pa.Array, dtype: str) -> np.ndarray:
    """Items in each row of a packed column (0 for null) as int64."""
    item = np.dtype(dtype).itemsize
    parts = []
    for c in chunks(col):
        if pa.types.is_null(c.type) or c.null_count == len(c):
            parts.append(np.zeros(len(c), np.int64))
            continue
        n = np.diff(offsets(c)) // item
        if c.null_count:  # Arrow lets a null row span bytes; it holds no values
            n[~c.is_valid().to_numpy(zero_copy_only=False)] = 0
        parts.append(n)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def unpack(col: pa.ChunkedArray | pa.Array, dtype: str) -> np.ndarray:
    """Every value of a packed column, rows in order (nulls contribute nothing): one copy."""
    parts = []
    for c in chunks(col):
        if pa.types.is_null(c.type) or c.null_count == len(c):
            continue
        if c.null_count:
            c = c.drop_null()
        off = offsets(c)
        if off[-1] > off[0]:
            parts.append(np.frombuffer(c.buffers()[2], np.uint8)[off[0] : off[-1]])
    if not parts:
        return np.zeros(0, dtype)
    flat = np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
    return flat.view(dtype).astype(np.dtype(dtype).newbyteorder("="), copy=False)


def unpack_one(blob: bytes | None, dtype: str) -> list | None:
    """One packed value as a Python list (None stays None): for people, not for the learner."""
    return None if blob is None else np.frombuffer(blob, dtype).tolist()


def packed_values(col: pa.ChunkedArray | pa.Array, dtype: str) -> np.ndarray:
    """Every value of a packed column like :func:`unpack`, but a read-only view of the Arrow
    buffer where there is one chunk without nulls: for values that are copied on at once."""
    parts = chunks(col)
    if len(parts) != 1 or parts[0].null_count or pa.types.is_null(parts[0].type):
        return unpack(col, dtype)
    off = offsets(parts[0])
    item = np.dtype(dtype).itemsize
    data = parts[0].buffers()[2]
    if data is None or off[-1] == off[0] or off[0] % item:
        return unpack(col, dtype)
    values = np.frombuffer(data, dtype, (int(off[-1]) - int(off[0])) // item, int(off[0]))
    return values.astype(np.dtype(dtype).newbyteorder("="), copy=False)


def all_finite(col: pa.ChunkedArray | pa.Array) -> bool:
    """True when every value of a packed float32 column is finite: one vectorised pass over
    a view of each chunk's values buffer (no copy). Bytes under a null row (none, as
    :func:`pack` builds them) would count too: at worst a needless closer look."""
    for c in chunks(col):
        if pa.types.is_null(c.type) or c.null_count == len(c):
            continue
        off = offsets(c)
        lo, hi, data = int(off[0]), int(off[-1]), c.buffers()[2]
        if data is None or hi == lo:
            continue
        if lo % 4 or (hi - lo) % 4:
            return False
        if not np.isfinite(np.frombuffer(data, "<f4", (hi - lo) // 4, lo)).all():
            return False
    return True
