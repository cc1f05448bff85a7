"""A lookup's tokens as a packed key (``radix.pack``), in as few passes as the input allows.

A Python list (what users pass) is read once, in C, by ``marshal.dumps(items, 2)``: format
version 2 writes a list of n objects as ``b'['`` + n (int32) + one record each, and an exact
``int`` in [-2**31, 2**31) as ``b'i'`` + its int32 little-endian, 5 bytes; anything else gets
another record (a bool ``b'T'``/``b'F'``, a float ``b'g'``, a bigger int ``b'l'`` and its
digits) or raises (a NumPy scalar or array, an int subclass). So an output of exactly
5 + 5n bytes whose every fifth byte from the sixth is ``b'i'`` proves every token is a plain
int that fits in int32, and its payload, read with a stride of 5, is the packed key; a
negative id is a top payload byte with its high bit set, which ``isascii`` finds. That is one
pass over the list where a type scan plus a conversion (``countOf(map(type, ...))`` +
``np.fromiter`` or ``array('i')``) take two, each as long.
The format is CPython's own and stable since version 2, and checked once at import: where
it differs, lists take the two-pass route. Whatever a route does not accept (any bad token,
a NumPy integer, an int subclass) takes the general route (``check_tokens`` then ``pack``),
which names the bad token exactly as it always has, before the lookup looks at the tree.

An int64 array (the other usual input) is checked by its cast to int32 where NumPy can refuse
a cast that changes a value (``same_value``, NumPy 2.3 on; read as uint64 first, so a negative
id is refused by the same cast), else by ``check_tokens``'s own OR.
"""

from __future__ import annotations

import marshal
import sys
from array import array
from collections.abc import Sequence
from operator import countOf

import numpy as np

from kvstate.spec.layout import TOKEN_LIMIT, check_tokens

from .radix import TOKEN_BYTES, pack, unpack

_I4 = np.dtype("<i4")
_I8 = np.dtype(np.int64)
_U8 = np.dtype(np.uint64)
_VERSION = 2         # no back-references (version 3 added them): every record stands alone


def _marshal_checked() -> bool:
    """Does this Python write a list of small ints as the records ``_from_marshal`` reads?"""
    try:
        return marshal.dumps([0, 7, 2**31 - 1, -1], _VERSION) == (
            b"[\x04\x00\x00\x00" + b"".join(b"i" + v.to_bytes(4, "little", signed=True) for v in (0, 7, 2**31 - 1, -1)))
    except (ValueError, TypeError):
        return False


_MARSHAL = _marshal_checked()


def _same_value_checked() -> bool:
    """Does this NumPy (2.3 on) refuse, in ``astype``, a cast that would change a value?"""
    try:
        np.zeros(1, _I8).astype(_I4, casting="same_value")
    except (ValueError, TypeError):
        return False       # no such casting rule here
    try:
        np.array([2**31], _I8).astype(_I4, casting="same_value")
    except (ValueError, OverflowError):
        return True
    return False


SAME_VALUE = _same_value_checked()
# ``array('i')`` is the packed form only where a C int is 4 little-endian bytes.
_ARRAY_I = array("i").itemsize == 4 and sys.byteorder == "little"


def packed_query(tokens) -> tuple[bytes, "np.ndarray | None"]:
    """``tokens`` validated and packed; the checked int64 array too when the general route made one.

    Raises what ``check_tokens`` raises, and nothing else, for every input."""
    kind = type(tokens)
    if kind is TokenIds:
        return tokens.packed, None         # checked when it was made
    if kind is np.ndarray and tokens.dtype == _I8 and tokens.ndim == 1:
        packed = _from_int64(tokens)
        if packed is not None:
            return packed, tokens
    elif kind is list:
        packed = _from_marshal(tokens) if _MARSHAL else _from_array(tokens) if _ARRAY_I else None
        if packed is not None:
            return packed, None
    checked = check_tokens(tokens, private=False)      # once: an iterator is consumed here, not twice
    return pack(checked), checked


def _from_int64(tokens: np.ndarray) -> bytes | None:
    """The packed key of a one-dimensional int64 array whose ids are all in [0, 2**31); else None.

    Where NumPy has it, the cast to int32 itself refuses every bad id (``same_value``): the ids
    are read as uint64, so a negative one is 2**63 or more and out of range like any id from
    2**31 up. One cast, where ``check_tokens``'s OR-reduce and then the cast cost twice as much
    with caches cold, as a lookup finds them after the caller's ``extend`` (and a sign test on
    the packed key's top bytes, ``[3::4].isascii()``, cost ~40% more again: measured with the
    caches cold, ``bench/versus_sglang.py``). Else that OR (no bit from 2**31 up, sign
    included), after which the cast is exact."""
    if SAME_VALUE:
        try:      # read as uint64, a negative id is 2**63 or more: the one cast refuses it too
            return tokens.view(_U8).astype(_I4, casting="same_value").tobytes()
        except (ValueError, OverflowError):
            return None
    if not tokens.size or 0 <= int(np.bitwise_or.reduce(tokens)) < TOKEN_LIMIT:
        return tokens.astype(_I4).tobytes()
    return None


def packed_ids(tokens: np.ndarray) -> bytes:
    """Checked token ids (``check_tokens``'s int64 array) packed by the lookup's own cast.

    ``Context._write`` packs each ``extend``'s key with it, so the cast a lookup runs next is the
    one the ``extend`` just ran: its machinery is then warm in the caches, not evicted by the
    extend's page-by-page work (at one-token pages that cast cost a lookup ~3x its warm time)."""
    packed = _from_int64(tokens) if tokens.dtype == _I8 and tokens.ndim == 1 else None
    return pack(tokens) if packed is None else packed


