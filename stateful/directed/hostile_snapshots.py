"""Snapshot files whose checksums hold but whose contents the format forbids, for ``damaged snapshots``.

A truncation or a flipped bit is caught by the checksum alone; a restore must also refuse a file that
is well formed on the outside (spec/snapshot_format.py): bytes past its body, a header naming another
layout of the same size, a value that is not finite, and, into an f16 cache, an f32 value past f16's
range (a ``PrecisionRangeError``: kvstate raises ``SnapshotPrecisionError``, both). An audit's engine that checked only the checksum restored each of
these and passed every check (2026-12-06). Built from ``kvstate.spec`` alone, from the backend's own
snapshot, as version 1 files (CRC-32), which every reader loads.
"""

from __future__ import annotations

import numpy as np

from kvstate.spec import errors
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.layout import Layout

# what a case is called, the file, the error it must get
Case = tuple[str, bytes, type]


def well_formed(precision: str, layout: Layout, positions: int, body: bytes) -> bytes:
    """A version 1 file of ``body`` (``positions`` positions of ``layout`` at ``precision``), checksums right."""
    return fmt.pack_header(precision, layout, positions, fmt.crc32(body), len(body)) + body


def hostile_files(data: bytes, precision: str, layout: Layout, values: np.ndarray) -> list[Case]:
    """The cases for a backend whose snapshot of ``values`` (its ``read()``, position-major) is ``data``."""
    header = fmt.parse_header(data)
    body = data[fmt.header_size(header.version):]
    n = header.positions
    cases: list[Case] = [("with one byte appended past its body", data + b"\x00", errors.SnapshotError)]
    # A body checksum that does not match, the header's own right: also for an empty body, which an
    # audit's engine skipped checking (every byte of the file is still covered by one checksum or the other).
    wrong = (fmt.crc32(body) ^ 0x5A5A5A5A) & 0xFFFFFFFF
    cases += [("its body checksum wrong, the header's checksum recomputed",
               fmt.pack_header(precision, layout, n, wrong, len(body)) + body, errors.SnapshotError),
              ("of no positions, its body checksum wrong, the header's checksum right",
               fmt.pack_header(precision, layout, 0, (fmt.crc32(b"") ^ 0x5A5A5A5A) & 0xFFFFFFFF, 0),
               errors.SnapshotError)]
    other = _another_layout_of_the_same_size(layout)
    if other is not None and fmt.body_size(other, precision, n) == len(body):      # q8's scales may differ
        cases.append((f"naming layout {other.layers}x{other.kv_heads}x{other.head_dim}, its body the same size",
                      well_formed(precision, other, n, body), errors.SnapshotError))
    if n:
        first = 4 * n       # the values follow the int32 token ids
        bad = {"f32": np.float32(np.nan).tobytes(), "f16": np.float16(np.inf).tobytes(), "q8": b"\x80"}[precision]
        cases.append(("with a value that is not finite (code -128 in q8), checksums recomputed",
                      well_formed(precision, layout, n, body[:first] + bad + body[first + len(bad):]),
                      errors.SnapshotError))
    if precision == "f16" and n:
        wide = np.asarray(values, np.float32).copy()
        wide.reshape(-1)[0] = 1e5               # f16's largest finite value is 65,504
        tokens = body[:4 * n]
        cases.append(("written at f32 with a value of 1e5, past f16's range",
                      well_formed("f32", layout, n, tokens + wide.astype("<f4").tobytes()),
                      errors.PrecisionRangeError))      # kvstate's is SnapshotPrecisionError, also a SnapshotError
    return cases


def _another_layout_of_the_same_size(layout: Layout) -> Layout | None:
    """A layout other than ``layout`` with as many values a position: layers and heads swapped, else
    twice the layers at half the head size; None where neither differs (one layer, one head, odd size)."""
    if layout.layers != layout.kv_heads:
        return Layout(layout.kv_heads, layout.layers, layout.head_dim)
    if layout.head_dim % 2 == 0:
        return Layout(layout.layers * 2, layout.kv_heads, layout.head_dim // 2)
    return None
