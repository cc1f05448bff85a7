"""A free-queue variant of ``copy_per_entry`` (an audit's): pages are fixed slots handed out in the order
they were freed, cached ones among them (vLLM's free queue), entries take no reference, and a cached page
handed out cuts the entries listing it. Correct as ``reclaim-fifo``; declared ``reclaim`` it forgets
without pressure (``tests/test_reclaim_copy_per_entry.py``). The engine it varies:

PoolEngine: an outsider's engine with a fixed page pool and a token-granular prefix cache.

Pages are refcounted (contexts and entries both hold references). The prefix cache is a flat
list of entries (key, pages). Matching is token-granular (longest common prefix with any key,
most recently used among those sharing the hit). The pool is fixed (pool_pages): an operation
whose need would pass it first checks whether the pages contexts hold plus the need fit; if not
it refuses (CapacityError, nothing changed); else it reclaims cached pages by its OWN policy:
the entry with the LONGEST key goes first (ties: the oldest insertion), whole entries, until
the need fits. Black-box tier only.

Its pages and contexts are ``copy_per_entry``'s; a cached page is copied before a write too.
"""
from __future__ import annotations

from kvstate.spec import Config, Layout
from kvstate.spec.errors import CapacityError, EmptyContextError
from kvstate.spec.layout import check_tokens
from kvstate.spec.observation import black_box

from .copy_per_entry import Ctx as _PerEntryCtx
from .copy_per_entry import Page


class Ctx(_PerEntryCtx):
    def _must_copy(self, page):
        """A cached page is copied too: entries take no reference, and it may be handed out again."""
        return page.refcount > 1 or self.cache.cached(page)


class PoolCache:
    def __init__(self, config: Config):
        self.layout = config.layout
        self.page_tokens = config.page_tokens
        self.precision = config.precision
        self.max_entries = config.max_entries
        self.pool = config.pool_limit
        self.block = config.block_tokens
        self.slots = [Page(k + 1, self.layout, self.page_tokens) for k in range(self.pool)]
        for p in self.slots:
            p.refcount = 0
        self.free = list(self.slots)       # release order; cached pages wait here too
        self.contexts = []
        self.entries = []      # [key, pages, tick, seq]; entries take no reference
        self.clock = 0
        self.seq = 0

    @property
    def live(self):
        return {p.page_id: p for p in self.slots if p.refcount > 0}

    def new_page(self):
        page = self.free.pop(0)
        for e in list(self.entries):        # a cached page reused: entries listing it are cut before it
            if page in e[1]:
                k = e[1].index(page)
                del e[1][k:]
                e[0] = e[0][:k * self.page_tokens]
                if not e[1]:
                    self.entries.remove(e)
        page.refcount = 1
        page.values[:] = 0
        page.tokens[:] = 0
        return page

    def release(self, page):
        page.refcount -= 1
        if page.refcount == 0:
            self.free.append(page)

    def take(self, page):
        if page.refcount == 0:
            self.free.remove(page)
        page.refcount += 1

    def adopt(self, pages, length, register=True):
        for page in pages:
            self.take(page)
        ctx = Ctx(self, pages, length)
        if register:
            self.contexts.append(ctx)
        return ctx

    def cached(self, page):
        return any(page in e[1] for e in self.entries)

    def make_room(self, need, writer=None):
        if need > len(self.free):
            raise CapacityError(f"{len(self.free)} free pages, need {need}")

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
        self.entries.append([key, pages, self.clock, self.seq])
        while len(self.entries) > self.max_entries:
            self._drop(min(self.entries[:-1], key=lambda e: e[2]))

    def _drop(self, entry):
        self.entries.remove(entry)

    def match(self, tokens):
        query = tuple(int(t) for t in check_tokens(tokens))
        def lcp(key):
            n = 0
            for a, b in zip(key, query):
                if a != b:
                    break
                n += 1
            return n
        common = [(lcp(e[0]), e) for e in self.entries]
        length = max((n for n, _ in common), default=0)
        if self.block:
            length = length // self.block * self.block
        if length == 0:
            return self.allocate(), 0
        best = max((e for n, e in common if n >= length), key=lambda e: e[2])
        self.clock += 1
        best[2] = self.clock
        keep = -(-length // self.page_tokens)
        return self.adopt(list(best[1][:keep]), length), length

    def clear(self):
        for entry in list(self.entries):
            self._drop(entry)

    def observe(self):
        return black_box()


def factory(config: Config) -> PoolCache:
    return PoolCache(config)


_L = Layout(layers=2, kv_heads=2, head_dim=4)
CONFIG = Config(_L, page_tokens=4, precision="f32", pool_pages=10, max_entries=4, match="token",
                on_full="reclaim-fifo", values="prefix")
factory.configs = [CONFIG]
