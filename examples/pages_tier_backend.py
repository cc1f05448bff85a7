"""The pages observation tier: pages and refcounts, no arena books, no tree.

``examples/listcache.py``'s engine, observed through less: ``observe()`` lists the live
pages with their refcounts and each holder's page list and length, and nothing else
(``arena_size``, ``entries`` and ``tree`` are None). An engine that can walk its page
table but keeps its prefix index somewhere it cannot report (a hash map in C, say)
fits here.

Checked from outside like every backend (values, tokens, ``matched``, errors, the
eviction order as ``match`` sees it); checked on the pages tier by invariants 1
(refcount = holders), 2 (no holder points at a freed page; allocated - freed = live)
and 6 (empty after close and clear), and by the directed checks that count pages
(a fork allocates nothing, one write copies one page). The arena (3) and tree (5)
invariants and the arena evidence are reported n/a.

    kvstate conform examples/pages_tier_backend.py
"""

from __future__ import annotations

from listcache import ListCache, factory as _listcache_factory

from kvstate.spec import Observation, PageView


class PagesTierCache(ListCache):
    def observe(self) -> Observation:
        holders, lengths = {}, {}
        for i, ctx in enumerate(self.contexts):
            holders[f"ctx:{i}"] = tuple(p.page_id for p in ctx.pages)
            lengths[f"ctx:{i}"] = ctx.length
        for i, (_key, ctx, _tick) in enumerate(self.entries):     # held pages, named but not ordered
            holders[f"entry:{i}"] = tuple(p.page_id for p in ctx.pages)
            lengths[f"entry:{i}"] = ctx.length
        pages = {pid: PageView(pid, page.refcount, None) for pid, page in self.live.items()}
        return Observation(pages=pages, holders=holders, lengths=lengths,
                           pages_allocated=self.allocated, pages_freed=self.freed,
                           arena_size=None, arena_out={}, arena_free=(), tree=None, entries=None)


def factory(config) -> PagesTierCache:
    return PagesTierCache(config)


factory.configs = _listcache_factory.configs      # the three precisions, no arena
factory.any_page_size = _listcache_factory.any_page_size
