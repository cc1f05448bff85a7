"""A context: an ordered list of page references and a length.

Both live in the context's ``Holding`` (``impl/holding.py``), one object that every change
replaces whole. ``fork`` hands the child that very object and counts one more holder of its
pages (pending until a count is read: ``refcounts.Refcounts``); nothing else. ``writable`` is the
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
from threading import get_ident
from typing import TYPE_CHECKING, Iterator

import numpy as np

from kvstate.spec.arithmetic import pages_touched, span_in_page, truncate_keep
from kvstate.spec.errors import ContextBusyError, ContextClosedError, PositionError
from kvstate.spec.layout import check_tokens, check_values
from kvstate.spec.positions import as_position, not_a_position

from .holding import Holding
from .pages import Page, PageAccountingError, joined_slots
from .query import packed_ids
from .snapshot import write_snapshot
from .store import recycle

if TYPE_CHECKING:
    from .cache import Cache


_new_context = object.__new__    # ``fork`` builds a child without ``__init__``

# ``Context._use``: one field, not a busy and a closed flag, so the hottest paths test one slot:
# FREE, CLOSED, or while an operation holds the context the holding thread's id (never 0 nor
# negative), so ``writable`` can tell its holder's own calls from another thread's.
FREE, CLOSED = 0, -1
_KEY = np.dtype("<i4")      # radix.pack's packing: the key ``retain`` stores


class Context:
    # Slots: a fork builds one of these on the hottest path, and a slotted object is built faster
    # (no per-instance dict). A subclass that swaps ``__class__`` in (a test's planted bug)
    # declares ``__slots__ = ()``.
    __slots__ = ("_cache", "context_id", "_holding", "_use", "__weakref__")

    def __init__(self, cache: "Cache", context_id: int, holding: Holding):
        self._cache = cache
        self.context_id = context_id
        # The pages, their refcount slots, the length, the key and the base, in one object that
        # every change replaces whole (``impl/holding.py``): a fork's child holds the same one.
        self._holding = holding
        # The holder's thread id while one operation holds this context (``_owned``), CLOSED once
        # closed, else FREE; set and tested only under the cache lock, so a flag does what a lock per
        # context did, and a fork builds no lock.
        self._use = FREE

    # The holding's parts, read-only (every change builds a new ``Holding``), for readers that want one.
    _pages = property(operator.attrgetter("_holding.pages"))
    _slots = property(operator.attrgetter("_holding.slots"))
    _length = property(operator.attrgetter("_holding.length"))
    _key = property(operator.attrgetter("_holding.key"))
    _base = property(operator.attrgetter("_holding.base"))
    _base_slots = property(operator.attrgetter("_holding.base_slots"))

    # -- ownership ---------------------------------------------------------------

    def _owned(self, work, *args):
        """``work(*args)``, holding this context for it: a second concurrent user is refused by name.

        The flag is tested and set (to this thread's id) under the cache lock, so two threads cannot
        both take it; clearing it is one store, which needs no lock (the flag only ever goes from set
        to clear in the thread that set it). It is taken inside the ``try`` and cleared in its
        ``finally`` with no call there: CPython delivers an interrupt (Ctrl-C, a run's deadline) at
        a call, and one that landed at the entry of a context manager's ``__exit__``, before it
        cleared the flag, kept the context busy for good: never closed, its pages never freed.
        ``held == me``: this thread held it already (a signal handler's use during an operation),
        so ``_take`` refused it, and the outer operation's flag is left alone."""
        me, held = get_ident(), self._use
        try:
            self._take(me)
            return work(*args)
        finally:
            if self._use == me != held:     # not CLOSED (the work closed it), nor another holder's
                self._use = FREE

    def _take(self, me: int) -> None:
        with self._cache.lock:       # ``with``: see ``fork``
            if self._use:
                self._refuse_use()
            self._use = me

    def _refuse_use(self) -> None:
        """Raise what a use of this busy or closed context gets (under the cache lock). Callers that
        test the flag inline (``fork``, ``Cache.retain``: the hottest paths) and ``_owned`` share it.

        The caller saw the flag set; it may have been cleared since (the thread that held the context
        clears it without the lock), but a closed context never opens again: so anything but CLOSED
        now is "busy" (a retry goes through), never "closed"."""
        if self._use == CLOSED:
            raise ContextClosedError(f"context {self.context_id} is closed")
        raise ContextBusyError(f"context {self.context_id} is in use by another thread")

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        if self._use != CLOSED:
            self.close()

    # -- reading -------------------------------------------------------------------

    def __len__(self) -> int:
        return self._holding.length

    @property
    def closed(self) -> bool:
        return self._use == CLOSED

    @property
    def cache(self):
        """The ``Cache`` whose pages this context holds (where its forks, retains and restores go)."""
        return self._cache

    @property
    def page_tokens(self) -> int:
        return self._cache.page_tokens

    @property
    def tokens(self) -> list[int]:
        return self._owned(self._token_list)

    def _token_list(self) -> list[int]:
        return self._tokens().tolist()

    def _packed_key(self) -> bytes:
        """``radix.pack(self._tokens())``, from the kept key when there is one."""
        key = self._kept_key()
        return self._tokens().astype(_KEY).tobytes() if key is None else key

    def _kept_key(self) -> bytes | None:
        """``radix.pack(self._tokens())`` from the kept key, reading no page; None when no key is kept."""
        holding = self._holding
        key, size = holding.key, 4 * holding.length
        if key is None or len(key) < size:
            return None
        return key if len(key) == size else key[:size]

    def _tokens(self) -> np.ndarray:
        if not self._pages:
            return np.zeros(0, np.int64)
        # One gather from the pool's table (``page_table.PageTable``): a fresh, writable copy.
        holding = self._holding
        return self._cache.pool.table.gather(holding.slots)[:holding.length]

    def read(self, start: int = 0, stop: int | None = None):
        """Values ``(n, layers, 2, kv_heads, head_dim)`` float32 and tokens of ``[start, stop)``."""
        return self._owned(self._read, start, stop)

    def _read(self, start: int, stop: int | None):
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
        skip = first * self.page_tokens     # one gather of their rows, as ``_tokens``
        tokens = self._cache.pool.table.gather(self._holding.slots[first:end])
        return values, tokens[start - skip:stop - skip]

    def read_layer(self, layer: int, start: int = 0, stop: int | None = None):
        """K and V of one layer for positions ``[start, stop)``: two fresh float32 arrays ``(n, kv_heads, head_dim)``.

        Values are exactly what ``read`` returns for the same positions and layer,
        gathered into one array each; the result does not depend on the page size.
        """
        # Gathered while owned: the parts may be views of pages a next owner rewrites.
        return self._owned(self._read_layer, layer, start, stop)

    def _read_layer(self, layer: int, start: int, stop: int | None):
        empty = (0, *self._cache.layout.position_shape[2:])
        store = self._cache.store
        parts = self._layer_parts(layer, start, stop)
        return store.gather([k for k, _ in parts], empty), store.gather([v for _, v in parts], empty)

    def read_layer_pages(self, layer: int, start: int = 0, stop: int | None = None):
        """K and V of one layer for ``[start, stop)`` as one ``(k, v)`` pair per page touched, in order.

        The forward pass's read: pages hold positions layer-major, so each pair is
        a slice of one page, decoded to float32 (at f32, a view: no copy). Views
        are valid until the next write to this context; do not write into them.
        """
        return self._owned(self._layer_parts, layer, start, stop)

    def _layer_parts(self, layer: int, start: int, stop: int | None):
        start, stop = _check_range("read_layer", start, self._length if stop is None else stop, self._length)
        index = as_position(layer)
        if index is None or not 0 <= index < self._cache.layout.layers:
            raise PositionError(f"layer {layer!r} is outside 0..{self._cache.layout.layers - 1}")
        layer = index
        store, parts, pages, page_tokens = self._cache.store, [], self._holding.pages, self.page_tokens
        for index in range(*pages_touched(start, stop, page_tokens)):
            lo, hi = span_in_page(index, start, stop, page_tokens)
            parts.append(store.read_layer(pages[index].buffer, layer, lo, hi))
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
        cheaply, so a direct call cannot swap pages and refcounts unlocked). Called by the
        thread that holds this context (its own writes), or on a free one; a call from another
        thread while an operation holds it is refused, as every other use is: that operation
        replaces the page list it read before this call, and would undo the copy's refcounts.
        """
        with self._cache.lock:
            use = self._use
            if use and use != get_ident():
                self._refuse_use()
            at = as_position(index)
            if at is None or not 0 <= at < len(self._pages):      # a negative index kept every old page
                raise PositionError(f"page index {index!r} is outside context {self.context_id}'s "
                                    f"{len(self._pages)} pages")
            index, page = at, self._pages[at]
            if page.refcount == 1:
                return page
            pool = self._cache.pool
            if not use:     # a direct call: no operation around it has made room for its copy
                pool.make_room(1)
                if page.refcount == 1:      # the room was made by evicting its other holders
                    return page
            private = pool.clone(page)
            # The new holding is built whole before anything else changes, and this context's count
            # on ``page`` goes in the same step as it stops listing ``page``: an exception here
            # (memory ran out building the lists, or an interrupt: Ctrl-C, a run's deadline, which
            # CPython delivers at a Python call's entry or after a C call returns) gives the copy
            # back and leaves the context as it was, holding ``page`` counted.
            try:
                holding = self._holding
                pages = (*holding.pages[:index], private, *holding.pages[index + 1:])
                slots = np.array(holding.slots, np.intp)     # a copy: a fork may hold the old one
                slots[index] = private.ref
                replaced = holding.replaced(pages, slots, keep_base=index >= len(holding.base))
                counts = pool.books.counts      # read after ``clone``, which may have grown (replaced) the array
                refs = counts[page.ref]
                if refs < 2:
                    raise PageAccountingError(f"page {page.page_id} of context {self.context_id} is counted "
                                              f"{refs} times while it is copied as shared")
                # ``pool.release(page)``, spelled out: the count is at least 2, so it frees nothing.
                # Nothing between the decrement and the assignment below calls a Python function or a
                # C function through a call, so no interrupt lands between them.
                counts[page.ref] = refs - 1
            except BaseException:
                pool.release(private)
                raise
            self._holding = replaced
            return private

    def extend(self, tokens, kv) -> None:
        """Append positions. Validated in full before anything is allocated or written."""
        tokens = check_tokens(tokens)
        kv = check_values(self._cache.layout, kv, len(tokens))
        self._owned(self._extend, tokens, kv)

    def _extend(self, tokens: np.ndarray, kv) -> None:
        if len(tokens) == 0:
            return
        store, lock = self._cache.store, self._cache.lock
        encoded = store.encode(kv)
        try:
            start, stop = self._length, self._length + len(tokens)
            # From the first page taken to the new length set, one protected region: a failure
            # anywhere in it (the pool refused, the store failed, an interrupt, even one after
            # the length was set) truncates back to ``start``, so no page is left listed past
            # the length (invariant 2) and nothing is half written.
            try:
                with lock:
                    self._cache.pool.make_room(self._pages_to_grow(start, stop))
                    self._grow(start, stop)
                self._write(start, stop, tokens, encoded)
                with lock:
                    self._holding = self._holding.with_length(stop)
            except BaseException:       # the store failed, or an interrupt: the pages made for it go back
                with lock:
                    self._keep_first(start)
                raise
        finally:
            recycle(store, encoded)      # the pages hold copies: nothing reads it after this

    def _pages_to_grow(self, start: int, stop: int) -> int:
        """Pages an append of ``[start, stop)`` takes from the pool: the new ones, plus a copy of the
        partly filled last page where other holders share it."""
        first, end = pages_touched(start, stop, self.page_tokens)
        partial_shared = first < len(self._pages) and self._pages[first].refcount > 1
        return partial_shared + end - len(self._pages)

    def _grow(self, start: int, stop: int) -> None:
        """Make every page ``[start, stop)`` lands in this context's own (under the cache lock, room made).
        Their ``filled`` marks are raised by ``_write``, under the lock, before a byte lands."""
        first, end = pages_touched(start, stop, self.page_tokens)
        if first < len(self._pages):
            self.writable(first)           # the partly filled last page
        holding = self._holding
        if end > len(holding.pages):
            pool = self._cache.pool
            grown, slots = pool.new_run(end - len(holding.pages), room_made=True)
            try:        # the new pages' one holder is this context only once its holding lists them
                grown_holding = holding.replaced(holding.pages + tuple(grown), joined_slots(holding.slots, slots),
                                                 keep_base=True)
            except BaseException:       # memory ran out joining the lists (or an interrupt): no page left unheld
                pool.release_slots(grown, slots)
                raise
            self._holding = grown_holding

    def overwrite(self, start: int, tokens, kv) -> None:
        """Rewrite positions ``[start, start + n)``, all inside the current length."""
        tokens = check_tokens(tokens)
        kv = check_values(self._cache.layout, kv, len(tokens))
        self._owned(self._overwrite, start, tokens, kv)

    def _overwrite(self, start: int, tokens: np.ndarray, kv) -> None:
        first = as_position(start)
        if first is None:
            raise PositionError(not_a_position("overwrite", start))
        stop = first + len(tokens)
        if not 0 <= first <= stop <= self._length:
            raise PositionError(
                f"overwrite of [{start}, {stop}) is outside context {self.context_id} of length {self._length}")
        start = first
        if start == stop:
            return
        store = self._cache.store
        encoded = store.encode(kv)
        try:
            with self._cache.lock:
                touched = range(*pages_touched(start, stop, self.page_tokens))
                self._cache.pool.make_room(sum(self._pages[index].refcount > 1 for index in touched))
                for index in touched:
                    self.writable(index)
            # ``_write`` puts every token id of the span in first, then the values page by page: a
            # failure part way (a store error, an interrupt) left new ids over old values, or a
            # page half written (q8's codes without their scales). So the span's ids, values
            # (exactly) and key are kept first, and put back whole on any exception.
            saved = self._saved_span(start, stop)
            try:
                self._write(start, stop, tokens, encoded)
            except BaseException:
                self._restore_span(start, stop, saved)
                raise
        finally:
            recycle(store, encoded)

    def _saved_span(self, start: int, stop: int) -> tuple:
        """What ``_restore_span`` puts back of positions ``[start, stop)`` (whose pages are already
        private): the key, the token ids, and the values, exactly: the stored rows themselves, copied
        in one call per stored part (``PageStore.stored_spans``: on the torch store they stay on the
        device; read a page at a time they cost a q8 overwrite of 512 one-token pages 3.6x its write).
        A store without it: at f32 and f16 the values as ``read`` decodes them (``read_spans``), which
        encode back to the very bytes stored; at q8 (a decoded value does not re-quantise to its codes
        and scale) ``read_encoded`` a page at a time."""
        holding, page_tokens, store = self._holding, self.page_tokens, self._cache.store
        first, end = pages_touched(start, stop, page_tokens)
        skip = first * page_tokens
        ids = self._cache.pool.table.gather(holding.slots[first:end])[start - skip:stop - skip]
        pages = holding.pages
        spans = [(pages[index].buffer, lo, hi) for index, lo, hi in _page_spans(start, stop, page_tokens)]
        stored_spans = getattr(store, "stored_spans", None)
        if stored_spans is not None:
            return holding.key, ids, stored_spans(spans), "stored"
        if self._cache.precision in ("f32", "f16"):
            read_spans = getattr(store, "read_spans", None)
            values = (read_spans(spans) if read_spans is not None
                      else store.concat([store.read(*span) for span in spans]))     # fresh arrays: copies
            return holding.key, ids, values, "decoded"
        parts = [store.read_encoded(*span) for span in spans]
        values = tuple(np.concatenate([part[i] for part in parts]) for i in range(len(parts[0])))   # copies
        return holding.key, ids, values, "encoded"

    def _restore_span(self, start: int, stop: int, saved: tuple) -> None:
        """Put back what ``_saved_span`` kept of ``[start, stop)``: the bytes, then the ids and the key."""
        key, ids, values, form = saved
        store, pages = self._cache.store, self._holding.pages
        if form == "stored":        # the rows as the pages hold them: written back as they are
            _store_values(store, pages, start, stop, self.page_tokens, values)
        elif form == "encoded":
            _store_values(store, pages, start, stop, self.page_tokens, store.from_encoded(values))
        else:
            encoded = store.encode(values)
            try:
                _store_values(store, pages, start, stop, self.page_tokens, encoded)
            finally:
                recycle(store, encoded)
        with self._cache.lock:
            self._cache.pool.table.write(self._holding.slots, start, ids)
            self._holding = self._holding.with_key(key)

    def _write(self, start: int, stop: int, tokens: np.ndarray, encoded) -> None:
        """Store positions ``[start, stop)`` into pages that are already private.

        The values are copied outside the cache lock. Inside it, first, the pages' ``filled``
        marks are raised, before a byte lands: an ``observe()`` in between must never find written
        bytes past ``filled`` (it would report a dirty tail that is not there). The token ids go
        into the pool's table (``page_table.PageTable``, written under the lock only) in the same
        short critical section.
        """
        held, page_tokens = self._holding, self.page_tokens     # read once: loops over every page
        pages = held.pages
        ids = np.ascontiguousarray(tokens[:stop - start], np.int64)
        with self._cache.lock:
            table = self._cache.pool.table
            table.raise_filled(held.slots, start, stop)
            table.write(held.slots, start, ids)
        self._holding = held.with_key(None)        # unknown while the pages are half written
        _store_values(self._cache.store, pages, start, stop, page_tokens, encoded)
        # The key last, after the page-by-page loop: the cast it runs is the one the caller's next
        # lookup runs (``packed_ids``), and at one-token pages the loop would evict it again.
        key, packed = held.key, packed_ids(tokens[:stop - start])
        if start == 0 and stop >= held.length:
            key = packed
        elif key is not None and len(key) >= 4 * held.length:
            key = key[:4 * start] + packed + key[4 * stop:4 * held.length]
        else:
            key = None
        self._holding = self._holding.with_key(key)

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
            if self._use:
                self._refuse_use()
            # The child holds this very holding, its count pending on it (``Refcounts.share_holding``,
            # spelled out after the first fork since a flush), and is built slot by slot: a quarter
            # cheaper than ``__init__``'s call. Made before the count, and registered after it with
            # no call between: an interrupt (delivered at a call) counts nothing, or a child held.
            child = _new_context(Context)
            child._cache = cache
            child._use = FREE
            holding = self._holding
            if holding.forks:
                holding.forks += 1
            else:
                cache.pool.books.share_holding(holding)
            child._holding = holding
            child.context_id = context_id = cache._next_context_id = cache._next_context_id + 1
            cache._contexts[context_id] = child
            return child

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions; pages past them are released."""
        self._owned(self._truncate, n)

    def _truncate(self, n: int) -> None:
        keep_positions = as_position(n)
        if keep_positions is None:
            raise PositionError(not_a_position("truncate", n))
        if not 0 <= keep_positions <= self._length:
            raise PositionError(f"truncate to {n} is outside context {self.context_id} of length {self._length}")
        n = keep_positions
        with self._cache.lock:
            self._keep_first(n)

    def _keep_first(self, n: int) -> None:
        """Keep the first ``n`` positions and release the pages past them (under the cache lock)."""
        holding = self._holding
        keep, _released = truncate_keep(holding.length, n, self.page_tokens)
        if n == holding.length and keep == len(holding.pages):
            return      # nothing to cut (an extend refused before it took a page): the holding stays itself
        # The holding that keeps them is built first, and the release puts it in place in the same
        # step as the counts go down (``PagePool.release_slots``): an interrupt before that step
        # changes nothing, one after it finds the pages let go and no longer listed.
        kept = holding.replaced(holding.pages[:keep], holding.slots[:keep],
                                keep_base=len(holding.base) <= keep).with_length(n)
        if keep < len(holding.pages):       # one step for all of them, as a close releases its pages
            self._cache.pool.release_slots(holding.pages[keep:], holding.slots[keep:], self, kept)
        else:
            self._holding = kept

    def snapshot(self, target, deadline_s: float | None = None, producer: bytes | None = None) -> None:
        """Write tokens and values, in the cache's own precision, to a path or URL (atomically) or binary stream.

        ``deadline_s``: a URL's write in all, retries included (else the cache's ``remote_deadline_s``,
        the block's or the default). ``producer``: 16 bytes naming what computed the values (a
        model's fingerprint), kept in the file (format version 3) for a restore to check.
        Format: ``spec/snapshot_format.py``; writer: ``impl/snapshot_write.py``.
        """
        self._owned(write_snapshot, self, target, self._cache.remote_deadline(deadline_s), producer)

    def close(self) -> None:
        """Release every page. Any later use raises ``ContextClosedError``; ``len()`` (which takes no
        lock) reads 0, as the protocol leaves it free to."""
        cache = self._cache
        with cache.lock:        # all of it under the cache lock, as in ``fork``: no busy flag to set
            if self._use:
                self._refuse_use()
            cache._close(self)

    def __repr__(self) -> str:
        state = "closed" if self._use == CLOSED else f"{self._length} positions in {len(self._pages)} pages"
        return f"<Context {self.context_id}: {state}>"

    def __copy__(self):
        # A shallow copy held the pages uncounted under the same id: closing it freed pages this
        # context still read, and its cache's books broke (an audit). A pickle or deep copy copies
        # the cache with it, so stays consistent.
        raise TypeError("a Context is not copied: fork() gives a context holding the same pages, counted "
                        "(a shallow copy would hold them behind the cache's back)")


def _store_values(store, pages: tuple, start: int, stop: int, page_tokens: int, encoded) -> None:
    """Rows ``[0, stop - start)`` of ``encoded`` into positions ``[start, stop)`` of ``pages`` (a
    holding's whole list): a store call for the first and the last page, one for those between
    where the store writes whole pages (``write_whole``), else one a page."""
    write_whole = getattr(store, "write_whole", None)
    whole = _whole_pages(start, stop, page_tokens) if write_whole is not None else range(0)
    for index, lo, hi in _page_spans(start, stop, page_tokens, skip=whole):
        row = index * page_tokens + lo - start
        store.write(pages[index].buffer, lo, encoded, row, row + hi - lo)
    if whole:       # the pages between, covered whole: one store call
        write_whole([page.buffer for page in pages[whole.start:whole.stop]], encoded, whole.start * page_tokens - start)


def _page_spans(start: int, stop: int, page_tokens: int, skip: range = range(0)) -> Iterator[tuple[int, int, int]]:
    """``(index, lo, hi)`` for each page that positions ``[start, stop)`` touch, in order:
    ``span_in_page`` of the first and the last, the only ones that may be covered in part; the
    pages between are covered whole, ``(0, page_tokens)``. ``skip``, where given, is
    ``_whole_pages(start, stop, page_tokens)``, written by the caller in one call: it holds every
    page between, so only a first or last page outside it is yielded. At one-token pages an extend
    touches hundreds of pages, and the loops' ``span_in_page`` calls, three a page, were about a
    fifth of its time. A generator, not a list: each span is let go once read, so an extend leaves
    no tuple per page behind. ``start < stop``, as ``pages_touched`` requires (every caller returns
    before an empty write)."""
    first, end = pages_touched(start, stop, page_tokens)
    if first not in skip:
        yield (first, *span_in_page(first, start, stop, page_tokens))
    if not skip:
        for index in range(first + 1, end - 1):
            yield index, 0, page_tokens
    if end - first > 1 and end - 1 not in skip:
        yield (end - 1, *span_in_page(end - 1, start, stop, page_tokens))


def _whole_pages(start: int, stop: int, page_tokens: int) -> range:
    """The pages that positions ``[start, stop)`` cover whole, where they are two or more (one is
    written as a part is), else none: the first page starting at or after ``start`` to the last
    ending at or before ``stop``."""
    whole = range(-(-start // page_tokens), stop // page_tokens)
    return whole if len(whole) > 1 else range(0)


def _check_range(what: str, start, stop, length: int) -> tuple[int, int]:
    first, end = as_position(start), as_position(stop)
    if first is None or end is None:
        raise PositionError(not_a_position(what, start if first is None else stop))
    if not 0 <= first <= end <= length:
        raise PositionError(f"{what} of [{start}, {stop}) is outside length {length}")
    return first, end

