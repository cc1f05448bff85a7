"""The reference model: deliberately stupid, obviously correct.

Every context owns a full float32 copy of exactly what a read must return, plus
its own token list. Nothing is shared. The prefix "tree" is a flat list scanned
linearly, once per declared match semantics (``spec/semantics.py``). Recency uses
a logical clock, so entry sets and eviction order compare exactly.

The page pool (``on_full``) is modelled by counting, not by sharing: every holder
keeps a list of page *labels*, integers naming the pages an engine would hold. A
fork copies the labels; a write into a page whose label another holder lists takes
a fresh label (the copy ``writable`` would make); new pages take fresh labels. Live
pages are the distinct labels. No value is ever shared.
"""

from __future__ import annotations

import numpy as np

from kvstate.spec import precision as precisions
from kvstate.spec.arithmetic import pages_needed, pages_touched
from kvstate.spec.errors import (CapacityError, ContextClosedError, EmptyContextError, PositionError,
                                 PrecisionRangeError, SnapshotPrecisionError)
from kvstate.spec.layout import check_tokens, check_values, require_finite
from kvstate.spec.protocol import Config
from kvstate.spec.semantics import entry_pages, hit_length


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class RefContext:
    def __init__(self, cache: "RefCache", values: np.ndarray, tokens: list[int], labels: list[int]):
        self.cache = cache
        self.values = values      # (n, layers, 2, kv_heads, head_dim) float32, as reads return it
        self.token_list = tokens
        self.labels = labels      # the pages an engine would hold, by label (see the module docstring)
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

    def _arguments(self, tokens, kv) -> tuple[np.ndarray, list[int]]:
        # The order of spec/errors.py: tokens, the array's dtype and shape, then the context.
        tokens = check_tokens(tokens)
        kv = check_values(self.cache.config.layout, kv, len(tokens))
        self._require_open()
        return kv, [int(t) for t in tokens]

    def _stored(self, kv: np.ndarray) -> np.ndarray:
        # ... then the values themselves: finite, and representable at the precision.
        require_finite(kv)
        return precisions.roundtrip(self.cache.config.precision, kv)

    def extend(self, tokens, kv) -> None:
        kv, tokens = self._arguments(tokens, kv)
        values = self._stored(kv)
        if not tokens:
            return
        start, stop = len(self), len(self) + len(tokens)
        first = pages_touched(start, stop, self.cache.config.page_tokens)[0]
        copies = [first] if first < len(self.labels) and self.cache.shared(self.labels[first]) else []
        fresh = pages_needed(stop, self.cache.config.page_tokens) - len(self.labels)
        self.cache.make_room(len(copies) + fresh)
        self._relabel(copies)
        self.labels = self.labels + [self.cache.new_label() for _ in range(fresh)]
        self.values = np.concatenate([self.values, values])
        self.token_list = self.token_list + tokens

    def overwrite(self, start: int, tokens, kv) -> None:
        kv, tokens = self._arguments(tokens, kv)
        if not _is_int(start) or start < 0 or start + len(tokens) > len(self):
            raise PositionError(f"overwrite of {len(tokens)} positions at {start!r} is outside length {len(self)}")
        values = self._stored(kv)
        if not tokens:
            return
        touched = range(*pages_touched(start, start + len(tokens), self.cache.config.page_tokens))
        self.cache.make_room(sum(self.cache.shared(self.labels[i]) for i in touched))
        self._relabel(touched)
        self.values = self.values.copy()
        self.values[start:start + len(tokens)] = values
        self.token_list = self.token_list[:start] + tokens + self.token_list[start + len(tokens):]

    def _relabel(self, indexes) -> None:
        """The copy ``writable`` makes: a page another holder lists gets a label of its own."""
        for i in indexes:
            if self.cache.shared(self.labels[i]):
                self.labels = self.labels[:i] + [self.cache.new_label()] + self.labels[i + 1:]

    def read(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        self._require_open()
        stop = len(self) if stop is None else stop
        if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= len(self)):
            raise PositionError(f"read of [{start}, {stop}) outside length {len(self)}")
        return self.values[start:stop].copy(), np.array(self.token_list[start:stop], dtype=np.int64)

    def fork(self) -> "RefContext":
        self._require_open()
        return self.cache._adopt(self.values.copy(), list(self.token_list), list(self.labels))

    def truncate(self, n: int) -> None:
        self._require_open()
        if not (_is_int(n) and 0 <= n <= len(self)):
            raise PositionError(f"truncate to {n} outside length {len(self)}")
        self.values = self.values[:n].copy()
        self.token_list = self.token_list[:n]
        self.labels = self.labels[:pages_needed(n, self.cache.config.page_tokens)]

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
        self.labels_issued = 0

    # -- page labels: the pool, counted ------------------------------------------------

    def new_label(self) -> int:
        self.labels_issued += 1
        return self.labels_issued

    def _holders(self) -> list[RefContext]:
        return self.contexts + [entry[1] for entry in self.entries]

    def holders_of(self, label: int) -> int:
        return sum(holder.labels.count(label) for holder in self._holders())

    def shared(self, label: int) -> bool:
        return self.holders_of(label) > 1

    def live_pages(self) -> int:
        return len({label for holder in self._holders() for label in holder.labels})

    def make_room(self, needed: int) -> None:
        """``on_full`` for an operation that needs ``needed`` new pages (spec/semantics.py)."""
        limit = self.config.pool_limit
        if not needed or not limit or self.live_pages() + needed <= limit:
            return
        if self.config.on_full == "refuse":
            raise CapacityError(f"{self.live_pages()} live pages + {needed} needed > pool of {limit}")
        while self.config.on_full == "evict" and self.live_pages() + needed > limit:
            frees = [entry for entry in self.entries
                     if any(self.holders_of(label) == 1 for label in entry[1].labels)]
            if not frees:
                break
            self.entries.remove(min(frees, key=lambda entry: entry[2]))

    # -- contexts ------------------------------------------------------------------------

    def _adopt(self, values: np.ndarray, tokens: list[int], labels: list[int]) -> RefContext:
        ctx = RefContext(self, values, tokens, labels)
        self.contexts.append(ctx)
        return ctx

    def allocate(self) -> RefContext:
        return self._adopt(np.zeros(self.config.layout.batch_shape(0), np.float32), [], [])

    def restore(self, saved: tuple[str, np.ndarray, list[int]]) -> RefContext:
        """A new context from ``RefContext.snapshot()``'s result, converted by spec rules if the precision differs."""
        precision, values, tokens = saved
        if precision != self.config.precision:
            try:
                values = precisions.roundtrip(self.config.precision, values)
            except PrecisionRangeError as error:
                raise SnapshotPrecisionError(str(error)) from None     # a refusal of the file
        pages = pages_needed(len(tokens), self.config.page_tokens)
        self.make_room(pages)
        return self._adopt(values.copy(), list(tokens), [self.new_label() for _ in range(pages)])

    # -- the prefix "tree": a flat list ----------------------------------------------------

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def retain(self, ctx: RefContext) -> None:
        ctx._require_open()
        if len(ctx) == 0:
            raise EmptyContextError("cannot retain an empty context")
        key = tuple(ctx.token_list)
        self.entries = [entry for entry in self.entries if entry[0] != key]
        private = RefContext(self, ctx.values.copy(), list(ctx.token_list), list(ctx.labels))
        newest = [key, private, self._tick()]
        self.entries.append(newest)
        while len(self.entries) > self.config.max_entries or self._over_page_budget():
            older = [entry for entry in self.entries if entry is not newest]
            if not older:
                break
            self.entries.remove(min(older, key=lambda entry: entry[2]))

    def _over_page_budget(self) -> bool:
        budget = self.config.max_pages
        return bool(budget) and sum(entry_pages(len(entry[0]), self.config.page_tokens)
                                    for entry in self.entries) > budget

    def match(self, tokens) -> tuple[RefContext, int]:
        query = tuple(int(t) for t in check_tokens(tokens))
        best, length = self._lookup(query)
        if best is None:
            return self.allocate(), 0
        best[2] = self._tick()
        entry = best[1]
        labels = entry.labels[:pages_needed(length, self.config.page_tokens)]
        return self._adopt(entry.values[:length].copy(), list(entry.token_list[:length]), list(labels)), length

    def _lookup(self, query: tuple[int, ...]):
        """The entry a hit is taken from and the positions it holds, or ``(None, 0)``."""
        if self.config.match == "entry":
            prefixes = [entry for entry in self.entries if query[:len(entry[0])] == entry[0]]
            if not prefixes:
                return None, 0
            best = max(prefixes, key=lambda entry: len(entry[0]))
            return best, len(best[0])
        common = {id(entry): _common_prefix(entry[0], query) for entry in self.entries}
        longest = max(common.values(), default=0)
        length = hit_length(self.config.match, self.config.block_tokens, longest)
        if length == 0:
            return None, 0
        best = max((entry for entry in self.entries if common[id(entry)] == longest), key=lambda entry: entry[2])
        return best, length

    def clear(self) -> None:
        self.entries = []

    def eviction_order(self) -> list[tuple[tuple[int, ...], int]]:
        """Entries as (key, tick), least recently used first."""
        return sorted(((entry[0], entry[2]) for entry in self.entries), key=lambda pair: pair[1])


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
