"""Pages, their refcounts, and the one path that frees them.

A page is shared by every holder (context or tree entry) in its refcount;
``release`` (one page) and ``release_slots`` (a holder's whole list) are the ways a
holder lets go, whoever the holder is, and both free through ``_free``, so the
arena, the counters and the live set can never disagree about a page.
The pool is used under the cache lock.

Refcounts live in one int64 array (``PagePool.refcounts``), each live page owning one
slot of it (``Page.ref``); ``Page.refcount`` reads and writes that slot. Why: a fork or a
match of k pages then bumps k refcounts in one vectorised step over the holder's array of
slots instead of k Python attribute updates (at one-token pages k is in the thousands);
and that step is itself deferred, one count per holding or run of slots, until a count is
looked at (``Refcounts``): a fork closed before anything reads a count costs no step at all.
Slots are recycled, smallest first, so the array is as long as the most pages ever live at
once, not as the pages ever allocated (page ids only grow: they are identities), and the
pages of one ``extend`` still get consecutive slots in the common case.
"""

from __future__ import annotations

import heapq
from operator import attrgetter
from typing import Callable

import numpy as np

from .store import PageStore


class Refcounts:
    """The pool's refcount array, in a box the pages share: it is replaced when it grows, and a
    page reaching it through the box rather than through the pool makes no reference cycle
    (the pool's live set holds the pages), so a dropped cache is freed at once.

    Shares are deferred: a fork records "one more holder of these pages" as one count instead
    of one increment per page, and a holder of the same pages letting go takes such a count
    back, so a fork closed again touches no page's count. Two places keep such counts:

    - a fork at full length (``Context.fork``), whose child holds the very same ``Holding`` as
      its parent, counts on that holding (``Holding.forks``; ``share_holding``);
    - a fork at a shorter length (a match hit) counts on its run of slots (``pending``:
      ``id(ids) -> [ids, holders]``; ``share``, ``withdraw``): hits at one shared prefix get
      different holdings but the same run.

    Whoever reads or writes ``counts`` gets them exact: the pending counts are added first
    (``flush``), one vectorised step per run or holding. So a page's refcount is exact whenever
    anything looks at it (``Page.refcount``, ``observe``, ``writable``, a release that may free
    a page).
    """

    __slots__ = ("_counts", "pending", "forked")

    FLUSH_AT = 64       # runs (or holdings) pending before a share adds them anyway: bounds a late flush

    def __init__(self, size: int):
        self._counts = np.zeros(size, np.int64)    # refcount of the page holding slot i; 0 for free slots
        self.pending: dict[int, list] = {}
        self.forked: dict = {}      # id(holding) -> holding (impl/holding.py), for each with forks counted on it

    @property
    def counts(self) -> np.ndarray:
        if self.pending or self.forked:
            self.flush()
        return self._counts

    @counts.setter
    def counts(self, value: np.ndarray) -> None:
        if self.pending or self.forked:
            self.flush()
        self._counts = value

    def flush(self) -> None:
        counts, pending, forked = self._counts, self.pending, self.forked
        self.pending, self.forked = {}, {}
        for ids, holders in pending.values():
            _add(counts, ids, holders)
        for holding in forked.values():
            _add(counts, holding.slots, holding.forks)
            holding.forks = 0

    def share(self, ids) -> None:
        """One more holder of every slot of ``ids`` (one holder's list: distinct slots), as one pending count."""
        pending = self.pending
        entry = pending.get(id(ids))
        if entry is not None and entry[0] is ids:
            entry[1] += 1
            return
        if len(pending) >= self.FLUSH_AT:
            self.flush()
        self.pending[id(ids)] = [ids, 1]

    def share_holding(self, holding) -> None:
        """One more holder of ``holding``'s pages, counted on it (``Context.fork`` adds to a count
        already there itself: this is the first count since the last flush)."""
        if holding.forks:
            holding.forks += 1
            return
        if len(self.forked) >= self.FLUSH_AT:
            self.flush()
        holding.forks = 1
        self.forked[id(holding)] = holding

    def withdraw_holding(self, holding) -> bool:
        """Take back one holder of ``holding`` counted on it, if there is one; True if taken.
        Safe for any holder of it, as ``withdraw`` is for any holder of a run."""
        forks = holding.forks
        if not forks:
            return False
        holding.forks = forks - 1
        if forks == 1:
            del self.forked[id(holding)]
        return True

    def withdraw(self, ids) -> bool:
        """Take back one pending holder of the run ``ids``, if there is one; True if taken.

        Safe without looking at any page: every holder of ``ids`` holds the same pages, so
        which of them lets go does not matter; and while a count is pending for ``ids`` the
        holder it was forked from holds them too, so no page can reach 0 here."""
        entry = self.pending.get(id(ids))
        if entry is None or entry[0] is not ids:
            return False
        if entry[1] == 1:
            del self.pending[id(ids)]
        else:
            entry[1] -= 1
        return True

    def __getstate__(self):
        return {"_counts": self.counts}     # flushed: id() keys mean nothing in a copy, and holdings copy no count

    def __setstate__(self, state) -> None:
        self._counts, self.pending, self.forked = state["_counts"], {}, {}


