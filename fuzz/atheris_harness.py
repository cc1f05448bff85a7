"""Coverage-guided snapshot fuzzing with atheris, for long sessions.

    python -m kvstate.fuzz.atheris_harness [corpus_dir ...] [-max_total_time=3600] [libFuzzer flags]

(or ``kvstate fuzz --atheris -- FLAGS``). The first input byte picks a precision
and a mode; the rest is the file:

- mode 0: restored as is, so the fuzzer hammers magic, version, checksums, sizes;
- mode 1: both checksums are recomputed first, so damage reaches the field and
  value checks that the checksums guard;
- mode 2: restored through a non-seekable stream (the bounded-read path).

A file may be refused only with a ``SnapshotError`` (or ``PrecisionRangeError``
for a valid file that the cache's precision cannot hold), and a refused restore
must leave ``observe()`` and ``stats()`` unchanged; a loaded one must read back
finite values. Anything else is a crash that libFuzzer saves. Without a corpus
argument the harness seeds a temporary corpus with small valid snapshots.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
from collections import Counter

import numpy as np

try:
    import atheris
except ImportError:     # optional: pip install atheris (the 'fuzz' extra)
    atheris = None

from kvstate.spec.errors import PrecisionRangeError, SnapshotError

from . import snapshot_fuzz as fz

PRECISIONS = ("f32", "f16", "q8")
MODES = 3
STATS: Counter = Counter()
_hosts: dict = {}


class _Pipe:
    """A stream that cannot seek or report its size."""

    def __init__(self, data: bytes):
        self._inner = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._inner.read(n)


def _host(precision: str):
    if precision not in _hosts:
        cache = fz.host_cache(precision)
        _hosts[precision] = [cache, (cache.observe(), cache.stats())]
    return _hosts[precision]


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, precision = data[0] % MODES, PRECISIONS[(data[0] // MODES) % len(PRECISIONS)]
    body = data[1:]
    if mode == 1:
        body = fz.resign(body)
    host = _host(precision)
    cache, before = host
    source = _Pipe(body) if mode == 2 else io.BytesIO(body)
    try:
        ctx = cache.restore(source)
    except (SnapshotError, PrecisionRangeError):
        STATS["refused"] += 1
        if (cache.observe(), cache.stats()) != before:
            raise AssertionError(f"a refused restore changed the cache (mode {mode}, {precision})")
        return
    values, tokens = ctx.read()
    if not np.isfinite(values).all() or (np.asarray(tokens) < 0).any():
        raise AssertionError("a restored context reads a non-finite value or a negative token")
    ctx.close()
    STATS["loaded"] += 1
    host[1] = (cache.observe(), cache.stats())


def seed_corpus(folder: str) -> None:
    for i, precision in enumerate(PRECISIONS):
        snapshot = fz.small_snapshot(precision)
        for mode in range(MODES):
            with open(os.path.join(folder, f"{precision}-{mode}"), "wb") as file:
                file.write(bytes([i * MODES + mode]) + snapshot)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if atheris is None:
        print("atheris is not installed: pip install atheris (or pip install 'kvstate[fuzz]')", file=sys.stderr)
        return 2
    if not any(not arg.startswith("-") for arg in argv[1:]):
        corpus = tempfile.mkdtemp(prefix="kvstate-atheris-")
        seed_corpus(corpus)
        argv.append(corpus)
    atheris.instrument_all()
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
