"""The three precisions, defined once and shared bit-exactly by the reference and every store.

- ``f32``: stored as written.
- ``f16``: IEEE half, round-to-nearest-even; reads return that value as float32.
  A finite value that would round to infinity is refused (``PrecisionRangeError``).
- ``q8``: symmetric int8 with one float32 scale per ``head_dim`` vector, i.e. per
  (position, layer, K/V, head). All arithmetic is float32::

      scale = min(max|x| / 127, Q8_SCALE_MAX)
      code  = clip(round_half_even(x / scale), -127, 127)    (code = 0 where scale == 0)
      read  = code * scale

  ``scale == 0`` covers the all-zero vector and a vector so small that its scale
  underflows; both read back as zeros. ``Q8_SCALE_MAX`` is the largest float32
  whose ``127 * scale`` is finite: without it a vector holding float32's maximum
  would read back as infinity (``max / 127`` rounds up).

Encoded form: ``(values,)`` for f32/f16 and ``(codes, scales)`` for q8, where
``scales`` has the shape of ``values`` without its last axis.
"""

from __future__ import annotations

import numpy as np

from .errors import ConfigError, PrecisionRangeError

PRECISIONS = ("f32", "f16", "q8")
Q8_MAX = 127
F16_MAX = 65504.0
# The least |x| float16 rounds to infinity (65504 plus half its last step): values from F16_MAX up to
# it round to F16_MAX and are stored as such, so this, not F16_MAX, is where a write is refused.
F16_OVERFLOW = 65520.0

VALUE_DTYPES = {"f32": np.float32, "f16": np.float16, "q8": np.int8}


def _largest_safe_scale() -> np.float32:
    scale = np.float32(np.finfo(np.float32).max / Q8_MAX)
    with np.errstate(over="ignore"):
        while not np.isfinite(np.float32(Q8_MAX) * scale):
            scale = np.nextafter(scale, np.float32(0))
    return scale


Q8_SCALE_MAX = _largest_safe_scale()
"""The largest q8 scale whose ``127 * scale`` is finite in float32 (just below max/127)."""


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def encode(precision: str, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """Encode float32 ``x`` (last axis ``head_dim``) into the stored form."""
    if precision == "f32":
        return (np.array(x, dtype=np.float32),)
    if precision == "f16":
        with np.errstate(over="ignore"):    # overflow is reported below, by name
            half = x.astype(np.float16)
        if not np.isfinite(half).all():
            bad = tuple(int(i) for i in np.argwhere(~np.isfinite(half))[0])
            raise PrecisionRangeError(f"K/V value {x[bad]} at index {bad} overflows f16 (|x| >= {F16_OVERFLOW})")
        return (half,)
    if precision == "q8":
        return q8_encode(x)
    raise ConfigError(f"unknown precision {precision!r}")


def decode(precision: str, encoded: tuple[np.ndarray, ...]) -> np.ndarray:
    """The float32 values a read returns for stored ``encoded``."""
    if precision == "q8":
        codes, scales = encoded
        return q8_decode(codes, scales)
    (values,) = encoded
    return values.astype(np.float32)


def roundtrip(precision: str, x: np.ndarray) -> np.ndarray:
    """What reading back ``x`` returns after it was written at ``precision``."""
    if precision == "f32":      # decode(encode(x)) in one copy, not two; always fresh memory, callers keep it
        return np.array(x, dtype=np.float32, copy=True)
    return decode(precision, encode(precision, x))


def q8_encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales of ``x``: ``scale = max|x| / 127`` per vector, codes by the scalar rule.

    Vectorised form of ``spec.arithmetic.q8_code(round_half_even(x / scale))``:
    ``np.rint`` rounds half to even like Python's ``round``, and ``np.clip`` to
    +-127 is ``q8_code``, whose range CrossHair proves; a test checks that the two
    agree element by element.
    """
    x = np.asarray(x, dtype=np.float32)
    scales = np.minimum(np.abs(x).max(axis=-1) / np.float32(Q8_MAX), Q8_SCALE_MAX).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))[..., None]
    ratio = np.where(scales[..., None] > 0, x / safe, np.float32(0))
    codes = np.clip(np.rint(ratio), -Q8_MAX, Q8_MAX).astype(np.int8)
    return codes, scales


def q8_decode(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return codes.astype(np.float32) * scales.astype(np.float32)[..., None]
