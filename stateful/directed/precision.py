"""Directed check: the values random K/V almost never are, written at every precision.

Random floats are never exact rounding ties and rarely have a peak so small its q8
scale goes subnormal. Here every case is built to land exactly on an edge of
``kvstate.spec.precision``:

- q8 ties: a vector whose peak is ``127 * 2**e`` has the scale ``2**e`` exactly, so
  ``(k + 0.5) * 2**e`` divides to exactly ``k + 0.5`` and must round half to even
  (``0.5 -> 0``, ``2.5 -> 2``, ``-0.5 -> -0``); also at a subnormal scale;
- all-zero vectors (``+0`` and ``-0``), one huge value beside small ones, the f16 limit;
- peaks so small that the q8 scale is subnormal, or underflows to zero;
- f16 ties (exactly halfway between two halves) and f16 subnormals.

Each case is written in every configuration (``extend`` into a new context, then
``overwrite`` with its negation through a fork, so both write paths and copy-on-write
see it), and the reads are compared bit for bit with the reference's, which applies
``spec/precision.py``. A value the precision refuses (f16 overflow) must be refused
with the reference's error class.
"""

from __future__ import annotations

import math

import numpy as np

from kvstate.spec.layout import Layout
from kvstate.spec.protocol import Config, Factory

from .. import ops as O
from .common import both, keeping, start

PRECISE = ("every position reads bit for bit what kvstate.spec.precision makes of the value written at the "
           "cache's precision: q8 rounds half to even per vector scale, a zero or underflowing scale reads "
           "zeros, f16 rounds half to even and keeps subnormals")

_Q8_TIES = [0.5, 2.5, -0.5, -2.5, 1.5, -1.5, 126.5, -126.5, 3.5, -3.5, 64.5, -64.5]
_TINY = 2.0 ** -149            # the smallest float32 subnormal


def cases(head_dim: int) -> dict[str, list[list[float]]]:
    """Named lists of head vectors, each an edge of some precision (the others store it as it is)."""
    width = max(head_dim - 1, 1)
    ties = []
    for exponent in (0, -7, 6, -140):         # scale exactly 2**exponent; 2**-140 is subnormal
        unit = 2.0 ** exponent
        for sign in (1, -1):
            for i in range(0, len(_Q8_TIES), width):
                ties.append([sign * 127 * unit] + [t * unit for t in _Q8_TIES[i:i + width]])
    return {
        "q8 ties": ties,
        "zero vectors": [[0.0] * head_dim, [-0.0] * head_dim, ([0.0, -0.0] * head_dim)[:head_dim]],
        "one huge value": [[3.0e38, 1.0, -1.0, 0.5], [-3.4028235e38, 1e-30, 2.0, -3.0], [1e30, -1.0, 1e-3, 7.0]],
        "f16 limit": [[65504.0, -65504.0, 65519.0, 1.0], [-65519.0, 0.25, 65503.0, -2.0]],
        "f16 overflowing tie": [[65520.0, 1.0, 0.0, -1.0]],
        "subnormal q8 scales": [[1e-40, 5e-41, -1e-40, 3e-41], [127 * _TINY, _TINY, -64 * _TINY, 63 * _TINY],
                                [1e-44, -1e-45, 7e-45, 0.0], [2.0 ** -126, 2.0 ** -127, -2.0 ** -130, 2.0 ** -140]],
        "f16 ties": [[1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2049.0, 2051.0],
                     [1024.5, -(1 + 2.0 ** -11), 0.5 + 2.0 ** -12, -2051.0],
                     [3 * 2.0 ** -25, 2.0 ** -25, 1025.5, -1 - 3 * 2.0 ** -11]],
        "f16 subnormals": [[2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, -2.0 ** -25],
                           [2.0 ** -14, 1023 * 2.0 ** -24, 6e-8, 1e-9], [-2.0 ** -24, -6e-8, 2.0 ** -15, 0.0]],
    }


def positions(layout: Layout, vectors: list[list[float]]) -> np.ndarray:
    """K/V for enough positions to hold every vector once (cut or zero-padded to ``head_dim``),
    filling each position's (layer, K/V, head) vectors in order; the rest are zeros."""
    per_position = layout.layers * 2 * layout.kv_heads
    n = max(1, math.ceil(len(vectors) / per_position))
    flat = np.zeros((n * per_position, layout.head_dim), np.float32)
    for i, vector in enumerate(vectors):
        row = np.asarray(vector[:layout.head_dim], np.float32)
        flat[i, :len(row)] = row
    return flat.reshape(layout.batch_shape(n))


def precision_edges(factory: Factory, config: Config) -> None:
    """Every case of ``cases`` written by extend and by overwrite through a fork; reads equal the reference's."""
    run = start(factory, config)
    # A q8 peak at the float32 maximum reads back as inf (127 * (peak / 127) rounds past it):
    # the reference says so too, and the engine must agree; the warning would only be noise.
    with np.errstate(over="ignore"):
        _write_cases(run, config)
    run.finish()


def _write_cases(run, config: Config) -> None:
    for name, vectors in cases(config.layout.head_dim).items():
        kv = positions(config.layout, vectors)
        tokens = list(range(len(kv)))
        handle = run.apply(O.Allocate())
        engine, reference = run.live[handle]
        call = f"{handle}.extend({tokens}, <{name}>)"
        _, _, refused = both(run, PRECISE, call, lambda: engine.extend(tokens, kv.copy()),
                             lambda: reference.extend(list(tokens), kv.copy()))
        with keeping(PRECISE, run, call):
            run.check()
        if refused is None:
            fork = run.apply(O.Fork(handle))
            engine, reference = run.live[fork]
            call = f"{fork}.overwrite(0, {tokens}, -<{name}>)"
            both(run, PRECISE, call, lambda: engine.overwrite(0, tokens, -kv),
                 lambda: reference.overwrite(0, list(tokens), -kv))
            with keeping(PRECISE, run, call):
                run.check()
            run.apply(O.Close(fork))
        run.apply(O.Close(handle))
