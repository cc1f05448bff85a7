"""Pages, their refcount slots, and the one path that frees them.

A page is shared by every holder (context or tree entry) in its refcount;
``release`` (one page) and ``release_slots`` (a holder's whole list) are the ways a
holder lets go, whoever the holder is, and both free through ``_free``, so the
arena, the counters and the live set can never disagree about a page.
The pool is used under the cache lock.

Each live page owns one slot (``Page.ref``) of the pool's refcount array
(``refcounts.Refcounts``, which also keeps the counts a fork leaves pending) and of its
``PageTable``. Slots are recycled before the arrays grow, so they are as long as the most pages
ever live at once, not as the pages ever allocated (page ids only grow: they are identities).
A release marks all its pages' slots free in one step, and an extend takes the lowest free
ones, so the free slots stay packed and the pages of one ``extend`` get a few stretches of
consecutive slots (one, in the common case): such a holder's slots are a range
(``ref_slots``), and the vectorised steps over them are slices, not gathers.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter
from typing import Callable

import numpy as np

from .page_table import PageTable
from .refcounts import Refcounts
from .store import PageStore


class PageAccountingError(RuntimeError):
    """The engine's own books disagree: a page released or freed once more than it was held. Raised
    before anything changes; it means a bug in kvstate, never bad input."""


class Page:
    """A page: its id, its slot (``ref``: its refcount and its row of the ``PageTable``) and its
    memory in the store (``buffer``)."""

    __slots__ = ("page_id", "ref", "books", "table", "buffer")

    def __init__(self, books: Refcounts, table: PageTable, page_id: int, ref: int, buffer):
        self.page_id = page_id
        self.ref = ref
        self.books = books
        self.table = table
        self.buffer = buffer

    @property
    def tokens(self) -> np.ndarray:
        """The int64 token id per position slot: a view of the page's row of the table, made on
        demand and valid until the pool next grows (writes land in it, under the cache lock)."""
        return self.table.ids[self.ref]

    @property
    def filled(self) -> int:
        """The high-water mark: offsets from it on were never written."""
        return int(self.table.filled[self.ref])

    @filled.setter
    def filled(self, value: int) -> None:
        self.table.filled[self.ref] = value

    @property
    def refcount(self) -> int:
        return int(self.books.counts[self.ref])

    @refcount.setter
    def refcount(self, value: int) -> None:
        self.books.counts[self.ref] = value


_ref = attrgetter("ref")
_buffer = attrgetter("buffer")


def ref_slots(pages: list[Page]) -> "np.ndarray | range":
    """The refcount slots of ``pages``, in order: a ``range`` when they are consecutive (the pages
    of one ``extend``, allocated one after another), else an int array. Either indexes the pool's
    vectorised steps; a range lets them work on a view instead of gathering and scattering,
    which is most of a 32-page fork's refcount step."""
    slots = np.fromiter(map(_ref, pages), np.intp, len(pages))
    return as_run(slots)


def as_run(ids: np.ndarray) -> "np.ndarray | range":
    """``ids`` as a range if they are consecutive, else unchanged."""
    if len(ids) and ids[-1] - ids[0] == len(ids) - 1 and (len(ids) == 1 or (np.diff(ids) == 1).all()):
        return range(int(ids[0]), int(ids[-1]) + 1)
    return ids


def joined_slots(head: "np.ndarray | range", tail: "np.ndarray | range") -> "np.ndarray | range":
    """The slots of two page lists one after the other, still a range when both runs join up."""
    if type(tail) is range and (not len(head) or (type(head) is range and head.stop == tail.start)):
        return range(head.start if len(head) else tail.start, tail.stop)
    return np.concatenate([np.asarray(head, np.intp), np.asarray(tail, np.intp)])