def _add(counts: np.ndarray, ids, holders: int) -> None:
    """``holders`` more on each refcount slot of ``ids`` (distinct slots: a range or an int array)."""
    if type(ids) is range:
        counts[ids.start:ids.stop] += holders
    elif len(ids) > 96:      # ufunc.at: faster than fancy indexing on long arrays, slower on short
        np.add.at(counts, ids, holders)
    else:
        counts[ids] += holders


class Page:
    __slots__ = ("page_id", "ref", "books", "buffer", "token_bytes", "filled")

    def __init__(self, books: Refcounts, page_id: int, ref: int, buffer, token_bytes: bytearray, filled: int):
        self.page_id = page_id
        self.ref = ref            # this page's slot in the refcount array
        self.books = books
        self.buffer = buffer
        # Token ids live in a bytearray (``tokens`` is an int64 view of it, made when asked for):
        # a context's token list is one ``join`` of its pages' bytearrays, which at one-token
        # pages costs a quarter of joining (or concatenating) thousands of NumPy arrays.
        self.token_bytes = token_bytes
        self.filled = filled      # high-water mark: offsets >= filled were never written

    @property
    def tokens(self) -> np.ndarray:
        """The int64 token id per position slot: a view of ``token_bytes`` (writes land in it).
        Made on demand, not kept: a kept view was ~400 of the ~1,000 bytes each page allocates,
        and at one-token pages an ``extend`` of a turn's tokens left that much more memory
        freshly touched, the caches colder for the lookup and the retain after it."""
        return np.frombuffer(self.token_bytes, np.int64)

    @property
    def refcount(self) -> int:
        return int(self.books.counts[self.ref])

    @refcount.setter
    def refcount(self, value: int) -> None:
        self.books.counts[self.ref] = value


