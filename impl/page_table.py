"""What the pool keeps of each page in arrays indexed by its refcount slot: its token ids and its
``filled`` mark.

Why arrays and not attributes of each ``Page``: at one-token pages an ``extend`` makes hundreds of
pages and an eviction frees hundreds. Kept a page at a time, an extend wrote and raised each page's
own, and each page's own small array was made and freed with it; here an extend writes its
ids and raises its marks in one step each, a context's ids are one gather, and a freed page
leaves nothing here to free (a slot's next page overwrites its row).

The pool replaces the arrays with longer copies when it grows (``PagePool._grow``), so everything
that writes them does so under the cache lock: a write outside it could land in the old copy
while the pool grows, and be lost. A context reads its own pages' rows without the lock: the
arrays in the table always hold every write made before they were put there.
"""

from __future__ import annotations

import numpy as np

# Up to this many pages, a mark is raised page by page: a decode's one page costs less in scalar
# steps than in NumPy's vector ones.
SCALAR_PAGES = 4


class PageTable:
    """Row i: the page on refcount slot i. ``ids[i]``: its token id per offset; ``filled[i]``: its
    high-water mark (offsets from it on were never written). A box the pages share (``Page.table``)."""

    __slots__ = ("ids", "filled")

    def __init__(self, size: int, page_tokens: int):
        self.ids = np.zeros((size, page_tokens), np.int64)
        self.filled = np.zeros(size, np.int64)

    @property
    def page_tokens(self) -> int:
        return self.ids.shape[1]

    def grow(self, size: int) -> None:
        """Longer arrays, the rows so far copied in: both made before either is replaced, so running out
        of memory changes nothing."""
        ids, filled = np.zeros((size, self.page_tokens), np.int64), np.zeros(size, np.int64)
        ids[:len(self.ids)], filled[:len(self.filled)] = self.ids, self.filled
        self.ids, self.filled = ids, filled

    def clear(self, slots: "range | np.ndarray") -> None:
        """New pages' rows: no ids, nothing filled."""
        if type(slots) is range:
            self.ids[slots.start:slots.stop] = 0
            self.filled[slots.start:slots.stop] = 0
        else:
            self.ids[slots] = 0
            self.filled[slots] = 0

    def copy_row(self, source: int, target: int) -> None:
        self.ids[target] = self.ids[source]
        self.filled[target] = self.filled[source]

    def gather(self, slots: "range | np.ndarray") -> np.ndarray:
        """The ids of the pages on ``slots``, in order, as one fresh flat array."""
        if type(slots) is range:
            return self.ids[slots.start:slots.stop].reshape(-1).copy()     # a view of the rows: copied
        return self.ids[slots].reshape(-1)      # a gather: a copy already

    def write(self, slots: "range | np.ndarray", start: int, ids: np.ndarray) -> None:
        """``ids`` at positions ``start..`` of a holder's pages on ``slots`` (position p in page p // page_tokens)."""
        page_tokens = self.page_tokens
        stop = start + len(ids)
        first, end = start // page_tokens, -(-stop // page_tokens)
        rows = slots[first:end]
        if type(rows) is range:         # consecutive rows: one slice of their flat view
            skip = first * page_tokens
            self.ids[rows.start:rows.stop].reshape(-1)[start - skip:stop - skip] = ids
        else:
            positions = np.arange(start, stop)
            self.ids[np.asarray(slots)[positions // page_tokens], positions % page_tokens] = ids

    def raise_filled(self, slots: "range | np.ndarray", start: int, stop: int) -> None:
        """Raise the mark of each of a holder's pages (on ``slots``) that positions ``[start, stop)``
        land in to the end of what they write in it; a mark already past it stays."""
        page_tokens, filled = self.page_tokens, self.filled
        first, end = start // page_tokens, -(-stop // page_tokens)
        rows = slots[first:end]
        if end - first <= SCALAR_PAGES:
            for index, slot in enumerate(rows, first):
                mark = min(page_tokens, stop - index * page_tokens)
                if filled[slot] < mark:
                    filled[slot] = mark
            return
        # Every page but the last is written to its end; the last to ``stop``.
        marks = np.full(end - first, page_tokens, np.int64)
        marks[-1] = stop - (end - 1) * page_tokens
        if type(rows) is range:
            held = filled[rows.start:rows.stop]
            np.maximum(held, marks, out=held)
        else:
            filled[rows] = np.maximum(filled[rows], marks)
