"""What one context holds, as one value that every change replaces whole.

A context's page list, the pages' refcount slots, its length, its packed key and its base
(see ``Holding``) are one object that nothing changes in place: every change builds a new one
from parts that agree. So a fork takes the object itself, with nothing to copy or test: the
child holds the very same ``Holding`` as its parent.

The one field that does change in place is ``forks``: the holders of these pages whose
refcounts are still pending (``refcounts.Refcounts``). A fork adds one; a holder letting go takes
one back while any is left; a flush adds them to the pages' counts and sets it to 0.
All of it under the cache lock.
"""

from __future__ import annotations


class Holding:
    __slots__ = ("pages", "slots", "length", "key", "base", "base_slots", "forks")

    def __init__(self, pages: tuple, slots, length: int, key: bytes | None, base: tuple, base_slots):
        # A tuple: a fork or hit holding all of another's pages shares that very tuple, so it
        # copies no list of k references.
        self.pages = pages
        # The refcount slots of ``pages``, in order (``pages.ref_slots``: a range or an int array),
        # for the pool's vectorised refcount steps.
        self.slots = slots
        self.length = length
        # The packed tokens (``radix.pack``) of positions [0, length) at least, or None when
        # unknown; kept by ``Context._write`` so ``retain`` need not re-read every page's token ids.
        self.key = key
        # A prefix of ``pages`` (the very objects, in order), kept through appends: the page list
        # this holding was forked or matched with. A hit at exactly its length takes it whole
        # instead of slicing ``pages``: requests hitting at one shared system prompt fork entries
        # that each extended that same tuple, so the hit copies no list of page references (a
        # slice increfs every page: the cost of a one-token-page hit). ``base_slots`` are its
        # slots, a range where the base was one extend's pages, so the count a hit leaves pending
        # is one slice add (``refcounts.Refcounts.flush``), not a scatter.
        self.base = base
        self.base_slots = base_slots
        self.forks = 0

    def replaced(self, pages: tuple, slots, keep_base: bool) -> "Holding":
        """This holding with another page list (``slots`` its slots). ``keep_base``: the caller
        knows the base is still a prefix of ``pages`` (an append); else the base becomes ``pages``."""
        if keep_base:
            return Holding(pages, slots, self.length, self.key, self.base, self.base_slots)
        return Holding(pages, slots, self.length, self.key, pages, slots)

    def with_length(self, length: int) -> "Holding":
        return Holding(self.pages, self.slots, length, self.key, self.base, self.base_slots)

    def with_key(self, key: bytes | None) -> "Holding":
        return Holding(self.pages, self.slots, self.length, key, self.base, self.base_slots)

    # A copy (pickled, deep-copied) counts nothing pending: the pool's ``Refcounts`` is copied
    # with every pending count already added to its array (``Refcounts.__getstate__``).
    def __getstate__(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__ if name != "forks"}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self.forks = 0


RELEASED = Holding((), range(0), 0, b"", (), range(0))     # what a closed context or released entry holds
