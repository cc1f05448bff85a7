"""What every engine adapter shares: the K/V array it keeps, and a context's tokens and checks.

An adapter's context is a request: its tokens, and where its K/V lives in the engine's own ids
(SGLang's slot ids, vLLM's block table). Everything here is the part that does not depend on the
engine: the closed flag, input validation in the order the protocol allows (``spec.layout``), the
precision round trip, and the plain array, indexed by the engine's slot ids, that holds the bytes
(the engine decides which slots; the adapter only stores values there).

A subclass supplies ``_slots(start, stop)``: the array rows of positions ``[start, stop)``.
"""

from __future__ import annotations

import itertools

import numpy as np

from kvstate.spec import Config
from kvstate.spec import precision as precisions
from kvstate.spec.errors import ContextClosedError, ForeignContextError, KVStateError, PositionError
from kvstate.spec.layout import check_tokens, check_values, require_finite

ENTRY_BOUND = 1 << 30         # no entry bound: the engines' prefix caches evict only for memory


class PoolExhausted(KVStateError):
    """The adapter's pool ran out: it is sized past anything the suite asks, so this is a finding."""


def is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class EngineCache:
    """The adapter's K/V array (rows indexed by the engine's slot ids) and its live contexts."""

    context_class: type

    def __init__(self, config: Config):
        self.config = config
        self.layout = config.layout
        self.precision = config.precision
        self.values = np.zeros((0, *self.layout.position_shape), np.float32)
        self.contexts: list[EngineContext] = []
        self._serials = itertools.count()

    def _grow(self, slots) -> None:
        top = max(slots, default=-1) + 1
        if top > len(self.values):
            grown = np.zeros((max(top, 2 * len(self.values)), *self.layout.position_shape), np.float32)
            grown[:len(self.values)] = self.values
            self.values = grown

    def store(self, slots: list[int], values: np.ndarray) -> None:
        if slots:
            self._grow(slots)
            self.values[slots] = values

    def values_at(self, slots: list[int]) -> np.ndarray:
        self._grow(slots)            # rows never written (a block copied whole) read as zeros
        return self.values[np.asarray(slots, np.int64)].copy()

    def own(self, ctx) -> "EngineContext":
        """``ctx`` if it is an open context of this cache, else the named refusal: another cache's
        request would put that cache's slot ids or blocks in this engine's tree."""
        if not isinstance(ctx, EngineContext) or ctx.cache is not self:
            raise ForeignContextError(f"retain needs a context of this cache, got {ctx!r}")
        ctx._open()
        return ctx

    def register(self, ctx: "EngineContext") -> "EngineContext":
        ctx.serial = next(self._serials)         # a stable holder name for observe()
        self.contexts.append(ctx)
        return ctx


class EngineContext:
    """A request's tokens and the checks every protocol call makes before the engine is touched."""

    def __init__(self, cache: EngineCache, tokens: list[int]):
        self.cache = cache
        self._tokens = tokens
        self.closed = False
        self.serial = -1

    def __len__(self) -> int:
        return len(self._tokens)

    def _open(self) -> None:
        if self.closed:
            raise ContextClosedError("this context is closed")

    @property
    def tokens(self) -> list[int]:
        self._open()
        return list(self._tokens)

    def _slots(self, start: int, stop: int) -> list[int]:
        raise NotImplementedError

    def read(self, start: int = 0, stop: int | None = None):
        self._open()
        stop = len(self) if stop is None else stop
        if not (is_int(start) and is_int(stop) and 0 <= start <= stop <= len(self)):
            raise PositionError(f"read of [{start}, {stop}) outside length {len(self)}")
        return self.cache.values_at(self._slots(start, stop)), np.asarray(self._tokens[start:stop], np.int64)

    def _encode(self, tokens, kv, start: int | None = None) -> tuple[list[int], np.ndarray]:
        """Validated tokens and values at the cache's precision; ``start`` is an overwrite's."""
        tokens = check_tokens(tokens)
        kv = check_values(self.cache.layout, kv, len(tokens))
        self._open()
        if start is not None and not (is_int(start) and 0 <= start and start + len(tokens) <= len(self)):
            raise PositionError(f"overwrite of [{start}, {start + len(tokens)}) outside length {len(self)}")
        kv = np.asarray(kv, np.float32)
        require_finite(kv)
        return [int(t) for t in tokens], precisions.roundtrip(self.cache.precision, kv)

    def _check_truncate(self, n: int) -> None:
        self._open()
        if not (is_int(n) and 0 <= n <= len(self)):
            raise PositionError(f"truncate to {n} outside length {len(self)}")
