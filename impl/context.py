"""A context: an ordered list of page references and a length.

``fork`` copies the list and bumps refcounts; nothing else. ``writable`` is the
only place in kvstate where a page is copied, and it copies only a page that
another holder shares. Every write path goes through it.

Locking (the full discipline is in ``impl/cache.py``): page lists, lengths and
refcounts change under the cache lock. Value bytes are written outside it, into
pages that ``writable`` or allocation just made private to this context: no
other holder can reach such a page until this context's owner forks or retains
it, and a context has one owner at a time (enforced by ``_owned``).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as np

from kvstate.spec.arithmetic import pages_touched, span_in_page, truncate_keep
from kvstate.spec.errors import ContextBusyError, ContextClosedError, PositionError
from kvstate.spec.layout import check_tokens, check_values

from .pages import Page, joined_slots, ref_slots
from .query import packed_ids
from .snapshot import write_snapshot

if TYPE_CHECKING:
    from .cache import Cache


_new_context = object.__new__    # ``fork`` builds a child without ``__init__``
_KEY = np.dtype("<i4")      # radix.pack's packing: the key ``retain`` stores


class Context:
    # Slots: a fork builds one of these on the hottest path, and a slotted object is built faster
    # (no per-instance dict). A subclass that swaps ``__class__`` in (a test's planted bug)
    # declares ``__slots__ = ()``.
    __slots__ = ("_cache", "context_id", "_pages", "_base", "_length", "_closed", "_busy", "_slots", "_key",
                 "_base_slots", "__weakref__")

    def __init__(self, cache: "Cache", context_id: int, pages: tuple[Page, ...], length: int,
                 ids: np.ndarray | None = None, key: bytes | None = None, base: tuple[Page, ...] | None = None,
                 base_ids=None):
        self._cache = cache
        self.context_id = context_id
        # A tuple, replaced on every change and never changed in place: a fork holding all of
        # its parent's pages shares the very same tuple (``pages[:n]`` of a tuple with n pages
        # is that tuple), so a fork or match hit of k pages copies no list of k references.
        self._pages = pages
        # A tuple that is a prefix of ``_pages`` (the very objects, in order): the page list this
        # context was forked with, kept through appends. A fork at exactly its length takes it
        # whole instead of slicing ``_pages``: requests hitting at a shared system prompt fork
        # entries that each extended that same tuple, so the hit copies no list of page
        # references (a slice increfs every page: the cost of a one-token-page hit). Whatever
        # replaces a page below its end resets it (``writable``, ``_keep_first``, release).
        self._base = pages if base is None else base
        self._length = length
        self._closed = False
        # True while one operation holds this context (``_owned``); set and tested only under the
        # cache lock, so a flag does what a lock per context did, and a fork builds no lock.
        self._busy = False
        # The refcount slots of ``_pages`` (a prefix of them at least: see ``_ref_slots``), for the
        # pool's vectorised refcount steps: a range or an int array (``pages.ref_slots``). Never
        # written in place: a fork's is a slice of its parent's, or its parent's ``_base_slots`` itself.
        self._slots = ids if ids is not None else ref_slots(pages) if pages else range(0)
        # The refcount slots of ``_base``, kept beside it: a hit that takes the base whole shares
        # these, a range where the base was one extend's pages, so the count it leaves pending is
        # one slice add (``pages.Refcounts.flush``), not a scatter over an array view of ``_slots``.
        self._base_slots = self._slots if base is None else base_ids
        # The packed tokens (``radix.pack``) of positions [0, _length) at least, or None when
        # unknown; kept by ``_write`` so ``retain`` need not re-read every page's token ids.
        self._key = b"" if length == 0 else key

    # -- ownership ---------------------------------------------------------------

    def _owned(self) -> "_Ownership":
        """Hold this context for one operation; refuse a second concurrent user by name."""
        return _Ownership(self)

    def _refuse_use(self) -> None:
        """Raise what a use of this busy or closed context gets (under the cache lock). Callers that
        test the flags inline (``fork``, ``Cache.retain``: the hottest paths) and ``_owned`` share it."""
        if self._busy:
            raise ContextBusyError(f"context {self.context_id} is in use by another thread")
        raise ContextClosedError(f"context {self.context_id} is closed")

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

    def _ref_slots(self, n: int) -> np.ndarray:
        """The refcount slots of the first ``n`` pages. The engine keeps ``_slots`` in step with ``_pages``
        (``writable``, ``extend``, ``truncate``, release); a list grown behind its back (a test's
        planted bug) is still a prefix of it, so a short array is rebuilt rather than trusted."""
        ids = self._slots
        if len(ids) == n:
            return ids
        if len(ids) < n:
            ids = self._slots = ref_slots(self._pages)
        return ids[:n]

    def _packed_key(self) -> bytes:
        """``radix.pack(self._tokens())``, from the kept key when there is one."""
        key = self._kept_key()
        return self._tokens().astype(_KEY).tobytes() if key is None else key

    def _kept_key(self) -> bytes | None:
        """``radix.pack(self._tokens())`` from the kept key, reading no page; None when no key is kept."""
        key, size = self._key, 4 * self._length
        if key is None or len(key) < size:
            return None
        return key if len(key) == size else key[:size]

    def _tokens(self) -> np.ndarray:
        if not self._pages:
            return np.zeros(0, np.int64)
        # One join of the pages' token bytearrays (``Page.token_bytes``): at small pages (one
        # token each, thousands per context) np.concatenate of the int64 views costs ten times
        # as much. A fresh, writable copy.
        joined = np.frombuffer(bytearray().join([page.token_bytes for page in self._pages]), np.int64)
        return joined[:self._length]

    def read(self, start: int = 0, stop: int | None = None):
        """Values ``(n, layers, 2, kv_heads, head_dim)`` float32 and tokens of ``[start, stop)``."""
        with self._owned():
            start, stop = _check_range("read", start, self._length if stop is None else stop, self._length)
            store = self._cache.store
            if start == stop:
                return store.read_empty(), np.zeros(0, np.int64)
            first, end = pages_touched(start, stop, self.page_tokens)
            pages = self._pages[first:end]
            spans = [(page.buffer, 0, self.page_tokens) for page in pages]
            for index in (first, end - 1):      # only the first and the last page may be covered in part
                spans[index - first] = (self._pages[index].buffer, *span_in_page(index, start, stop, self.page_tokens))
            read_spans = getattr(store, "read_spans", None)     # one decode for every page, where the store can
            values = (read_spans(spans) if read_spans is not None
                      else store.concat([store.read(*span) for span in spans]))
            skip = first * self.page_tokens     # one join of the token bytes, as ``_tokens``
            tokens = np.frombuffer(bytearray().join([page.token_bytes for page in pages]), np.int64)
            return values, tokens[start - skip:stop - skip]

    def read_layer(self, layer: int, start: int = 0, stop: int | None = None):
        """K and V of one layer for positions ``[start, stop)``: two fresh float32 arrays ``(n, kv_heads, head_dim)``.

        Values are exactly what ``read`` returns for the same positions and layer,
        gathered into one array each; the result does not depend on the page size.
        """
        empty = (0, *self._cache.layout.position_shape[2:])
        store = self._cache.store
        with self._owned():     # gather while owned: the parts may be views of pages a next owner rewrites
            parts = self._layer_parts(layer, start, stop)
            return store.gather([k for k, _ in parts], empty), store.gather([v for _, v in parts], empty)

    def read_layer_pages(self, layer: int, start: int = 0, stop: int | None = None):
        """K and V of one layer for ``[start, stop)`` as one ``(k, v)`` pair per page touched, in order.

        The forward pass's read: pages hold positions layer-major, so each pair is
        a slice of one page, decoded to float32 (at f32, a view: no copy). Views
        are valid until the next write to this context; do not write into them.
        """
        with self._owned():
            return self._layer_parts(layer, start, stop)

    def _layer_parts(self, layer: int, start: int, stop: int | None):
        start, stop = _check_range("read_layer", start, self._length if stop is None else stop, self._length)
        index = _position(layer)
        if index is None or not 0 <= index < self._cache.layout.layers:
            raise PositionError(f"layer {layer!r} is outside 0..{self._cache.layout.layers - 1}")
        layer = index
        store, parts = self._cache.store, []
        for index in range(*pages_touched(start, stop, self.page_tokens)):
            lo, hi = span_in_page(index, start, stop, self.page_tokens)
            parts.append(store.read_layer(self._pages[index].buffer, layer, lo, hi))
        return parts

    @property
    def layout(self):
        return self._cache.layout

    @property
    def precision(self) -> str:
        """The cache's precision: what a value written here reads back as."""
        return self._cache.precision

    # -- writing -------------------------------------------------------------------

    def writable(self, index: int) -> Page:
        """Page ``index``, made private to this context first if another holder shares it.

        The only place a page is copied. Runs under the cache lock (re-entered here,
        cheaply, so a direct call cannot swap pages and refcounts unlocked).
        """
        with self._cache.lock:
            page = self._pages[index]
            if page.refcount == 1:
                return page
            private = self._cache.pool.clone(page)
            self._cache.pool.release(page)
            self._pages = (*self._pages[:index], private, *self._pages[index + 1:])
            ids = np.array(self._ref_slots(len(self._pages)), np.intp)     # a copy: a fork may view the old one
            ids[index] = private.ref
            self._slots = ids
            if index < len(self._base):
                self._base = self._pages
                self._base_slots = ids
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
                self._cache.pool.make_room(self._pages_to_grow(start, stop))
                self._grow(start, stop)
            self._write(start, stop, tokens, encoded)
            with self._cache.lock:
                self._length = stop

    def _pages_to_grow(self, start: int, stop: int) -> int:
        """Pages an append of ``[start, stop)`` takes from the pool: the new ones, plus a copy of the
        partly filled last page where other holders share it."""
        first, end = pages_touched(start, stop, self.page_tokens)
        partial_shared = first < len(self._pages) and self._pages[first].refcount > 1
        return partial_shared + end - len(self._pages)

    def _grow(self, start: int, stop: int) -> None:
        """Make every page ``[start, stop)`` lands in this context's own (under the cache lock, room made)."""
        first, end = pages_touched(start, stop, self.page_tokens)
        if first < len(self._pages):
            self.writable(first)           # the partly filled last page
        held = len(self._pages)
        self._pages += tuple(self._cache.pool.new_pages(end - held, room_made=True))
        self._slots = joined_slots(self._ref_slots(held), ref_slots(self._pages[held:]))
        self._raise_filled(start, stop)

    def overwrite(self, start: int, tokens, kv) -> None:
        """Rewrite positions ``[start, start + n)``, all inside the current length."""
        tokens = check_tokens(tokens)
        kv = check_values(self._cache.layout, kv, len(tokens))
        with self._owned():
            first = _position(start)
            stop = first + len(tokens) if first is not None else None
            if stop is None or not 0 <= first <= stop <= self._length:
                raise PositionError(
                    f"overwrite of [{start}, {stop}) is outside context {self.context_id} of length {self._length}")
            start = first
            if start == stop:
                return
            encoded = self._cache.store.encode(kv)
            with self._cache.lock:
                touched = range(*pages_touched(start, stop, self.page_tokens))
                self._cache.pool.make_room(sum(self._pages[index].refcount > 1 for index in touched))
                for index in touched:
                    self.writable(index)
            self._write(start, stop, tokens, encoded)

    def _raise_filled(self, start: int, stop: int) -> None:
        """Raise the ``filled`` mark of each page ``[start, stop)`` lands in. Under the cache lock,
        before the bytes land outside it: an ``observe()`` in between must never find written
        bytes past ``filled`` (it would report a dirty tail that is not there)."""
        for index in range(*pages_touched(start, stop, self.page_tokens)):
            page = self._pages[index]
            page.filled = max(page.filled, span_in_page(index, start, stop, self.page_tokens)[1])

    def _write(self, start: int, stop: int, tokens: np.ndarray, encoded) -> None:
        """Store positions ``[start, stop)`` into pages that are already private.

        Runs outside the cache lock. ``extend`` raised the ``filled`` marks in its own
        critical section; any other caller (a restore filling fresh pages) gets them raised
        here, under the lock, before a byte is written. Reading the marks unlocked is safe:
        only this context's owner changes the marks of its private pages.
        """
        if any(self._pages[index].filled < span_in_page(index, start, stop, self.page_tokens)[1]
               for index in range(*pages_touched(start, stop, self.page_tokens))):
            with self._cache.lock:
                self._raise_filled(start, stop)
        key, packed = self._key, packed_ids(tokens[:stop - start])
        if start == 0 and stop >= self._length:
            key = packed
        elif key is not None and len(key) >= 4 * self._length:
            key = key[:4 * start] + packed + key[4 * stop:4 * self._length]
        else:
            key = None
        self._key = None        # unknown while the pages are half written
        store = self._cache.store
        raw = memoryview(np.ascontiguousarray(tokens[:stop - start], np.int64)).cast("B")   # 8 bytes a token
        for index in range(*pages_touched(start, stop, self.page_tokens)):
            lo, hi = span_in_page(index, start, stop, self.page_tokens)
            row = index * self.page_tokens + lo - start
            page = self._pages[index]
            store.write(page.buffer, lo, encoded, row, row + hi - lo)
            page.token_bytes[8 * lo:8 * hi] = raw[8 * row:8 * (row + hi - lo)]
        self._key = key

    # -- structure -------------------------------------------------------------------

    def fork(self) -> "Context":
        """A new context sharing every page: a page-list copy plus refcount increments."""
        # ``_owned`` spelled out (fork is the hottest path): the whole fork runs under the cache
        # lock, so testing the busy flag there is enough; no other thread can take this context
        # until the fork is done, and one that holds it has set the flag.
        # ``with``, not acquire() then try: an asynchronous exception (Ctrl-C, a run's deadline)
        # delivered between the two would leave the cache lock held for good.
        cache = self._cache
        with cache.lock:
            if self._busy or self._closed:
                self._refuse_use()
            pages, ids, n = self._pages, self._slots, len(self._pages)
            # the last test is ``pages_needed(self._length) != n``, spelled out
            if len(ids) != n or len(self._base) > n or -(-self._length // cache.page_tokens) != n:
                return cache._fork(self)        # slots to rebuild, a base to reset, pages to drop: the general path
            # ``Cache._fork`` at full length, spelled out: the pending count (``PagePool.share``),
            # then the child built slot by slot (a quarter cheaper than ``__init__``'s call).
            books = cache.pool.books
            entry = books.pending.get(id(ids))
            if entry is not None and entry[0] is ids:
                entry[1] += 1
            else:
                books.share(ids)
            child = _new_context(Context)
            child._cache = cache
            child.context_id = context_id = cache._next_context_id = cache._next_context_id + 1
            child._pages = pages
            child._slots = ids
            child._base = self._base
            child._base_slots = self._base_slots
            child._length = self._length
            child._key = self._key
            child._closed = child._busy = False
            cache._contexts[context_id] = child
            return child

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions; pages past them are released."""
        with self._owned():
            keep_positions = _position(n)
            if keep_positions is None or not 0 <= keep_positions <= self._length:
                raise PositionError(f"truncate to {n} is outside context {self.context_id} of length {self._length}")
            n = keep_positions
            with self._cache.lock:
                self._keep_first(n)

    def _keep_first(self, n: int) -> None:
        """Keep the first ``n`` positions and release the pages past them (under the cache lock)."""
        keep, _released = truncate_keep(self._length, n, self.page_tokens)
        for page in self._pages[keep:]:
            self._cache.pool.release(page)
        self._pages = self._pages[:keep]
        self._slots = self._slots[:keep]
        if len(self._base) > keep:
            self._base = self._pages
            self._base_slots = self._slots
        self._length = n

    def snapshot(self, target, deadline_s: float | None = None) -> None:
        """Write tokens and values, in the cache's own precision, to a path or URL (atomically) or binary stream.

        ``deadline_s``: a URL's write in all, retries included (else the cache's ``remote_deadline_s``,
        the block's or the default). Format: ``spec/snapshot_format.py``; writer: ``impl/snapshot_write.py``.
        """
        with self._owned():
            write_snapshot(self, target, self._cache.remote_deadline(deadline_s))

    def close(self) -> None:
        """Release every page. Any later use raises ``ContextClosedError``."""
        cache = self._cache
        with cache.lock:        # all of it under the cache lock, as in ``fork``: no busy flag to set
            if self._busy or self._closed:
                self._refuse_use()
            cache._close(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._length} positions in {len(self._pages)} pages"
        return f"<Context {self.context_id}: {state}>"


class _Ownership:
    """``with ctx._owned():`` -- a plain class rather than a generator: it is on every operation.

    The busy flag is tested and set under the cache lock, so two threads cannot both take it;
    clearing it is one store, which needs no lock (the flag only ever goes from set to clear
    in the thread that set it)."""

    __slots__ = ("ctx",)

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def __enter__(self) -> None:
        ctx = self.ctx
        with ctx._cache.lock:       # ``with``: see ``Context.fork``
            if ctx._busy or ctx._closed:
                ctx._refuse_use()
            ctx._busy = True

    def __exit__(self, *exc) -> None:
        self.ctx._busy = False


def _position(value) -> int | None:
    """A position as a Python int, or None for anything that is not one.

    Converted at the door (``operator.index``): a NumPy ``uint8`` or ``int8`` would
    otherwise carry its width into the page arithmetic and wrap. Ints of every
    width are positions (Python or NumPy); a bool is not, nor a float or 0-d array.
    """
    if type(value) is int:      # the common case first: a plain int (a bool's type is bool)
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    return operator.index(value)


def _check_range(what: str, start, stop, length: int) -> tuple[int, int]:
    first, end = _position(start), _position(stop)
    if first is None or end is None or not 0 <= first <= end <= length:
        raise PositionError(f"{what} of [{start}, {stop}) is outside length {length}")
    return first, end

