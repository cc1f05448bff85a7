"""Regenerate the golden snapshot files. Run by hand only when adding a format version:

    python tests/golden/regenerate.py v2     (the version this build writes: FORMAT_VERSION)
    python tests/golden/regenerate.py v3     (... where a producer is named: PRODUCER_VERSION, as PRODUCER)

Files a released version wrote must keep loading, so existing files are never
overwritten (the script refuses); tests only read them.
"""

import io
import sys
from pathlib import Path

import numpy as np

from kvstate.impl.cache import Cache
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.layout import Layout

LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)
TOKENS = [0, 1, 2, 2**31 - 1, 42]
PRODUCER = b"kvstate-golden03"      # the producer the v3 files name (16 bytes)


def golden_values() -> np.ndarray:
    """Arithmetic, not a random generator, so the inputs never depend on a NumPy version."""
    n = len(TOKENS)
    i = np.arange(n * LAYOUT.values_per_position, dtype=np.int64)
    values = (((i * 7919) % 1001 - 500) / np.float64(37)).astype(np.float32).reshape(LAYOUT.batch_shape(n))
    values[1, 0, 1, 1] = 0.0             # an all-zero head vector: q8's zero scale
    values[2, 1, 0, 0] *= np.float32(1e-3)
    return values


def main(version: str) -> None:
    if version not in (f"v{fmt.FORMAT_VERSION}", f"v{fmt.PRODUCER_VERSION}"):
        sys.exit(f"this build writes format v{fmt.FORMAT_VERSION} and v{fmt.PRODUCER_VERSION}, not {version} "
                 "(v2 needs the xxhash package)")
    producer = PRODUCER if version == f"v{fmt.PRODUCER_VERSION}" else None
    folder = Path(__file__).parent / version
    folder.mkdir(exist_ok=True)
    for precision in ("f32", "f16", "q8"):
        snapshot, expected = folder / f"{precision}.kvs", folder / f"{precision}.expected.npz"
        if snapshot.exists() or expected.exists():
            sys.exit(f"{snapshot} exists: golden files are never regenerated")
        cache = Cache(LAYOUT, page_tokens=2, precision=precision)
        ctx = cache.allocate()
        ctx.extend(TOKENS, golden_values())
        stream = io.BytesIO()
        ctx.snapshot(stream, producer=producer)
        snapshot.write_bytes(stream.getvalue())
        values, tokens = ctx.read()
        np.savez(expected, values=values, tokens=tokens)


if __name__ == "__main__":
    main(sys.argv[1])
