"""Slot bookkeeping for a preallocated page arena, shared by every page store.

The arena only keeps books: which slots are free and which page each issued
slot backs. The store owns the memory and zeroes a slot when it is issued.
"""

from __future__ import annotations


class SlotArena:
    def __init__(self, size: int):
        self.size = size
        self.free: list[int] = list(range(size - 1, -1, -1))   # pop() hands out slot 0 first
        self.out: dict[int, int] = {}                            # slot -> page id it backs

    def issue(self, page_id: int) -> int | None:
        """A free slot now backing ``page_id``, or None when the arena is full."""
        if not self.free:
            return None
        slot = self.free.pop()
        self.out[slot] = page_id
        return slot

    def give_back(self, slot: int) -> None:
        del self.out[slot]
        self.free.append(slot)
