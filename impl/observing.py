"""The pages and holders ``Cache.observe`` reports, built cheaply: the invariant checks observe
the whole cache after every step of the lockstep machine and of the seeded runs, so this is one
of conformance's hot paths. Nothing is reported less than before:

- Refcounts are read as one Python list per refcount array rather than one NumPy scalar per page,
  and each page still reads through its own ``books`` (``Page.refcount``), so a page left reading
  a stale array after a growth is reported as it reads.
- Only a partly filled page can have a dirty tail: a full page has no offset past ``filled``, so
  only partly filled pages have their bytes scanned (``PageStore.is_zero_from``).
- A page whose refcount, slot and tail are as the last observation saw them gets the same frozen
  ``PageView`` back (equal in every field, so indistinguishable) instead of a new one.
Used under the cache lock.
"""

from __future__ import annotations

from operator import attrgetter

from kvstate.spec.observation import PageView

_PAGE_ID = attrgetter("page_id")


class PageViews:
    """``PageView``s of a pool's live pages, reusing the last call's where nothing changed."""

    def __init__(self):
        self._last: dict[int, PageView] = {}

    def __call__(self, live: dict, store, page_tokens: int) -> dict[int, PageView]:
        counts_of: dict = {}         # refcount array (by its box) -> its counts as a list
        last, views = self._last, {}
        for pid, page in live.items():
            books = page.books
            counts = counts_of.get(books)
            if counts is None:
                counts = counts_of[books] = books.counts.tolist()
            refcount, slot = counts[page.ref], page.buffer.slot
            dirty = page.filled < page_tokens and not store.is_zero_from(page.buffer, page.filled)
            view = last.get(pid)
            if view is None or view.refcount != refcount or view.slot != slot or view.dirty_tail != dirty:
                view = PageView(pid, refcount, slot, freed=False, dirty_tail=dirty)
            views[pid] = view
        self._last = views
        return views

    # A clone of the cache (pickled or deep-copied) starts without the last views: they are not state.
    def __getstate__(self) -> dict:
        return {"_last": {}}


def page_ids(pages) -> tuple[int, ...]:
    """The ids of a holder's pages, in order."""
    return tuple(map(_PAGE_ID, pages))
