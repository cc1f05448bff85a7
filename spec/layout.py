"""The shape of one position's K/V, and validation of what callers write."""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from operator import countOf

import numpy as np

from .errors import ConfigError, DTypeError, NonFiniteError, ShapeError, TokenError
from .positions import as_position

TOKEN_LIMIT = 2**31      # a power of two: ``_in_range`` relies on it
"""Token ids are non-negative and below this."""

DEFAULT_PAGE_TOKENS = 64


@dataclass(frozen=True)
class Layout:
    """K and V for every layer: one position is ``(layers, 2, kv_heads, head_dim)``.

    A batch of n positions is ``(n, layers, 2, kv_heads, head_dim)``: position-major,
    the order of the snapshot body. A page stores its positions layer-major,
    ``(layers, 2, page_tokens, kv_heads, head_dim)``: the order the forward pass reads.
    """

    layers: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ConfigError(f"Layout.{name} must be a positive int, got {value!r}")
            # A plain int: a NumPy one kept its width, and the products of a layout's sizes wrapped
            # (uint8 128 x 2 x 2 x 128 values a position read 0, and so did the store's page bytes).
            object.__setattr__(self, name, int(value))

    @property
    def position_shape(self) -> tuple[int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.head_dim)

    def batch_shape(self, n: int) -> tuple[int, ...]:
        if type(n) is not int or n < 0:     # the plain int first: every extend's check comes here
            count = as_position(n)
            if count is None or count < 0:  # -1 or 'a' was returned as the shape's first size
                raise ShapeError(f"a batch's number of positions must be an int of at least 0, got {n!r}")
            n = count
        return (n, *self.position_shape)

    def page_shape(self, page_tokens: int) -> tuple[int, ...]:
        return (self.layers, 2, page_tokens, self.kv_heads, self.head_dim)

    @property
    def values_per_position(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim


def check_page_tokens(page_tokens: int) -> int:
    if isinstance(page_tokens, bool) or not isinstance(page_tokens, (int, np.integer)) or page_tokens < 1:
        raise ConfigError(f"page_tokens must be a positive int, got {page_tokens!r}")
    return int(page_tokens)


def check_tokens(tokens, private: bool = True) -> np.ndarray:
    """Token ids as a private int64 array, or ``TokenError``/``DTypeError`` naming the bad one.

    The caller's array is copied once, first, and only the copy is checked and
    returned: a caller (or another thread) changing its array after the call
    began cannot change what is stored. ``private=False`` skips that copy where it
    can (an int64 array comes back as itself), for a lookup that stores nothing.
    """
    if not isinstance(tokens, np.ndarray):     # an array first: the common case pays nothing for these
        if isinstance(tokens, (set, frozenset, dict)):      # their order is not the sequence's
            raise DTypeError(f"token ids must be an ordered sequence of ints, got a {type(tokens).__name__}")
        if is_torch_tensor(tokens):         # a tokenizer's tensor: its values, as an array's (K/V take tensors too)
            try:
                tokens = tokens.detach().cpu().numpy()
            except (TypeError, RuntimeError, NotImplementedError):     # bfloat16, meta: no values to read
                raise DTypeError(f"token ids must be integers, got a tensor of {tokens.dtype}") from None
            private = True      # the array shares the tensor's memory: copied below
    if isinstance(tokens, np.ndarray):
        array = np.array(tokens, copy=True if private else None, subok=False)   # masked or subclassed: the data itself
        if array.dtype.kind not in "iu":
            raise DTypeError(f"token ids must be integers, got an array of {array.dtype}")
    else:
        try:
            items = list(tokens)
        except TypeError:
            raise DTypeError(f"token ids must be a sequence of ints, got {type(tokens).__name__}") from None
        array = _fast_token_array(items)
        if array is not None:
            return array       # one-dimensional, int64, private and in range: checked there
        _name_bad_token(items)      # something is wrong: the element-by-element path names it
        array = np.array(items, dtype=np.int64) if items else np.zeros(0, dtype=np.int64)
    if array.ndim != 1:
        raise ShapeError(f"token ids must be one-dimensional, got shape {array.shape}")
    wide = array.astype(np.int64, copy=False)
    if _in_range(wide):
        return wide
    low, high = int(array.min()), int(array.max())      # the original values: a huge uint64 wraps in ``wide``
    if low < 0:
        raise TokenError(f"token id {low} at index {int(np.argmin(array))} is negative")
    raise TokenError(f"token id {high} at index {int(np.argmax(array))} is not below 2**31")


def _in_range(wide: np.ndarray) -> bool:
    """Every int64 of ``wide`` in ``[0, TOKEN_LIMIT)``. TOKEN_LIMIT is a power of two, so that holds
    when no bit from its bit up (the sign bit included) is set in any of them: one OR over the
    array decides it, where a min and a max take two passes."""
    return not wide.size or 0 <= int(np.bitwise_or.reduce(wide)) < TOKEN_LIMIT


def _fast_token_array(items: list) -> np.ndarray | None:
    """``items`` as an int64 array when every one is a valid token id, else None.

    One C-level pass collects the element types (a bool, a float, a 0-d array or anything
    else that is not an int is refused here, as the element-by-element path refuses it),
    one ``np.fromiter`` converts, one vectorised check bounds the values. An id that does
    not fit in int64 (OverflowError) or a NumPy unsigned one that wraps negative ends up
    outside ``[0, 2**31)`` or in the except: either way None, never a wrong accept.
    """
    if not items:
        return np.zeros(0, dtype=np.int64)
    if countOf(map(type, items), int) != len(items):     # not all plain ints (the usual case): which kinds?
        for kind in set(map(type, items)):
            if kind is not int and (not issubclass(kind, (int, np.integer)) or issubclass(kind, (bool, np.bool_))):
                return None
    try:
        array = np.fromiter(items, np.int64, len(items))
    except (OverflowError, TypeError, ValueError):
        return None
    return array if _in_range(array) else None


def _name_bad_token(items: list) -> None:
    """The element-by-element check: ``DTypeError``/``TokenError`` naming the first bad token id."""
    for i, t in enumerate(items):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise DTypeError(f"token id at index {i} must be an int, got {t!r}")
        if not 0 <= t < TOKEN_LIMIT:     # before the int64 conversion, which overflows from 2**63
            raise TokenError(f"token id {int(t)} at index {i} is not in [0, 2**31)")


def check_values(layout: Layout, kv, n: int):
    """Check that ``kv`` is float32 ``(n, layers, 2, kv_heads, head_dim)``; a named error if not.

    Works on anything with ``dtype`` and ``shape`` (NumPy arrays, torch tensors; a
    page store refuses, with ``DTypeError``, array types it cannot take). Finiteness
    is checked by the page store, on the array's own device, on the copy it stores.
    A NumPy subclass (a masked array, a matrix) is taken as its plain data, which is
    what would be stored: a mask does not hide a NaN.
    """
    if isinstance(kv, np.ndarray) and type(kv) is not np.ndarray:
        kv = np.asarray(kv).view(np.ndarray)
    dtype = getattr(kv, "dtype", None)
    if dtype is None or str(dtype) not in ("float32", "torch.float32"):
        found = dtype if dtype is not None else type(kv).__name__
        raise DTypeError(f"K/V values must be float32, got {found}")
    shape = tuple(kv.shape)
    expected = layout.batch_shape(n)
    if shape != expected:
        raise ShapeError(f"K/V values must have shape {expected} for {n} positions, got {shape}")
    return kv


def is_torch_tensor(value) -> bool:
    """Whether ``value`` is a torch tensor, without importing torch (a tensor's module is loaded already).
    While another thread is still importing torch its module has no ``Tensor`` yet, and no value is one."""
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    return tensor is not None and isinstance(value, tensor)


def require_finite(array: np.ndarray) -> None:
    """``NonFiniteError`` naming the first NaN or infinity in a NumPy array (the plain test: the
    reference's; a store screens first with ``all_finite`` and calls this to name the bad one)."""
    if not np.isfinite(array).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
        raise NonFiniteError(f"K/V value at index {bad} is {array[bad]}")


_FLOAT_BITS = {2: (np.uint16, 0x7FFF, 0x7C00), 4: (np.uint32, 0x7FFFFFFF, 0x7F800000)}   # (view, |x| mask, inf)
_FINITE_CHUNK = 1 << 16      # 256 KiB of scratch: stays in cache, reused by malloc (no fresh pages per call)


def all_finite(values: np.ndarray) -> bool:
    """Whether a contiguous f16/f32 array holds no NaN or infinity.

    f32 past a chunk is screened by the dot product of the array with itself, one read of it
    (a third of ``isfinite``'s time at 4 MiB, measured): a NaN or an infinity makes the sum of
    squares NaN or infinite, and no square is negative, so nothing cancels it. A finite sum
    therefore proves every entry finite; a non-finite one may be an overflow of large finite
    entries, so only then does the exact test decide. The exact tests go a chunk at a time, so
    no full-size temporary: f32 through ``isfinite``, f16 by comparing magnitude bits as
    integers (exact, and SIMD-fast where f16 float operations are slow).
    """
    flat = np.ascontiguousarray(values).reshape(-1)
    if flat.dtype == np.float32:
        if flat.size <= _FINITE_CHUNK:          # small: the screen would cost more than it saves
            return bool(np.isfinite(flat).all())
        if _dot_screen_is_sound() and _squares_sum_finite(flat):
            return True
        finite = np.empty(_FINITE_CHUNK, np.bool_)      # ``isfinite`` is SIMD and 1.7x the bit test (measured)
        return all(np.isfinite(flat[start:start + _FINITE_CHUNK], out=finite[:min(_FINITE_CHUNK, flat.size - start)]).all()
                   for start in range(0, flat.size, _FINITE_CHUNK))
    uint, mask, infinity = _FLOAT_BITS[values.dtype.itemsize]
    flat = flat.view(uint)
    scratch = np.empty(min(flat.size, _FINITE_CHUNK), uint)
    for start in range(0, flat.size, _FINITE_CHUNK):
        chunk = flat[start:start + _FINITE_CHUNK]
        magnitude = np.bitwise_and(chunk, uint(mask), out=scratch[:chunk.size])
        if magnitude.max() >= infinity:
            return False
    return True


def _squares_sum_finite(flat: np.ndarray) -> bool:
    with np.errstate(over="ignore", invalid="ignore"):     # an overflow here is expected, not an error
        return math.isfinite(np.dot(flat, flat))


@functools.cache
def _dot_screen_is_sound() -> bool:
    """Whether this process's BLAS dot keeps a NaN or an infinity anywhere in an array (first,
    middle or last, where its vector and thread splits fall) non-finite; asked once. The screen
    trusts the BLAS NumPy links, and some builds compute wrong results on some processors; where
    this fails, ``all_finite`` runs the exact test alone."""
    probe = np.ones(3 * _FINITE_CHUNK + 5, np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        for index in (0, 1, probe.size // 2, probe.size - 2, probe.size - 1):
            probe[index] = bad
            if _squares_sum_finite(probe):
                return False
            probe[index] = 1
    return _squares_sum_finite(probe)
