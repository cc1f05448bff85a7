"""Slot bookkeeping for a preallocated page arena, shared by every page store.

The arena only keeps books: which slots are free, which page each issued slot
backs, and the store's arena and heap counters (so every store counts alike).
The store owns the memory and zeroes a slot when it is issued.
"""

from __future__ import annotations

from .store import StoreCounters


class SlotArena:
    def __init__(self, size: int, counters: StoreCounters):
        self.size = size
        self.counters = counters
        self.free: list[int] = list(range(size - 1, -1, -1))   # pop() hands out slot 0 first
        self.out: dict[int, int] = {}                            # slot -> page id it backs

    def issue(self, page_id: int) -> int | None:
        """A free slot now backing ``page_id``, or None: the page goes to ordinary storage
        (counted as a heap page, and as a fallback when there is an arena and it is full)."""
        if not self.free:
            self.counters.heap_pages += 1
            self.counters.heap_fallbacks += self.size > 0
            return None
        # Subscripts, not ``list.pop()``: CPython raises a pending interrupt as a call returns, which
        # after ``pop`` lost the slot (neither free nor out); from here to the return, no call.
        free = self.free
        slot = free[-1]
        del free[-1]
        self.out[slot] = page_id
        self.counters.arena_issued += 1
        return slot

    def count_heap(self, pages: int) -> None:
        """``pages`` went to ordinary storage with no slot free: ``issue``'s counts for each, at once."""
        self.counters.heap_pages += pages
        self.counters.heap_fallbacks += pages if self.size > 0 else 0

    def give_back(self, slot: int | None) -> None:
        """Return a page's slot; None (a heap page) returns nothing."""
        if slot is None:
            return
        del self.out[slot]
        self.counters.arena_returned += 1
        self.free.append(slot)      # last: an interrupt as it returns finds the books whole

    def books(self) -> tuple[int, dict[int, int], tuple[int, ...]]:
        """(arena size, slot -> page id for issued slots, free slots)."""
        return self.size, dict(self.out), tuple(self.free)