_ref = attrgetter("ref")
_page_id = attrgetter("page_id")


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
        self.live: dict[int, Page] = {}
        self.books = Refcounts(256)      # grown by doubling
        self._free_refs: list[int] = []  # a heap of free refcount slots below ``_next_ref``
        self._next_ref = 0
        self._ones_kept = np.ones(256, np.int64)    # see ``_ones``
        self.allocated = 0
        self.freed = 0
        # The full-pool policy (impl/pool_policy.py), told once per operation how many pages it
        # will take, before it takes any; the cache sets it.
        self.make_room: Callable[[int], None] = lambda needed: None

    def _next_slot(self) -> int:
        """A free refcount slot, the smallest; the array doubles when none is left below its end."""
        if self._free_refs:
            return heapq.heappop(self._free_refs)
        books = self.books
        ref, self._next_ref = self._next_ref, self._next_ref + 1
        if ref >= len(books._counts):
            grown = np.zeros(2 * len(books._counts), np.int64)
            grown[:len(books._counts)] = books._counts
            books._counts = grown       # pending shares name slots, which the grown array keeps
        return ref

    def _register(self, page_id: int, buffer, token_bytes: bytearray, filled: int) -> Page:
        ref = self._next_slot()
        self.books._counts[ref] = 1         # a free slot: no pending share names it, so no flush
        page = Page(self.books, page_id, ref, buffer, token_bytes, filled)
        self.live[page_id] = page
        self.allocated += 1
        return page

    def new_pages(self, count: int, room_made: bool = False) -> list[Page]:
        """``count`` new pages, or none: if making one fails (memory ran out, an interrupt), what was
        made is given back before the error propagates: no page is left unheld, no slot taken. The
        pages go live (``live``) only once all are made, in one step.

        The full-pool policy is consulted once per operation, before it changes anything:
        here, unless the caller already made room for everything it will take (``extend``).
        The store makes the memory of all of them in one call (``PageStore.allocate_all``, where it
        has one) and the pages are registered in one loop: at one-token pages an ``extend`` makes
        hundreds, and a call or two a page was a tenth of it."""
        if not room_made:
            self.make_room(count)
        first, buffers, pages = self.allocated + 1, [], []
        try:
            allocate_all = getattr(self.store, "allocate_all", None)
            buffers = self._allocate_each(first, count) if allocate_all is None else allocate_all(first, count)
            token_bytes = 8 * self.store.page_tokens
            books, next_slot = self.books, self._next_slot
            for page_id, buffer in enumerate(buffers, first):
                tokens = bytearray(token_bytes)     # first: running out of memory here takes no slot
                ref = next_slot()
                books._counts[ref] = 1      # a free slot: no pending share names it, so no flush
                pages.append(Page(books, page_id, ref, buffer, tokens, 0))
        except BaseException:       # memory ran out (the store frees what it made), or an interrupt
            for page in pages:      # made but not live yet: their slots back, as ``_free`` gives them
                self.books._counts[page.ref] = 0
                heapq.heappush(self._free_refs, page.ref)
            self._free_buffers(buffers)
            raise
        self.allocated = first + len(pages) - 1     # before the pages go live: no id is ever handed out twice
        self.live.update(zip(map(_page_id, pages), pages))     # keyed by the pages' own ids: no int a page more
        return pages

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
        return self._register(page_id, self.store.copy(page.buffer, page_id), bytearray(page.token_bytes), page.filled)

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
        counts = self.books.counts
        left = counts[page.ref] - 1
        counts[page.ref] = left
        if left == 0:
            self._free((page,))

    def release_slots(self, pages: list[Page], ids: np.ndarray) -> None:
        """``release`` for each of one holder's ``pages`` (``ids`` their refcount slots), the decrements in one step."""
        if self.books.withdraw(ids):
            return
        counts = self.books.counts
        if type(ids) is range:
            left = counts[ids.start:ids.stop]
            np.subtract(left, self._ones(len(left)), out=left)
        else:
            left = counts[ids] - 1
            counts[ids] = left
        freed = np.flatnonzero(left == 0).tolist()
        if freed:
            self._free([pages[index] for index in freed])

    def _free(self, pages) -> None:
        """Pages nobody holds: out of the live set, their memory back to the store. One call for
        all of a release's pages, and one to the store (``PageStore.free_all``, where it has one):
        an eviction at one-token pages frees hundreds of pages, and a call a page cost a fifth of it.
        The books are kept in ``finally``: a store that fails part way (an interrupt) has freed
        what it could (``NumpyStore.free_all`` frees the rest before re-raising), and no page it
        was handed stays in the live set as if still held."""
        try:
            self._free_buffers([page.buffer for page in pages])
        finally:
            live, free_refs, heappush = self.live, self._free_refs, heapq.heappush
            for page in pages:
                del live[page.page_id]
                heappush(free_refs, page.ref)
            self.freed += len(pages)
