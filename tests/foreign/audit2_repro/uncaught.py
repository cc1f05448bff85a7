"""Direct reproductions of the four planted bugs `kvstate conform` (ci) passes: each restores what the
correct engine (and README's Snapshots section) refuses.  PYTHONPATH=$PWD python tests/foreign/audit2_repro/uncaught.py"""
import io
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import audit_snapshots as good                      # noqa: E402
import audit_snapshots_bugs as bugs                 # noqa: E402
from kvstate.spec import Config, Layout             # noqa: E402
from kvstate.spec import snapshot_format as fmt     # noqa: E402
from kvstate.stateful.ops import values_for         # noqa: E402

L = Layout(2, 2, 4)


def snap(layout, precision="f32", kv=None):
    ctx = good.factory(Config(layout, 4, precision, 0, 2)).allocate()
    ctx.extend([1, 2, 3], values_for(layout, 3, 7) if kv is None else kv)
    buf = io.BytesIO()
    ctx.snapshot(buf)
    return buf.getvalue()


def nan_file():
    body = np.array([1, 2], "<i4").tobytes() + np.full((2, *L.position_shape), np.nan, "<f4").tobytes()
    v = fmt.FORMAT_VERSION
    return fmt.pack_header("f32", L, 2, fmt.body_checksum(v, body), version=v) + body


CASES = [
    ("trailing_bytes_accepted", "f32", snap(L) + b"\0", "one byte after the snapshot (README: refused, SnapshotCorruptError)"),
    ("layout_by_size", "f32", snap(Layout(1, 2, 8)), "a 1x2x8 file into a 2x2x4 cache (SnapshotLayoutError)"),
    ("content_not_checked", "f32", nan_file(), "NaN values under a valid checksum (rule 5: every value finite)"),
    ("convert_without_range_check", "f16", snap(L, "f32", np.full((3, *L.position_shape), 1e5, np.float32)),
     "an f32 file of 1e5 into an f16 cache (SnapshotPrecisionError)"),
]
for bug, precision, data, what in CASES:
    print(f"{bug}: {what}")
    for name, fac in (("correct", good.factory), ("planted", getattr(bugs, bug))):
        try:
            ctx = fac(Config(L, 4, precision, 0, 2)).restore(io.BytesIO(data))
            print(f"  {name}: RESTORED {len(ctx)} positions, first value {ctx.read()[0].ravel()[0]}")
        except Exception as error:
            print(f"  {name}: {type(error).__name__}: {str(error)[:90]}")
