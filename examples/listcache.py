"""A third-party backend written only against ``kvstate.spec``: the proof that the plug point works.

``ListCache`` is a small engine of its own: pages with refcounts, copy-on-write,
and a flat list of prefix entries instead of a radix tree (it reports
``tree=None``). It shares nothing with ``kvstate.impl``. Pages store what a read
returns (values already rounded to the cache's precision by
``kvstate.spec.precision``), so reads are bit-exact without a page codec.

    kvstate conform examples/listcache.py          # passes
    kvstate conform examples/broken_sharing.py     # a variant that shares pages on write: rejected
"""

from __future__ import annotations

import numpy as np

from kvstate.spec import Config, EntryView, Layout, Observation, PageView
from kvstate.spec import precision as precisions
from kvstate.spec.errors import ContextClosedError, EmptyContextError, PositionError
from kvstate.spec.layout import check_tokens, check_values, require_finite


class Page:
    def __init__(self, page_id: int, layout: Layout, page_tokens: int):
        self.page_id = page_id
        self.refcount = 1
        self.values = np.zeros((page_tokens, *layout.position_shape), np.float32)
        self.tokens = np.zeros(page_tokens, np.int64)


class ListContext:
    def __init__(self, cache: "ListCache", pages: list[Page], length: int):
        self.cache = cache
        self.pages = pages
        self.length = length
        self.closed = False

    def __len__(self) -> int:
        return self.length

    def _open(self) -> None:
        if self.closed:
            raise ContextClosedError("this context is closed")

    @property
    def tokens(self) -> list[int]:
        self._open()
        return [int(t) for t in self._positions()[1]]

    def _positions(self, start: int = 0, stop: int | None = None):
        stop = self.length if stop is None else stop
        values = [p.values for p in self.pages] or [np.zeros((0, *self.cache.layout.position_shape), np.float32)]
        tokens = [p.tokens for p in self.pages] or [np.zeros(0, np.int64)]
        return np.concatenate(values)[start:stop].copy(), np.concatenate(tokens)[start:stop].copy()

    def read(self, start: int = 0, stop: int | None = None):
        self._open()
        stop = self.length if stop is None else stop
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= self.length):
            raise PositionError(f"read of [{start}, {stop}) outside length {self.length}")
        return self._positions(start, stop)

    def _encode(self, tokens, kv, start: int | None = None):
        # One order of many: README ("several bad inputs") accepts any error that applies.
        tokens = check_tokens(tokens)
        kv = check_values(self.cache.layout, kv, len(tokens))
        self._open()
        if start is not None and not (isinstance(start, int) and 0 <= start and start + len(tokens) <= self.length):
            raise PositionError(f"overwrite of [{start}, {start + len(tokens)}) outside length {self.length}")
        require_finite(kv)
        return tokens, precisions.roundtrip(self.cache.precision, kv)

    def writable(self, index: int) -> Page:
        """Page ``index``, copied first if anyone else holds it."""
        page = self.pages[index]
        if page.refcount > 1:
            private = self.cache.new_page()
            private.values[:] = page.values
            private.tokens[:] = page.tokens
            self.cache.release(page)
            self.pages[index] = private
        return self.pages[index]

    def _store(self, start: int, tokens: np.ndarray, values: np.ndarray) -> None:
        size = self.cache.page_tokens
        for i, position in enumerate(range(start, start + len(tokens))):
            index, offset = divmod(position, size)
            while index >= len(self.pages):
                self.pages.append(self.cache.new_page())
            page = self.writable(index)
            page.values[offset] = values[i]
            page.tokens[offset] = tokens[i]

    def extend(self, tokens, kv) -> None:
        tokens, values = self._encode(tokens, kv)
        self._store(self.length, tokens, values)
        self.length += len(tokens)

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, values = self._encode(tokens, kv, start)
        self._store(start, tokens, values)

    def fork(self) -> "ListContext":
        self._open()
        return self.cache.adopt(list(self.pages), self.length)

    def truncate(self, n: int) -> None:
        self._open()
        if not (isinstance(n, int) and 0 <= n <= self.length):
            raise PositionError(f"truncate to {n} outside length {self.length}")
        keep = -(-n // self.cache.page_tokens)
        for page in self.pages[keep:]:
            self.cache.release(page)
        del self.pages[keep:]
        self.length = n   # stale positions past n are never read, and extend overwrites them

    def close(self) -> None:
        self._open()
        for page in self.pages:
            self.cache.release(page)
        self.pages = []
        self.closed = True
        self.cache.contexts.remove(self)


class ListCache:
    context_class = ListContext     # a variant backend swaps in its own context class here

    def __init__(self, config: Config):
        self.layout = config.layout
        self.page_tokens = config.page_tokens
        self.precision = config.precision
        self.max_entries = config.max_entries
        self.live: dict[int, Page] = {}
        self.allocated = 0
        self.freed = 0
        self.contexts: list[ListContext] = []
        self.entries: list[list] = []    # [key, ListContext, tick]
        self.clock = 0

    # -- pages ----------------------------------------------------------------------

    def new_page(self) -> Page:
        self.allocated += 1
        page = Page(self.allocated, self.layout, self.page_tokens)
        self.live[page.page_id] = page
        return page

    def release(self, page: Page) -> None:
        page.refcount -= 1
        if page.refcount == 0:
            del self.live[page.page_id]
            self.freed += 1

    def adopt(self, pages: list[Page], length: int, register: bool = True) -> ListContext:
        for page in pages:
            page.refcount += 1
        ctx = self.context_class(self, pages, length)
        if register:
            self.contexts.append(ctx)
        return ctx

    # -- the protocol ------------------------------------------------------------------

    def allocate(self) -> ListContext:
        return self.adopt([], 0)

    def retain(self, ctx: ListContext) -> None:
        ctx._open()
        if len(ctx) == 0:
            raise EmptyContextError("cannot retain an empty context")
        key = tuple(ctx.tokens)
        for entry in [e for e in self.entries if e[0] == key]:
            self._drop(entry)
        self.clock += 1
        self.entries.append([key, self.adopt(list(ctx.pages), ctx.length, register=False), self.clock])
        while len(self.entries) > self.max_entries:
            self._drop(min(self.entries[:-1], key=lambda e: e[2]))

    def _drop(self, entry) -> None:
        self.entries.remove(entry)
        for page in entry[1].pages:
            self.release(page)

    def match(self, tokens):
        query = tuple(int(t) for t in check_tokens(tokens))
        hits = [e for e in self.entries if query[:len(e[0])] == e[0]]
        if not hits:
            return self.allocate(), 0
        best = max(hits, key=lambda e: len(e[0]))
        self.clock += 1
        best[2] = self.clock
        return self.adopt(list(best[1].pages), best[1].length), len(best[0])

    def clear(self) -> None:
        for entry in list(self.entries):
            self._drop(entry)

    def observe(self) -> Observation:
        holders, lengths = {}, {}
        for i, ctx in enumerate(self.contexts):
            holders[f"ctx:{i}"] = tuple(p.page_id for p in ctx.pages)
            lengths[f"ctx:{i}"] = ctx.length
        entries = []
        for i, (key, ctx, tick) in enumerate(sorted(self.entries, key=lambda e: e[2])):
            holders[f"entry:{i}"] = tuple(p.page_id for p in ctx.pages)
            lengths[f"entry:{i}"] = ctx.length
            entries.append(EntryView(key, tick, f"entry:{i}"))
        pages = {pid: PageView(pid, page.refcount, None) for pid, page in self.live.items()}
        return Observation(pages=pages, holders=holders, lengths=lengths,
                           pages_allocated=self.allocated, pages_freed=self.freed,
                           arena_size=0, arena_out={}, arena_free=(), tree=None, entries=tuple(entries))


def factory(config: Config) -> ListCache:
    return ListCache(config)


# No arena here: declare the three precisions on the heap only.
factory.configs = [Config(Layout(layers=2, kv_heads=2, head_dim=4), page_tokens=4, precision=p,
                          arena_pages=0, max_entries=2) for p in precisions.PRECISIONS]
factory.any_page_size = True      # written for any page size: checked at sizes drawn 1-8 per run