class PagePool:
    def __init__(self, store: PageStore):
        self.store = store
        # The live page on refcount slot i at [i], None where the slot is free: pages go live and
        # are freed a stretch of slots at a time (a slice), not one dictionary entry each.
        self._by_slot: list[Page | None] = []
        self.books = Refcounts(256)      # grown by doubling
        # Grown with the refcount array (``_grow``), from at most 8 MiB of ids: a first 256 rows of
        # 10**8-token pages asked for 191 GiB in the constructor, before any page existed; and from
        # no row at all past 2**20 positions a page: one row of 10**12 ids is 8 TB, a MemoryError
        # when the cache was built (README: such a cache is built, its first extend may fail).
        self.table = PageTable(min(256, (8 << 20) // (8 * store.page_tokens)), store.page_tokens)
        # Which refcount slots below ``_next_ref`` are free: a release marks all its pages' in one
        # step, an extend takes the lowest (``_take_slots``, scanning from ``_lowest_free``).
        self._free_mask = np.zeros(256, np.bool_)
        self._free_slots = 0             # how many are marked
        self._lowest_free = 0            # no free slot below it
        self._next_ref = 0
        self._ones_kept = np.ones(256, np.int64)    # see ``_ones``
        self.allocated = 0
        self.freed = 0
        # The full-pool policy (impl/pool_policy.py), told once per operation how many pages it
        # will take, before it takes any; the cache sets it.
        self.make_room: Callable[[int], None] = lambda needed: None

    def _take_slots(self, count: int) -> "range | np.ndarray":
        """``count`` free refcount slots, their counts still 0: the lowest free ones, then new slots past
        ``_next_ref``. Lowest first keeps the free slots packed: what one eviction frees and the holes
        beside it are taken back together, so an extend's slots are a few stretches (a range, often),
        and the array is as long as the most pages ever live at once."""
        # The new slots first, the arrays grown for them: running out of memory there takes nothing.
        fresh = self._grow(count - self._free_slots) if count > self._free_slots else range(0)
        need = count - len(fresh)
        if not need:
            return fresh
        free, start, found = self._free_mask, self._lowest_free, []
        try:        # everything made first; the books change after, in plain assignments
            while need:     # scan from the lowest free slot, a window at a time, until enough are found
                if start >= self._next_ref:     # the count and the mask disagree: a pool bug, not a hang
                    raise RuntimeError(f"{self._free_slots} free slots counted, {need} short of that in the mask")
                width = max(4 * need, 4096)
                window = np.flatnonzero(free[start:start + width])[:need] + start
                found.append(window)
                need -= len(window)
                start += width
            taken = found[0] if len(found) == 1 else np.concatenate(found)
            slots = as_run(np.concatenate([taken, np.arange(fresh.start, fresh.stop)]) if fresh else taken)
        except BaseException:
            self._give_back(fresh)      # the new slots, never handed out
            raise
        free[taken] = False
        self._free_slots -= len(taken)
        self._lowest_free = int(taken[-1]) + 1
        return slots

    def _grow(self, count: int) -> range:
        """``count`` slots never used yet. The refcount array, the page table and the free mask double
        until they hold them, each made before anything is replaced: running out of memory changes nothing."""
        books, table, first = self.books, self.table, self._next_ref
        end = first + count
        counts, mask = _at_least(books._counts, end), _at_least(self._free_mask, end)
        if end > len(table.ids):
            table.grow(_doubled(len(table.ids), end))
        self._free_mask = mask
        self._by_slot += [None] * count
        books._counts = counts      # pending shares name slots, which the grown array keeps
        self._next_ref = end
        return range(first, end)

    def _give_back(self, slots: "range | np.ndarray") -> None:
        """Slots whose pages were freed (or never made), their counts 0, back for the next ``_take_slots``."""
        if not len(slots):
            return
        _set(self._free_mask, slots, True)
        self._free_slots += len(slots)
        self._lowest_free = min(self._lowest_free, slots.start if type(slots) is range else int(slots.min()))

    def _register(self, page_id: int, buffer) -> Page:
        slots = self._take_slots(1)
        try:        # everything made first (calls, where an interrupt lands); the books change after
            ref = int(slots[0])
            page = Page(self.books, self.table, page_id, ref, buffer)
        except BaseException:
            self._give_back(slots)
            raise
        self.books._counts[ref] = 1         # a free slot: no pending share names it, so no flush
        self._by_slot[ref] = page
        self.allocated += 1
        return page

    def new_pages(self, count: int, room_made: bool = False) -> list[Page]:
        """``count`` new pages (``new_run``'s pages)."""
        return self.new_run(count, room_made)[0]

    def new_run(self, count: int, room_made: bool = False) -> "tuple[list[Page], range | np.ndarray]":
        """``count`` new pages and their refcount slots (a range or an int array, as ``ref_slots``
        gives them: a holder extended by them takes the slots as they are), or none: if making one fails (memory ran out, an interrupt), what was
        made is given back before the error propagates: no page is left unheld, no slot taken. The
        pages go live (``live``) only once all are made, in one step.

        The full-pool policy is consulted once per operation, before it changes anything:
        here, unless the caller already made room for everything it will take (``extend``).
        The store makes the memory of all of them in one call (``PageStore.allocate_all``, where it
        has one) and the pages are registered in one loop: at one-token pages an ``extend`` makes
        hundreds, and a call or two a page was a tenth of it."""
        if not room_made:
            self.make_room(count)
        first, buffers, slots, stretches = self.allocated + 1, [], range(0), []
        try:
            allocate_all = getattr(self.store, "allocate_all", None)
            buffers = self._allocate_each(first, count) if allocate_all is None else allocate_all(first, count)
            slots = self._take_slots(len(buffers))
            books, table = self.books, self.table
            _set(books._counts, slots, 1)       # free slots: no pending share names them, so no flush
            table.clear(slots)                  # the last pages' ids and marks
            refs = slots if type(slots) is range else slots.tolist()
            pages = list(map(Page, repeat(books), repeat(table), range(first, first + len(buffers)), refs, buffers))
            stretches = _stretches(slots)
            _place(self._by_slot, stretches, pages)
            # The last step, with no call after it: an interrupt before it (at a call) has put none
            # of them live, and one after it finds them counted, live and returned.
            self.allocated = first + len(pages) - 1
        except BaseException:       # memory ran out (the store frees what it made), or an interrupt
            if stretches:       # placed, or maybe in part: none of them is live
                _place(self._by_slot, stretches, [None] * len(buffers))
            _set(self.books._counts, slots, 0)      # taken but no page live on them: back, as ``_free`` gives them
            self._give_back(slots)
            self._free_buffers(buffers)
            raise
        return pages, slots

    def _allocate_each(self, first: int, count: int) -> list:
        """``allocate_all`` for a store written to the protocol before it: ``allocate`` a page."""
        buffers = []
        try:
            for page_id in range(first, first + count):
                buffers.append(self.store.allocate(page_id))
        except BaseException:
            self._free_buffers(buffers)
            raise
        return buffers

    def _free_buffers(self, buffers: list) -> None:
        """The store's ``free_all`` of ``buffers``, or its ``free`` of each (a store written before it)."""
        free_all = getattr(self.store, "free_all", None)
        if free_all is not None:
            free_all(buffers)
        else:
            for buffer in buffers:
                self.store.free(buffer)

    def clone(self, page: Page) -> Page:
        """A private copy of ``page``. Only ``Context.writable`` calls this, inside an operation
        that has already made room for its copies (``extend``, ``overwrite``)."""
        page_id = self.allocated + 1
        buffer = self.store.copy(page.buffer, page_id)
        try:        # ``_register`` failing (memory ran out growing the books, an interrupt): the copy freed
            private = self._register(page_id, buffer)
        except BaseException:
            self._free_buffers([buffer])
            raise
        try:
            self.table.copy_row(page.ref, private.ref)
        except BaseException:       # the copy is live with no holder: released (freed) here or never
            self.release(private)
            raise
        return private

    def _check_live(self, pages, stretches: list[tuple[int, int, int]]) -> None:
        """Raise unless each of ``pages`` is the live page on its slot (``stretches``: their slots, as
        ``_stretches`` gives them): a second free of a page would give its slot back twice, and two
        pages would share it."""
        by_slot, pages = self._by_slot, list(pages)
        if all(by_slot[first:stop] == pages[at:at + stop - first] for first, stop, at in stretches):
            return
        held = [page for first, stop, _at in stretches for page in by_slot[first:stop]]
        stale = [page.page_id for page, live in zip(pages, held) if page is not live]
        raise PageAccountingError(f"pages {stale[:8]} freed but not live (freed before): their buffers, slots "
                                  f"and the live list are left as they were")

    @property
    def live(self) -> dict[int, Page]:
        """The live pages by id, in the order they were made: a new dict, for observation and
        tests (the pool itself keeps them by slot)."""
        return dict(sorted((page.page_id, page) for page in self._by_slot if page is not None))

    @property
    def live_count(self) -> int:
        """How many pages are live: every page id handed out and not freed."""
        return self.allocated - self.freed

    @property
    def refcounts(self) -> np.ndarray:
        """The refcount of the page holding slot i (``Page.ref``) at [i]."""
        return self.books.counts

    def _ones(self, n: int) -> np.ndarray:
        """n int64 ones, a view of one kept array: adding an array to a run of refcounts costs a
        quarter less than adding the scalar 1, which NumPy converts on every call."""
        if n > len(self._ones_kept):
            self._ones_kept = np.ones(max(n, 2 * len(self._ones_kept)), np.int64)
        return self._ones_kept[:n]

    def release(self, page: Page) -> None:
        """Drop one holder's reference; the last one frees the page and its memory."""
        self.release_slots((page,), range(page.ref, page.ref + 1))

    def release_slots(self, pages, ids, holder=None, after=None) -> None:
        """``release`` for each of one holder's ``pages`` (``ids`` their refcount slots), the decrements
        in one step. ``holder``, where given (the context or entry letting go), gets ``after`` as its
        holding in that very step.

        Everything is worked out first (the new counts, which pages reach 0, that each is still the
        live page on its slot: ``_free``, the one path every release frees through); then the counts,
        the holder and the freed pages' books change in one call with no call inside (``_commit``:
        CPython delivers an interrupt at a call); the freed pages' memory goes back to the store last. So an interrupt (Ctrl-C, a run's deadline) leaves
        the holder holding its pages with their counts, or neither, and no page live at count 0; one
        landing as the memory goes back loses at most that memory's reuse (an arena slot). Before,
        the holder let go in a ``finally``: interrupted before the counts went down, its pages stayed
        counted for nobody; after, but before they were freed, live at count 0."""
        if self.books.withdraw(ids, holder, after):     # a pending count taken back, with the holder
            return
        counts = self.books.counts
        if type(ids) is range:
            left = counts[ids.start:ids.stop] - self._ones(len(ids))
        else:
            left = counts[ids] - 1
        # At or below 0: a page released once more than it was held is refused by ``_check_live``
        # (its slot is free or another page's), before anything changes.
        freed = np.flatnonzero(left <= 0)
        if not len(freed):
            self._commit(ids, left, holder, after, None)
            return
        first, last = int(freed[0]), int(freed[-1]) + 1
        if last - first == len(freed):      # one stretch of the list (an evicted entry's own pages): slices
            self._free(pages[first:last], ids[first:last], ids, left, holder, after)
        else:
            self._free([pages[index] for index in freed.tolist()],
                       ids[freed] if type(ids) is not range else freed + ids.start, ids, left, holder, after)

    def _free(self, pages, slots: "range | np.ndarray", *release) -> None:
        """Pages nobody holds (``slots`` their refcount slots, all at 0): out of the live set, their
        slots marked free, their memory back to the store (one call for all: an eviction at one-token
        pages frees hundreds, and a call a page cost a fifth of it). ``release``: the
        ``(ids, left, holder, after)`` of the ``release_slots`` that frees them, committed in the same step."""
        doomed = self._doomed(pages, slots)
        self._commit(*(release or (None, None, None, None)), doomed)
        self._free_buffers(doomed[4])       # the memory last: see ``release_slots``

    def _doomed(self, pages, slots: "range | np.ndarray") -> tuple:
        """What freeing ``pages`` (``slots`` theirs) changes, worked out before anything does: their
        slots as one index (a slice, or an int array), their stretches of slots and as many Nones (for
        the live list), the lowest slot, their buffers, how many. Refused unless each is the live page
        on its slot: a second free would give its slot back twice, and two pages would share it."""
        stretches = _stretches(slots)
        self._check_live(pages, stretches)
        if type(slots) is range:
            index, lowest = slice(slots.start, slots.stop), slots.start
        else:
            index, lowest = slots, int(slots.min())
        return index, stretches, [None] * len(pages), lowest, list(map(_buffer, pages)), len(pages)

    def _commit(self, ids, left, holder, after, doomed) -> None:
        """The one step of a release, with no call inside (see ``release_slots``): the counts of ``ids``
        set to ``left``, ``holder``'s holding to ``after``, the ``doomed`` pages out of the live set
        and their slots free. CPython also delivers an interrupt where a loop jumps back: the one loop
        here (the live list, a stretch of slots at a time, where the freed slots are not one run) is
        done again in a ``finally`` where it did not finish, so an interrupt between stretches still
        sees every one of them out."""
        counts, run = self.books._counts, type(ids) is range       # flushed by the caller
        if doomed is not None:
            index, stretches, nones, lowest, _buffers, count = doomed
            single = slice(*stretches[0][:2]) if len(stretches) == 1 else None
        # From here not even a builtin is called.
        if run:
            counts[ids.start:ids.stop] = left
        elif ids is not None:
            counts[ids] = left
        if holder is not None:
            holder._holding = after
        if doomed is None:
            return
        self._free_mask[index] = True
        if lowest < self._lowest_free:
            self._lowest_free = lowest
        self._free_slots += count
        self.freed += count
        by_slot = self._by_slot
        if single is not None:
            by_slot[single] = nones
            return
        done = False
        try:
            for first, stop, at in stretches:
                by_slot[first:stop] = nones[at:at + stop - first]
            done = True
        finally:
            if not done:        # an interrupt between stretches: the same stores again (each is idempotent)
                for first, stop, at in stretches:
                    by_slot[first:stop] = nones[at:at + stop - first]


def _doubled(size: int, at_least: int) -> int:
    size = max(size, 1)     # an empty array (the page table of huge pages) doubles from one
    while size < at_least:
        size *= 2
    return size


def _at_least(array: np.ndarray, length: int) -> np.ndarray:
    """``array`` if it holds ``length`` items, else a copy doubled until it does, zeros past the old end."""
    if length <= len(array):
        return array
    grown = np.zeros(_doubled(len(array), length), array.dtype)
    grown[:len(array)] = array
    return grown


def _place(by_slot: list, stretches: list[tuple[int, int, int]], items: list) -> None:
    """``items[i]`` at ``by_slot[slot i]``, the slots as ``_stretches`` gives them: a slice assignment each."""
    if len(stretches) == 1:
        first, stop, _at = stretches[0]
        by_slot[first:stop] = items
        return
    for first, stop, at in stretches:
        by_slot[first:stop] = items[at:at + stop - first]


def _stretches(slots: "range | np.ndarray") -> list[tuple[int, int, int]]:
    """``slots`` as its stretches of consecutive slots, ``(first slot, stop, index in slots)`` each: a
    few, where an extend took its slots from a few freed runs, so a loop over them is short."""
    if type(slots) is range:
        return [(slots.start, slots.stop, 0)]
    if not len(slots):
        return []
    breaks = (np.flatnonzero(slots[1:] - slots[:-1] != 1) + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, len(slots)]
    return [(first, first + end - start, start) for first, start, end in zip(slots[starts].tolist(), starts, ends)]


def _set(counts: np.ndarray, slots: "range | np.ndarray", value) -> None:
    """Every slot of ``slots`` in ``counts`` (or any array indexed by refcount slot) set to ``value``."""
    if type(slots) is range:
        counts[slots.start:slots.stop] = value
    else:
        counts[slots] = value
