"""A context: an ordered list of page references and a length.

``fork`` copies the list and bumps refcounts; nothing else. ``writable`` is the
only place in kvstate where a page is copied, and it copies only a page that
another holder shares. Every write path goes through it.

Locking: page lists, lengths and refcounts change under the cache lock. Value
bytes are written outside it, into pages that ``writable`` or allocation just
made private to this context: no other holder can reach such a page until this
context's owner forks or retains it, and a context has one owner at a time
(enforced by ``_owned``).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from kvstate.spec.arithmetic import pages_touched, span_in_page, truncate_keep
from kvstate.spec.errors import ContextBusyError, ContextClosedError, PositionError
from kvstate.spec.layout import check_tokens, check_values

from .pages import Page

if TYPE_CHECKING:
    from .cache import Cache


class Context:
    def __init__(self, cache: "Cache", context_id: int, pages: list[Page], length: int):
        self._cache = cache
        self.context_id = context_id
        self._pages = pages
        self._length = length
        self._closed = False
        self._busy = threading.Lock()

    # -- ownership ---------------------------------------------------------------

    @contextmanager
    def _owned(self):
        """Hold this context for one operation; refuse a second concurrent user by name."""
        if not self._busy.acquire(blocking=False):
            raise ContextBusyError(f"context {self.context_id} is in use by another thread")
        try:
            if self._closed:
                raise ContextClosedError(f"context {self.context_id} is closed")
            yield
        finally:
            self._busy.release()

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        if not self._closed:
            self.close()

    # -- reading -------------------------------------------------------------------

    def __len__(self) -> int:
        return self._length

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def page_tokens(self) -> int:
        return self._cache.page_tokens

    @property
    def tokens(self) -> list[int]:
        with self._owned():
            return self._tokens().tolist()

    def _tokens(self) -> np.ndarray:
        if not self._pages:
            return np.zeros(0, np.int64)
        return np.concatenate([page.tokens for page in self._pages])[:self._length]

    def read(self, start: int = 0, stop: int | None = None):
        """Values ``(n, layers, 2, kv_heads, head_dim)`` float32 and tokens of ``[start, stop)``."""
        with self._owned():
            stop = self._length if stop is None else stop
            _check_range("read", start, stop, self._length)
            store = self._cache.store
            if start == stop:
                return store.read_empty(), np.zeros(0, np.int64)
            first, end = pages_touched(start, stop, self.page_tokens)
            values, tokens = [], []
            for index in range(first, end):
                lo, hi = span_in_page(index, start, stop, self.page_tokens)
                page = self._pages[index]
                values.append(store.read(page.buffer, lo, hi))
                tokens.append(page.tokens[lo:hi])
            return store.concat(values), np.concatenate(tokens)

    # -- writing -------------------------------------------------------------------

    def writable(self, index: int) -> Page:
        """Page ``index``, made private to this context first if another holder shares it.

        The only place a page is copied. Called under the cache lock.
        """
        page = self._pages[index]
        if page.refcount == 1:
            return page
        private = self._cache.pool.clone(page)
        self._cache.pool.release(page)
        self._pages[index] = private
        return private

    def extend(self, tokens, kv) -> None:
        """Append positions. Validated in full before anything is allocated or written."""
        tokens = check_tokens(tokens)
        kv = check_values(self._cache.layout, kv, len(tokens))
        with self._owned():
            if len(tokens) == 0:
                return
            encoded = self._cache.store.encode(kv)
            start, stop = self._length, self._length + len(tokens)
            with self._cache.lock:
                first, end = pages_touched(start, stop, self.page_tokens)
                if first < len(self._pages):
                    self.writable(first)           # the partly filled last page
                while len(self._pages) < end:
                    self._pages.append(self._cache.pool.new_page())
            self._write(start, stop, tokens, encoded)
            with self._cache.lock:
                self._length = stop

    def overwrite(self, start: int, tokens, kv) -> None:
        """Rewrite positions ``[start, start + n)``, all inside the current length."""
        tokens = check_tokens(tokens)
        kv = check_values(self._cache.layout, kv, len(tokens))
        with self._owned():
            stop = start + len(tokens)
            if not (isinstance(start, (int, np.integer)) and 0 <= start <= stop <= self._length):
                raise PositionError(
                    f"overwrite of [{start}, {stop}) is outside context {self.context_id} of length {self._length}")
            if start == stop:
                return
            encoded = self._cache.store.encode(kv)
            with self._cache.lock:
                for index in range(*pages_touched(start, stop, self.page_tokens)):
                    self.writable(index)
            self._write(start, stop, tokens, encoded)

    def _write(self, start: int, stop: int, tokens: np.ndarray, encoded) -> None:
        """Store positions ``[start, stop)`` into pages that are already private."""
        store = self._cache.store
        for index in range(*pages_touched(start, stop, self.page_tokens)):
            lo, hi = span_in_page(index, start, stop, self.page_tokens)
            row = index * self.page_tokens + lo - start
            page = self._pages[index]
            store.write(page.buffer, lo, encoded, row, row + hi - lo)
            page.tokens[lo:hi] = tokens[row:row + hi - lo]
            page.filled = max(page.filled, hi)

    # -- structure -------------------------------------------------------------------

    def fork(self) -> "Context":
        """A new context sharing every page: a page-list copy plus refcount increments."""
        with self._owned():
            return self._cache._fork(self)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions; pages past them are released."""
        with self._owned():
            if not (isinstance(n, (int, np.integer)) and 0 <= n <= self._length):
                raise PositionError(f"truncate to {n} is outside context {self.context_id} of length {self._length}")
            with self._cache.lock:
                keep, _released = truncate_keep(self._length, n, self.page_tokens)
                for page in self._pages[keep:]:
                    self._cache.pool.release(page)
                del self._pages[keep:]
                self._length = n

    def close(self) -> None:
        """Release every page. Any later use raises ``ContextClosedError``."""
        with self._owned():
            self._cache._close(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._length} positions in {len(self._pages)} pages"
        return f"<Context {self.context_id}: {state}>"


def _check_range(what: str, start, stop, length: int) -> None:
    if not all(isinstance(v, (int, np.integer)) for v in (start, stop)) or not 0 <= start <= stop <= length:
        raise PositionError(f"{what} of [{start}, {stop}) is outside length {length}")

