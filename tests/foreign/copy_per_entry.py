"""An audit's engine (copied as written from README alone): one copy of the pages per entry, no sharing
by prefix between entries, a fixed pool reclaiming the longest entry first (``tests/test_reclaim_copy_per_entry.py``).

PoolEngine: an outsider's engine with a fixed page pool and a token-granular prefix cache.

Pages are refcounted (contexts and entries both hold references). The prefix cache is a flat
list of entries (key, pages). Matching is token-granular (longest common prefix with any key,
most recently used among those sharing the hit). The pool is fixed (pool_pages): an operation
whose need would pass it first checks whether the pages contexts hold plus the need fit; if not
it refuses (CapacityError, nothing changed); else it reclaims cached pages by its OWN policy:
the entry with the LONGEST key goes first (ties: the oldest insertion), whole entries, until
the need fits. Black-box tier only.
"""
from __future__ import annotations

import numpy as np

from kvstate.spec import Config, Layout
from kvstate.spec import precision as precisions
from kvstate.spec.errors import CapacityError, ContextClosedError, EmptyContextError, PositionError
from kvstate.spec.layout import check_tokens, check_values, require_finite
from kvstate.spec.observation import black_box

class Page:
    __slots__ = ("page_id", "refcount", "values", "tokens")

    def __init__(self, page_id, layout, page_tokens):
        self.page_id = page_id
        self.refcount = 1
        self.values = np.zeros((page_tokens, *layout.position_shape), np.float32)
        self.tokens = np.zeros(page_tokens, np.int64)


