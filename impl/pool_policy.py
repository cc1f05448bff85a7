"""What an operation that needs new pages does when the pool is full (``on_full``).

``make_room`` runs under the cache lock before an operation allocates or copies
anything, with the number of pages it will need, so ``refuse`` refuses before
anything changes and ``evict`` frees room before the first page is taken;
``evict-then-refuse`` first asks whether evicting every entry would make room (the
pages contexts hold), refuses if not, and otherwise evicts as ``evict`` does. Page
stores fall back to ordinary memory by themselves when their arena is out of
slots; ``fallback`` adds nothing to that. The rules are ``spec/semantics.py``'s.
"""

from __future__ import annotations

from typing import Callable

from kvstate.spec.errors import CapacityError

from .letting_go import evict_oldest
from .pages import PagePool
from .radix import RadixTree


class PoolPolicy:
    def __init__(self, on_full: str, limit: int, pool: PagePool, tree: RadixTree,
                 release_entry: Callable[[object], None], context_page_ids: Callable[[], set[int]]):
        self.on_full = on_full
        self.limit = limit               # live pages; 0: no limit
        self.pool = pool
        self.tree = tree
        self.release_entry = release_entry
        self.context_page_ids = context_page_ids    # pages contexts list: what evicting every entry leaves live
        self.evictions = 0

    def fits(self, needed: int) -> bool:
        return not self.limit or self.pool.live_count + needed <= self.limit

    def make_room(self, needed: int) -> None:
        if needed <= 0 or self.fits(needed):
            return
        if self.on_full == "refuse":
            raise CapacityError(f"{self.pool.live_count} live pages + {needed} needed > pool of {self.limit} pages")
        if self.on_full == "evict-then-refuse" and len(self.context_page_ids()) + needed > self.limit:
            raise CapacityError(f"{len(self.context_page_ids())} pages held by contexts + {needed} needed > pool "
                                f"of {self.limit} pages, even with every entry evicted")
        held = self.context_page_ids() if self.on_full in ("evict", "evict-then-refuse") else set()
        while self.on_full in ("evict", "evict-then-refuse") and not self.fits(needed):
            if evict_oldest(self.tree, self.release_entry, where=lambda entry: _keeps_a_page(entry, held)) is None:
                return       # nothing left that frees memory: the store falls back
            self.evictions += 1


def _keeps_a_page(entry, held_by_contexts: set[int]) -> bool:
    """Whether ``entry`` keeps a page no context holds: evicting it frees that page, or, where
    another entry keeps it too, brings it closer to free (evicting never changes what contexts hold)."""
    return any(page.page_id not in held_by_contexts for page in entry._pages)
