"""The reference model: deliberately stupid, obviously correct.

Every context owns a full float32 copy of exactly what a read must return, plus
its own token list. Nothing is shared. The prefix "tree" is a flat list scanned
linearly for the longest key that is a prefix of the query. Recency uses the
same logical clock as the engine, so entry sets and eviction order compare
exactly.
"""

from __future__ import annotations

import numpy as np

from kvstate.spec import precision as precisions
from kvstate.spec.errors import ContextClosedError, EmptyContextError, PositionError
from kvstate.spec.layout import check_tokens, check_values, require_finite
from kvstate.spec.protocol import Config


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class RefContext:
    def __init__(self, cache: "RefCache", values: np.ndarray, tokens: list[int]):
        self.cache = cache
        self.values = values      # (n, layers, 2, kv_heads, head_dim) float32, as reads return it
        self.token_list = tokens
        self.closed = False

    def __len__(self) -> int:
        return len(self.token_list)

    def _require_open(self) -> None:
        if self.closed:
            raise ContextClosedError("reference context is closed")

    @property
    def tokens(self) -> list[int]:
        self._require_open()
        return list(self.token_list)

    def _stored(self, tokens, kv) -> tuple[np.ndarray, list[int]]:
        # The engine's order: the arguments first, then whether the context is open.
        tokens = check_tokens(tokens)
        kv = check_values(self.cache.config.layout, kv, len(tokens))
        self._require_open()
        require_finite(kv)
        return precisions.roundtrip(self.cache.config.precision, kv), [int(t) for t in tokens]

    def extend(self, tokens, kv) -> None:
        values, tokens = self._stored(tokens, kv)
        self.values = np.concatenate([self.values, values])
        self.token_list = self.token_list + tokens

    def overwrite(self, start: int, tokens, kv) -> None:
        values, tokens = self._stored(tokens, kv)
        if not _is_int(start) or start < 0 or start + len(tokens) > len(self):
            raise PositionError(f"overwrite of {len(tokens)} positions at {start!r} is outside length {len(self)}")
        self.values = self.values.copy()
        self.values[start:start + len(tokens)] = values
        self.token_list = self.token_list[:start] + tokens + self.token_list[start + len(tokens):]

    def read(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        self._require_open()
        stop = len(self) if stop is None else stop
        if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= len(self)):
            raise PositionError(f"read of [{start}, {stop}) outside length {len(self)}")
        return self.values[start:stop].copy(), np.array(self.token_list[start:stop], dtype=np.int64)

    def fork(self) -> "RefContext":
        self._require_open()
        return self.cache._adopt(self.values.copy(), list(self.token_list))

    def truncate(self, n: int) -> None:
        self._require_open()
        if not (_is_int(n) and 0 <= n <= len(self)):
            raise PositionError(f"truncate to {n} outside length {len(self)}")
        self.values = self.values[:n].copy()
        self.token_list = self.token_list[:n]

    def snapshot(self) -> tuple[str, np.ndarray, list[int]]:
        """What a snapshot holds: the precision and a copy of what a read returns."""
        self._require_open()
        return self.cache.config.precision, self.values.copy(), list(self.token_list)

    def close(self) -> None:
        if self.closed:
            raise ContextClosedError("reference context is already closed")
        self.closed = True
        self.cache.contexts.remove(self)


class RefCache:
    def __init__(self, config: Config):
        self.config = config
        self.contexts: list[RefContext] = []
        self.entries: list[list] = []    # [key tuple, private RefContext, tick]
        self.clock = 0

    def _adopt(self, values: np.ndarray, tokens: list[int]) -> RefContext:
        ctx = RefContext(self, values, tokens)
        self.contexts.append(ctx)
        return ctx

    def allocate(self) -> RefContext:
        return self._adopt(np.zeros(self.config.layout.batch_shape(0), np.float32), [])

    def restore(self, saved: tuple[str, np.ndarray, list[int]]) -> RefContext:
        """A new context from ``RefContext.snapshot()``'s result, converted by spec rules if the precision differs."""
        precision, values, tokens = saved
        if precision != self.config.precision:
            values = precisions.roundtrip(self.config.precision, values)
        return self._adopt(values.copy(), list(tokens))

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def retain(self, ctx: RefContext) -> None:
        ctx._require_open()
        if len(ctx) == 0:
            raise EmptyContextError("cannot retain an empty context")
        key = tuple(ctx.token_list)
        self.entries = [entry for entry in self.entries if entry[0] != key]
        private = RefContext(self, ctx.values.copy(), list(ctx.token_list))
        self.entries.append([key, private, self._tick()])
        while len(self.entries) > self.config.max_entries:
            victim = min(self.entries[:-1], key=lambda entry: entry[2])
            self.entries.remove(victim)

    def match(self, tokens) -> tuple[RefContext, int]:
        query = tuple(int(t) for t in check_tokens(tokens))
        best = None
        for entry in self.entries:
            key = entry[0]
            if query[:len(key)] == key and (best is None or len(key) > len(best[0])):
                best = entry
        if best is None:
            return self.allocate(), 0
        best[2] = self._tick()
        return self._adopt(best[1].values.copy(), list(best[1].token_list)), len(best[0])

    def clear(self) -> None:
        self.entries = []

    def eviction_order(self) -> list[tuple[tuple[int, ...], int]]:
        """Entries as (key, tick), least recently used first."""
        return sorted(((entry[0], entry[2]) for entry in self.entries), key=lambda pair: pair[1])
