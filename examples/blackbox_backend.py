"""The black-box observation tier: a backend that exposes nothing but its public operations.

``BoxCache`` keeps no pages at all: every context owns a copy of what a read returns
(values already rounded to the cache's precision by ``kvstate.spec.precision``), a fork
copies it, and the prefix cache is an LRU dictionary of copies. An engine whose pages
live where Python cannot see them (a GPU allocator, a server behind an API) is in the
same position, so ``observe()`` returns ``kvstate.spec.observation.black_box()``:
no pages, holders, arena books, entries or tree.

The suite still checks, for every operation, what the backend shows from outside:
values and tokens read back, how many positions a ``match`` holds, which error class a
refusal raises, and the eviction order as ``match`` sees it (an evicted key stops
matching). The invariants over pages (1, 2, 6), the arena (3) and the tree (5) are
reported n/a, as are the directed checks that count pages.

It declares token and block matching besides the seed's entry matching
(``factory.semantics``), so it is checked under those configurations too.

    kvstate conform examples/blackbox_backend.py
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvstate.spec import Config
from kvstate.spec import precision as precisions
from kvstate.spec.errors import ConfigError, ContextClosedError, EmptyContextError, PositionError
from kvstate.spec.layout import check_tokens, check_values, require_finite
from kvstate.spec.observation import Observation, black_box
from kvstate.spec.semantics import hit_length


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class BoxContext:
    def __init__(self, cache: "BoxCache", values: np.ndarray, tokens: list[int]):
        self.cache = cache
        self.values = values          # (n, layers, 2, kv_heads, head_dim) float32, as a read returns it
        self.token_list = tokens
        self.closed = False

    def __len__(self) -> int:
        return len(self.token_list)

    def _open(self) -> None:
        if self.closed:
            raise ContextClosedError("this context is closed")

    @property
    def tokens(self) -> list[int]:
        self._open()
        return list(self.token_list)

    def _checked(self, tokens, kv) -> tuple[list[int], np.ndarray]:
        # The order of spec/errors.py: tokens, the array's dtype and shape, then the context.
        tokens = check_tokens(tokens)
        kv = check_values(self.cache.config.layout, kv, len(tokens))
        self._open()
        return [int(t) for t in tokens], kv

    def _stored(self, kv: np.ndarray) -> np.ndarray:
        require_finite(kv)
        return precisions.roundtrip(self.cache.config.precision, kv)

    def extend(self, tokens, kv) -> None:
        tokens, kv = self._checked(tokens, kv)
        values = self._stored(kv)
        self.values = np.concatenate([self.values, values])
        self.token_list = self.token_list + tokens

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, kv = self._checked(tokens, kv)
        if not _is_int(start) or start < 0 or start + len(tokens) > len(self):
            raise PositionError(f"overwrite of {len(tokens)} positions at {start!r} is outside length {len(self)}")
        values = self._stored(kv)
        self.values = self.values.copy()
        self.values[start:start + len(tokens)] = values
        self.token_list = self.token_list[:start] + tokens + self.token_list[start + len(tokens):]

    def read(self, start: int = 0, stop: int | None = None):
        self._open()
        stop = len(self) if stop is None else stop
        if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= len(self)):
            raise PositionError(f"read of [{start}, {stop}) outside length {len(self)}")
        return self.values[start:stop].copy(), np.array(self.token_list[start:stop], dtype=np.int64)

    def fork(self) -> "BoxContext":
        self._open()
        return self.cache.adopt(self.values.copy(), list(self.token_list))

    def truncate(self, n: int) -> None:
        self._open()
        if not (_is_int(n) and 0 <= n <= len(self)):
            raise PositionError(f"truncate to {n} outside length {len(self)}")
        self.values = self.values[:n].copy()
        self.token_list = self.token_list[:n]

    def close(self) -> None:
        self._open()
        self.closed = True
        self.cache.contexts.remove(self)


class BoxCache:
    def __init__(self, config: Config):
        if config.max_pages or config.on_full != "fallback":
            # (an arena with on_full="fallback" is fine: pages come from ordinary memory anyway)
            raise ConfigError(f"BoxCache has no pages: it cannot bound them ({config.name})")
        self.config = config
        self.contexts: list[BoxContext] = []
        # key -> (values, tokens), least recently used first
        self.entries: OrderedDict[tuple[int, ...], tuple[np.ndarray, list[int]]] = OrderedDict()

    def adopt(self, values: np.ndarray, tokens: list[int]) -> BoxContext:
        ctx = BoxContext(self, values, tokens)
        self.contexts.append(ctx)
        return ctx

    def allocate(self) -> BoxContext:
        return self.adopt(np.zeros(self.config.layout.batch_shape(0), np.float32), [])

    def retain(self, ctx: BoxContext) -> None:
        ctx._open()
        if len(ctx) == 0:
            raise EmptyContextError("cannot retain an empty context")
        key = tuple(ctx.token_list)
        self.entries.pop(key, None)
        self.entries[key] = (ctx.values.copy(), list(ctx.token_list))
        while len(self.entries) > self.config.max_entries:
            self.entries.popitem(last=False)          # the oldest; never the one just retained

    def match(self, tokens):
        query = tuple(int(t) for t in check_tokens(tokens))
        key, length = self._hit(query)
        if key is None:
            return self.allocate(), 0
        self.entries.move_to_end(key)                 # stamp the hit's entry only
        values, entry_tokens = self.entries[key]
        return self.adopt(values[:length].copy(), entry_tokens[:length]), length

    def _hit(self, query: tuple[int, ...]):
        """The key a hit is taken from and the positions it holds (spec/semantics.py)."""
        if self.config.match == "entry":
            prefixes = [key for key in self.entries if query[:len(key)] == key]
            best = max(prefixes, key=len, default=None)
            return best, len(best or ())
        common = {key: _common_prefix(key, query) for key in self.entries}
        longest = max(common.values(), default=0)
        length = hit_length(self.config.match, self.config.block_tokens, longest)
        if length == 0:
            return None, 0
        newest = [key for key in self.entries if common[key] >= length][-1]   # most recently used of those holding the hit
        return newest, length

    def clear(self) -> None:
        self.entries.clear()

    def observe(self) -> Observation:
        return black_box()


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def factory(config: Config) -> BoxCache:
    return BoxCache(config)


# The six standard configurations (an arena is simply not used: pages come from ordinary
# memory, which is what a full arena falls back to), plus those with token or block matching.
factory.semantics = {"token", "block"}
