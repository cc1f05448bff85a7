"""Pages, their refcounts, and the one path that frees them.

A page is shared by every holder (context or tree entry) in its refcount;
``release`` is the single way a holder lets go, whoever the holder is, so the
arena, the counters and the live set can never disagree about a page.
The pool is used under the cache lock.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .store import PageStore


class Page:
    __slots__ = ("page_id", "refcount", "buffer", "token_bytes", "tokens", "filled")

    def __init__(self, page_id: int, buffer, token_bytes: bytearray, filled: int):
        self.page_id = page_id
        self.refcount = 1
        self.buffer = buffer
        # Token ids live in a bytearray, ``tokens`` is an int64 view of it (writes land in both):
        # a context's token list is one ``join`` of its pages' bytearrays, which at one-token
        # pages costs a quarter of joining (or concatenating) thousands of NumPy arrays.
        self.token_bytes = token_bytes
        self.tokens = np.frombuffer(token_bytes, np.int64)     # int64 token id per position slot
        self.filled = filled      # high-water mark: offsets >= filled were never written

    # ``tokens`` is a view of ``token_bytes``: pickled or deep-copied apart (a clone of the
    # whole cache, as the exhaustive checker makes) they would stop aliasing and a write would
    # miss the bytes that ``Context._tokens`` joins. So only the bytearray travels; the view is
    # rebuilt from it.
    def __getstate__(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__ if name != "tokens"}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self.tokens = np.frombuffer(self.token_bytes, np.int64)


class PagePool:
    def __init__(self, store: PageStore):
        self.store = store
        self.live: dict[int, Page] = {}
        self.allocated = 0
        self.freed = 0
        # The full-pool policy (impl/pool_policy.py), told once per operation how many pages it
        # will take, before it takes any; the cache sets it.
        self.make_room: Callable[[int], None] = lambda needed: None

    def _register(self, page_id: int, buffer, token_bytes: bytearray, filled: int) -> Page:
        page = Page(page_id, buffer, token_bytes, filled)
        self.live[page_id] = page
        self.allocated += 1
        return page

    def new_page(self) -> Page:
        page_id = self.allocated + 1
        return self._register(page_id, self.store.allocate(page_id), bytearray(8 * self.store.page_tokens), 0)

    def new_pages(self, count: int, room_made: bool = False) -> list[Page]:
        """``count`` new pages, or none: if one allocation fails (memory ran out), the ones
        already made are released before the error propagates, so no page is left unheld.

        The full-pool policy is consulted once per operation, before it changes anything:
        here, unless the caller already made room for everything it will take (``extend``)."""
        if not room_made:
            self.make_room(count)
        pages: list[Page] = []
        try:
            while len(pages) < count:
                pages.append(self.new_page())
        except BaseException:
            for page in pages:
                self.release(page)
            raise
        return pages

    def clone(self, page: Page) -> Page:
        """A private copy of ``page``. Only ``Context.writable`` calls this, inside an operation
        that has already made room for its copies (``extend``, ``overwrite``)."""
        page_id = self.allocated + 1
        return self._register(page_id, self.store.copy(page.buffer, page_id), bytearray(page.token_bytes), page.filled)

    def share(self, pages: list[Page]) -> None:
        for page in pages:
            page.refcount += 1

    def release(self, page: Page) -> None:
        """Drop one holder's reference; the last one frees the page and its memory."""
        page.refcount -= 1
        if page.refcount == 0:
            del self.live[page.page_id]
            self.store.free(page.buffer)
            self.freed += 1