def _from_marshal(items: list) -> bytes | None:
    """The packed key of a list of plain ints in [0, 2**31), from one marshal pass; else None.

    Its checks are bytes methods, not NumPy reductions: a lookup runs right after the caller's
    ``extend``, with caches cold, where a ufunc reduce's machinery cost ~20 µs of a ~40 µs list
    check on 1,700 tokens (``bench/versus_sglang.py``); ``isascii`` on the top bytes does the
    same sign test in one C loop over the payloads."""
    try:
        out = marshal.dumps(items, _VERSION)
    except (ValueError, TypeError):        # something marshal cannot write (a NumPy scalar, ...)
        return None
    n = len(items)        # a list's header is b'[' + n: only its records are read
    if len(out) != 5 + 5 * n:
        return None       # a record that is not a small int (a bool is shorter, a big int longer)
    if not n:
        return b""
    # Every tag 'i' (lengths can balance out: three bools, two big ints), so by induction every
    # record is a 5-byte int; then no top payload byte has its high bit set: none is negative.
    # The tags are compared with n 'i's (a memset and a memcmp), not counted: ``count``'s loop
    # cost 2 µs more at 3,000 ids, 3% of a list lookup where histories are shared.
    if out[5::5] != b"i" * n or not out[9::5].isascii():
        return None       # a bad record or a negative id: named by the general route
    return np.ndarray((n,), _I4, out, 6, (5,)).tobytes()


def _from_array(items: list) -> bytes | None:
    """The two-pass route: a type scan, then ``array('i')`` (it refuses ids from 2**31 up)."""
    if countOf(map(type, items), int) != len(items):
        return None
    try:
        ids = array("i", items)
    except (OverflowError, TypeError):
        return None
    if ids and int(np.bitwise_or.reduce(np.frombuffer(ids, _I4))) < 0:
        return None
    return ids.tobytes()


def unpacked(packed: bytes) -> np.ndarray:
    """The int64 token ids of a packed key (for a second tier, which takes arrays)."""
    return np.frombuffer(packed, _I4).astype(np.int64)


class TokenIds(Sequence):
    """Token ids checked once, as they are added: a conversation's ids, grown turn by turn.

    A lookup checks every id it is given (a bad one gets its named error before anything
    changes), so a list holding a whole conversation is read in full at every ``match``; at a
    few thousand ids that reading is most of the lookup (``bench/versus_sglang.py``).
    ``TokenIds`` holds ids already checked, packed as the tree's keys are, and never changes:
    ``ids + turn`` checks ``turn`` alone and makes a new ``TokenIds``; ``match(ids)`` takes the
    packed key as it is. Anywhere else it reads as a sequence of ints (a ``collections.abc.Sequence``).
    """

    __slots__ = ("_packed",)
    __array_ufunc__ = None      # ``array + ids`` is a TypeError, not element-wise sums of token ids

    def __init__(self, tokens=()) -> None:
        if hasattr(self, "_packed"):
            raise TypeError("TokenIds never change: make new ones (ids + turn)")
        object.__setattr__(self, "_packed", packed_query(tokens)[0])     # checked as a lookup checks them

    @classmethod
    def _of(cls, packed: bytes) -> "TokenIds":
        made = object.__new__(cls)
        object.__setattr__(made, "_packed", packed)
        return made

    def __setattr__(self, name, value) -> None:
        raise AttributeError("TokenIds never change: make new ones (ids + turn)")

    def __delattr__(self, name) -> None:
        raise AttributeError("TokenIds never change: make new ones (ids + turn)")

    def __reduce__(self):
        return TokenIds, (list(self),)       # checked again when loaded: a pickle is only bytes

    @property
    def packed(self) -> bytes:
        """The ids as the tree's packed key (int32, little-endian)."""
        return self._packed

    def __add__(self, more) -> "TokenIds":
        return TokenIds._of(self._packed + packed_query(more)[0])     # ``more`` checked before anything is made

    def __len__(self) -> int:
        return len(self._packed) // TOKEN_BYTES

    def __iter__(self):
        return iter(unpack(self._packed))

    # A ``Sequence``'s searches, over the unpacked ids at once rather than an id at a time.
    def __contains__(self, value) -> bool:
        return value in unpack(self._packed)

    def index(self, value, start: int = 0, stop: int = sys.maxsize) -> int:
        return unpack(self._packed).index(value, start, stop)

    def count(self, value) -> int:
        return unpack(self._packed).count(value)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return TokenIds(unpack(self._packed)[index])
            return TokenIds._of(self._packed[start * TOKEN_BYTES:max(start, stop) * TOKEN_BYTES])
        i = range(len(self))[index]      # IndexError past either end, as any sequence
        return int.from_bytes(self._packed[i * TOKEN_BYTES:(i + 1) * TOKEN_BYTES], "little")

    def __eq__(self, other) -> bool:
        return isinstance(other, TokenIds) and other._packed == self._packed

    def __hash__(self) -> int:
        return hash(self._packed)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if copy is False:
            raise ValueError("TokenIds hold packed int32 ids: an array of them is always a copy")
        return unpacked(self._packed) if dtype is None else unpacked(self._packed).astype(dtype)

    def __repr__(self) -> str:
        ids = unpack(self._packed)
        shown = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
        return f"TokenIds([{shown}], {len(ids)} ids)"
