"""A backend that keeps its refcounts lazily, as engines batching their bookkeeping do (an audit's, s74).

``examples/listcache.py`` with every refcount change queued, and applied only when ``observe()`` looks
or ``BATCH`` changes wait, or a write needs a page's count; a page whose count reaches 0 is freed then.
Its copy-on-write reads exact counts, so it is correct, and conform must pass it.

Two plants the whole suite missed, since every lockstep and seeded step observed first, which applies
what is queued: ``settled_cow_factory``'s copy-on-write reads the applied count alone, so a write right
after a fork, with nothing observed between them, lands in a page the fork shares;
``decrements_first_factory`` applies the queued decrements before the increments, so a page retained
and let go by its context in one batch is freed while the entry holds it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from listcache import ListCache, ListContext, factory as _listcache  # noqa: E402

BATCH = 32


class LazyContext(ListContext):
    def writable(self, index: int):
        self.cache.settle()         # copy-on-write reads exact counts: the queue applied first
        return super().writable(index)


class LazyCache(ListCache):
    context_class = LazyContext

    def __init__(self, config):
        super().__init__(config)
        self.queued: list = []          # (page, +1 or -1), oldest first

    def _queue(self, page, delta: int) -> None:
        self.queued.append((page, delta))
        if len(self.queued) >= BATCH:
            self.settle()

    def settle(self) -> None:
        queued, self.queued = self.queued, []
        for page, delta in queued:
            page.refcount += delta
        for page, _ in queued:
            if page.refcount == 0 and page.page_id in self.live:
                del self.live[page.page_id]
                self.freed += 1

    def release(self, page) -> None:
        self._queue(page, -1)

    def adopt(self, pages, length, register=True):
        ctx = self.context_class(self, pages, length)
        for page in pages:
            self._queue(page, +1)
        if register:
            self.contexts.append(ctx)
        return ctx

    def observe(self):
        self.settle()
        return super().observe()


class SettledCowContext(LazyContext):
    writable = ListContext.writable     # the bug: the queued counts (a fork's) are not applied first


class SettledCowCache(LazyCache):
    context_class = SettledCowContext


class DecrementsFirstCache(LazyCache):
    def settle(self) -> None:
        queued, self.queued = sorted(self.queued, key=lambda change: change[1]), []   # the bug: every -1 first
        for page, delta in queued:
            page.refcount += delta
            if page.refcount == 0 and page.page_id in self.live:       # freed as it reaches 0
                del self.live[page.page_id]
                self.freed += 1


def factory(config):
    return LazyCache(config)


def settled_cow_factory(config):
    return SettledCowCache(config)


def decrements_first_factory(config):
    return DecrementsFirstCache(config)


for _made in (factory, settled_cow_factory, decrements_first_factory):
    _made.configs = _listcache.configs
    _made.any_page_size = True