class Ctx:
    def __init__(self, cache, pages, length):
        self.cache, self.pages, self.length, self.closed = cache, pages, length, False

    def __len__(self):
        return self.length

    def _open(self):
        if self.closed:
            raise ContextClosedError("closed")

    @property
    def tokens(self):
        self._open()
        return [int(t) for t in self._positions()[1]]

    def _positions(self, start=0, stop=None):
        stop = self.length if stop is None else stop
        lay = self.cache.layout
        values = [p.values for p in self.pages] or [np.zeros((0, *lay.position_shape), np.float32)]
        tokens = [p.tokens for p in self.pages] or [np.zeros(0, np.int64)]
        return np.concatenate(values)[start:stop].copy(), np.concatenate(tokens)[start:stop].copy()

    def read(self, start=0, stop=None):
        self._open()
        stop = self.length if stop is None else stop
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= self.length):
            raise PositionError("read outside")
        return self._positions(start, stop)

    def _encode(self, tokens, kv, start=None):
        tokens = check_tokens(tokens)
        kv = check_values(self.cache.layout, kv, len(tokens))
        self._open()
        if start is not None and not (isinstance(start, int) and 0 <= start and start + len(tokens) <= self.length):
            raise PositionError("overwrite outside")
        require_finite(kv)
        return tokens, precisions.roundtrip(self.cache.precision, kv)

    def _need(self, start, n):
        """Pages this write allocates: new pages past the end, plus a copy of each shared page touched."""
        if n == 0:
            return 0
        P = self.cache.page_tokens
        first, last = start // P, (start + n - 1) // P
        need = 0
        for index in range(first, last + 1):
            if index >= len(self.pages):
                need += 1
            elif self._must_copy(self.pages[index]):
                need += 1
        return need

    def _must_copy(self, page):
        """Whether a write into ``page`` goes to a private copy: another holder lists it."""
        return page.refcount > 1

    def writable(self, index):
        page = self.pages[index]
        if self._must_copy(page):
            private = self.cache.new_page()
            private.values[:] = page.values
            private.tokens[:] = page.tokens
            self.cache.release(page)
            self.pages[index] = private
        return self.pages[index]

    def _store(self, start, tokens, values):
        if len(tokens) == 0:
            return
        self.cache.make_room(self._need(start, len(tokens)), self)
        size = self.cache.page_tokens
        for i, position in enumerate(range(start, start + len(tokens))):
            index, offset = divmod(position, size)
            while index >= len(self.pages):
                self.pages.append(self.cache.new_page())
            page = self.writable(index)
            page.values[offset] = values[i]
            page.tokens[offset] = tokens[i]

    def extend(self, tokens, kv):
        tokens, values = self._encode(tokens, kv)
        self._store(self.length, tokens, values)
        self.length += len(tokens)

    def overwrite(self, start, tokens, kv):
        tokens, values = self._encode(tokens, kv, start)
        self._store(start, tokens, values)

    def fork(self):
        self._open()
        return self.cache.adopt(list(self.pages), self.length)

    def truncate(self, n):
        self._open()
        if not (isinstance(n, int) and 0 <= n <= self.length):
            raise PositionError("truncate outside")
        keep = -(-n // self.cache.page_tokens)
        for page in self.pages[keep:]:
            self.cache.release(page)
        del self.pages[keep:]
        self.length = n

    def close(self):
        self._open()
        for page in self.pages:
            self.cache.release(page)
        self.pages = []
        self.closed = True
        self.cache.contexts.remove(self)


class PoolCache:
    def __init__(self, config: Config):
        self.layout = config.layout
        self.page_tokens = config.page_tokens
        self.precision = config.precision
        self.max_entries = config.max_entries
        self.pool = config.pool_limit
        self.live = {}
        self.next_id = 0
        self.contexts = []
        self.entries = []      # [key tuple, pages list, tick, insertion seq]
        self.clock = 0
        self.seq = 0

    # pages
    def new_page(self):
        self.next_id += 1
        page = Page(self.next_id, self.layout, self.page_tokens)
        self.live[page.page_id] = page
        return page

    def release(self, page):
        page.refcount -= 1
        if page.refcount == 0:
            del self.live[page.page_id]

    def adopt(self, pages, length, register=True):
        for page in pages:
            page.refcount += 1
        ctx = Ctx(self, pages, length)
        if register:
            self.contexts.append(ctx)
        return ctx

    def context_pages(self):
        ids = set()
        for c in self.contexts:
            ids.update(p.page_id for p in c.pages)
        return len(ids)

    def make_room(self, need, writer=None):
        if need == 0 or len(self.live) + need <= self.pool:
            return
        if self.context_pages() + need > self.pool:
            raise CapacityError(f"pool of {self.pool} pages: contexts hold {self.context_pages()}, need {need}")
        # own policy: longest key first, ties by oldest insertion
        while len(self.live) + need > self.pool and self.entries:
            victim = max(self.entries, key=lambda e: (len(e[0]), -e[3]))
            self._drop(victim)
        # a copy of a page only a (now dropped) entry shared is no longer needed: fine either way

    # protocol
    def allocate(self):
        return self.adopt([], 0)

    def retain(self, ctx):
        ctx._open()
        if len(ctx) == 0:
            raise EmptyContextError("empty")
        key = tuple(ctx.tokens)
        for entry in [e for e in self.entries if e[0] == key]:
            self._drop(entry)
        self.clock += 1
        self.seq += 1
        pages = list(ctx.pages)
        for p in pages:
            p.refcount += 1
        self.entries.append([key, pages, self.clock, self.seq])
        while len(self.entries) > self.max_entries:
            self._drop(min(self.entries[:-1], key=lambda e: e[2]))

    def _drop(self, entry):
        self.entries.remove(entry)
        for page in entry[1]:
            self.release(page)

    def match(self, tokens):
        query = tuple(int(t) for t in check_tokens(tokens))
        best_len, best = 0, None
        for e in self.entries:
            key = e[0]
            n = 0
            for a, b in zip(key, query):
                if a != b:
                    break
                n += 1
            if n > best_len or (n == best_len and n > 0 and best is not None and e[2] > best[2]):
                best_len, best = n, e
        if best is None or best_len == 0:
            return self.allocate(), 0
        self.clock += 1
        best[2] = self.clock
        keep = -(-best_len // self.page_tokens)
        return self.adopt(list(best[1][:keep]), best_len), best_len

    def clear(self):
        for entry in list(self.entries):
            self._drop(entry)

    def observe(self):
        return black_box()


def factory(config: Config) -> PoolCache:
    return PoolCache(config)


_L = Layout(layers=2, kv_heads=2, head_dim=4)
F16_PAGE3 = Config(_L, page_tokens=3, precision="f16", pool_pages=8, max_entries=4, match="token",
                   on_full="reclaim", values="prefix")
Q8_PAGE2 = Config(_L, page_tokens=2, precision="q8", pool_pages=6, max_entries=3, match="token",
                  on_full="reclaim", values="prefix")
factory.configs = [F16_PAGE3, Q8_PAGE2]
