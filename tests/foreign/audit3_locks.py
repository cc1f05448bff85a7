"""An audit's engine (audit3), written from README.md and ``kvstate.spec`` alone: token matching at
page size 4 over a fixed page pool that evicts, with fine-grained locks, observed through the pages tier.

The combination no other foreign backend covers:

- ``match="token"`` at ``page_tokens=4``: a hit is the longest common prefix with any retained key,
  so it usually ends inside a page; that page stays shared (entry and hit both list it) until the
  hit writes into it, when ``writable`` copies it.
- A pool of ``pool_pages`` pages with ``on_full="evict"``: an operation first counts its need
  (``extend``: new pages plus a copy of a shared, partly filled last page; ``overwrite``: a copy of
  each shared page it touches), then evicts least recently used entries that keep a page no context
  lists, oldest first, until live + need fits or no such entry is left, then falls back to ordinary
  memory (a page past the pool is still a page). One configuration adds a ``max_pages`` budget.
- A fourth configuration refuses instead (``on_full="refuse"``: ``CapacityError`` before anything
  changes), the control for a planted refusal that changes state first.
- Fine-grained locking, ``thread_safe = True``: one ``threading.Lock`` per context and one
  ``threading.RLock`` for the pool and tree (``cache.lock``). THE ORDER: a context's lock first, then
  the cache lock; never the other way, and never two context locks at once. So:

    allocate, match, clear, observe       cache lock only (a context made here is not yet shared)
    read, tokens                          the context's lock only (its pages are held, so none is freed,
                                          and a page it shares is never written by anyone)
    extend, overwrite                     context lock; inside it the cache lock for counting the need,
                                          evicting, allocating and copying shared pages (``writable``)
                                          and moving the length; the bytes are then written with the
                                          context lock alone, into pages only this context lists
    fork, truncate, close, retain(ctx)    context lock, then the cache lock for the page lists and refcounts

  A page list, a length, a refcount, the entries and the live-page books change only under the
  cache lock, so ``observe()`` (cache lock alone) sees them consistent. A page only one context
  lists cannot become shared while that context's lock is held: sharing needs ``fork`` or
  ``retain`` of that context (its lock) or ``match`` of an entry (which lists no such page).
  Forks of one parent wait their turn on the parent's lock (README: a backend may serialise them).

Pages store what a read returns (values rounded by ``spec.precision.roundtrip``).
Each step is a small method so ``audit3_locks_bugs.py`` can break one promise per subclass.
"""

from __future__ import annotations

import itertools
import operator
import threading

import numpy as np

from kvstate.spec import Config, Layout, Observation, PageView
from kvstate.spec import precision as precisions
from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.errors import CapacityError, ContextClosedError, EmptyContextError, ForeignContextError, PositionError
from kvstate.spec.layout import check_tokens, check_values, require_finite


def _index(value, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise PositionError(f"{what} must be an int, got {type(value).__name__}") from None


class Page:
    __slots__ = ("page_id", "refcount", "values", "tokens")

    def __init__(self, page_id: int, layout: Layout, page_tokens: int):
        self.page_id = page_id
        self.refcount = 1
        self.values = np.zeros((page_tokens, *layout.position_shape), np.float32)
        self.tokens = np.zeros(page_tokens, np.int64)


class Entry:
    __slots__ = ("key", "pages", "tick", "serial")

    def __init__(self, key: tuple, pages: list, tick: int, serial: int):
        self.key, self.pages, self.tick, self.serial = key, pages, tick, serial


class LockContext:
    def __init__(self, cache: "LockCache", pages: list[Page], length: int, serial: int):
        self.cache = cache
        self.pages = pages
        self.length = length
        self.serial = serial
        self.closed = False
        self.lock = threading.Lock()       # taken before cache.lock, never after it

    def __len__(self) -> int:
        return self.length

    def _open(self) -> None:
        if self.closed:
            raise ContextClosedError("this context is closed")

    # -- reads: the context's lock only ---------------------------------------------

    @property
    def tokens(self) -> list[int]:
        with self.lock:
            self._open()
            return [int(t) for t in self._gather(0, self.length)[1]]

    def _gather(self, start: int, stop: int):
        size = self.cache.page_tokens
        values = np.zeros((stop - start, *self.cache.layout.position_shape), np.float32)
        tokens = np.zeros(stop - start, np.int64)
        for i, position in enumerate(range(start, stop)):
            page = self.pages[position // size]
            values[i] = page.values[position % size]
            tokens[i] = page.tokens[position % size]
        return values, tokens

    def read(self, start: int = 0, stop: int | None = None):
        with self.lock:
            self._open()
            start = _index(start, "start")
            stop = self.length if stop is None else _index(stop, "stop")
            if not 0 <= start <= stop <= self.length:
                raise PositionError(f"read of [{start}, {stop}) outside length {self.length}")
            return self._gather(start, stop)

    # -- writes ------------------------------------------------------------------------

    def _validate(self, tokens, kv):
        # outside every lock: copies of the caller's arguments (check_tokens copies; roundtrip too)
        tokens = check_tokens(tokens)
        kv = check_values(self.cache.layout, kv, len(tokens))
        kv = np.array(kv, dtype=np.float32, copy=True)
        require_finite(kv)
        return tokens, precisions.roundtrip(self.cache.precision, kv)

    def extend_need(self, n: int) -> int:
        """Pages an extend of ``n`` positions needs (cache lock held): new pages, plus a copy of a
        partly filled last page another holder shares."""
        if n == 0:
            return 0
        size = self.cache.page_tokens
        new = pages_needed(self.length + n, size) - len(self.pages)
        copy = 1 if self.length % size and self.pages[self.length // size].refcount > 1 else 0
        return new + copy

    def overwrite_need(self, start: int, n: int) -> int:
        """A copy of each shared page ``[start, start + n)`` touches (cache lock held)."""
        if n == 0:
            return 0
        size = self.cache.page_tokens
        return sum(1 for i in range(start // size, (start + n - 1) // size + 1) if self.pages[i].refcount > 1)

    def writable(self, index: int) -> Page:
        """Page ``index``, copied first if anyone else holds it (cache lock held)."""
        page = self.pages[index]
        if page.refcount > 1:
            private = self.cache.new_page()
            private.values[:] = page.values
            private.tokens[:] = page.tokens
            self.cache.release(page)
            self.pages[index] = private
        return self.pages[index]

    def _prepare(self, start: int, stop: int, need: int) -> None:
        """Under the cache lock: room for ``need`` pages, then every page of [start, stop) private."""
        cache = self.cache
        cache.make_room(need)
        size = cache.page_tokens
        while len(self.pages) < pages_needed(stop, size):
            self.pages.append(cache.new_page())
        for index in range(start // size, (stop - 1) // size + 1):
            self.writable(index)

    def _write_bytes(self, start: int, tokens: np.ndarray, values: np.ndarray) -> None:
        """The context's lock alone: every page written was made private by ``_prepare``."""
        size = self.cache.page_tokens
        for i, position in enumerate(range(start, start + len(tokens))):
            page = self.pages[position // size]
            page.values[position % size] = values[i]
            page.tokens[position % size] = tokens[i]

    def extend(self, tokens, kv) -> None:
        tokens, values = self._validate(tokens, kv)
        with self.lock:
            self._open()
            n = len(tokens)
            if n == 0:
                return
            start = self.length
            with self.cache.lock:
                self._prepare(start, start + n, self.extend_need(n))
                self.length = start + n
            self._write_bytes(start, tokens, values)

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, values = self._validate(tokens, kv)
        with self.lock:
            self._open()
            start = _index(start, "start")
            n = len(tokens)
            if not (0 <= start and start + n <= self.length):
                raise PositionError(f"overwrite of [{start}, {start + n}) outside length {self.length}")
            if n == 0:
                return
            with self.cache.lock:
                self._prepare(start, start + n, self.overwrite_need(start, n))
            self._write_bytes(start, tokens, values)

    # -- page lists: context lock, then cache lock --------------------------------------

    def fork(self) -> "LockContext":
        with self.lock:
            self._open()
            with self.cache.lock:
                return self.cache.adopt(list(self.pages), self.length)

    def truncate(self, n: int) -> None:
        with self.lock:
            self._open()
            n = _index(n, "n")
            if not 0 <= n <= self.length:
                raise PositionError(f"truncate to {n} outside length {self.length}")
            with self.cache.lock:
                keep = pages_needed(n, self.cache.page_tokens)
                for page in self.pages[keep:]:
                    self.cache.release(page)
                del self.pages[keep:]
                self.length = n

    def close(self) -> None:
        with self.lock:
            self._open()
            with self.cache.lock:
                for page in self.pages:
                    self.cache.release(page)
                self.pages = []
                self.closed = True
                del self.cache.contexts[self.serial]


class LockCache:
    context_class = LockContext

    def __init__(self, config: Config):
        self.config = config
        self.layout = config.layout
        self.page_tokens = config.page_tokens
        self.precision = precisions.check_precision(config.precision)
        self.limit = config.pool_limit
        self.lock = threading.RLock()      # pool and tree; taken after a context's lock, never before
        self.live: dict[int, Page] = {}
        self.allocated = 0
        self.freed = 0
        self.contexts: dict[int, LockContext] = {}
        self.entries: list[Entry] = []
        self.clock = 0
        self.serials = itertools.count()

    # -- pages (cache lock held) ------------------------------------------------------

    def new_page(self) -> Page:
        self.allocated += 1
        page = Page(self.allocated, self.layout, self.page_tokens)
        self.live[page.page_id] = page
        return page

    def release(self, page: Page) -> None:
        page.refcount -= 1
        if page.refcount == 0:
            del self.live[page.page_id]
            self.freed += 1

    def adopt(self, pages: list[Page], length: int) -> LockContext:
        for page in pages:
            page.refcount += 1
        ctx = self.context_class(self, pages, length, next(self.serials))
        self.contexts[ctx.serial] = ctx
        return ctx

    def make_room(self, need: int) -> None:
        """``on_full="evict"``: evict least recently used entries keeping a page no context lists,
        oldest first, until live + need fits the pool or none is left; the rest falls back.
        ``on_full="refuse"``: ``CapacityError`` before anything changed (entries' pages count)."""
        if not need or not self.limit:
            return      # an operation that needs no page evicts nothing, even past the pool
        if self.config.on_full == "refuse":
            if len(self.live) + need > self.limit:
                raise CapacityError(f"{len(self.live)} live pages + {need} needed > pool of {self.limit}")
            return
        if self.config.on_full != "evict":
            return
        while len(self.live) + need > self.limit:
            victim = self.eviction_candidate()
            if victim is None:
                return      # fall back to ordinary memory
            self.drop(victim)

    def eviction_candidate(self) -> Entry | None:
        listed = {id(page) for ctx in self.contexts.values() for page in ctx.pages}
        for entry in sorted(self.entries, key=lambda e: e.tick):
            if any(id(page) not in listed for page in entry.pages):
                return entry
        return None

    def drop(self, entry: Entry) -> None:
        self.entries.remove(entry)
        for page in entry.pages:
            self.release(page)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    # -- the protocol ------------------------------------------------------------------

    def allocate(self) -> LockContext:
        with self.lock:
            return self.adopt([], 0)

    def retain(self, ctx: LockContext) -> None:
        if not isinstance(ctx, LockContext) or ctx.cache is not self:
            raise ForeignContextError("this context belongs to another cache")
        with ctx.lock:
            ctx._open()
            if ctx.length == 0:
                raise EmptyContextError("cannot retain an empty context")
            key = tuple(int(t) for t in ctx._gather(0, ctx.length)[1])
            with self.lock:
                for old in [e for e in self.entries if e.key == key]:
                    self.drop(old)
                for page in ctx.pages:
                    page.refcount += 1
                entry = Entry(key, list(ctx.pages), self.tick(), next(self.serials))
                self.entries.append(entry)
                self.enforce_bounds(entry)

    def enforce_bounds(self, newest: Entry) -> None:
        def over() -> bool:
            pages = sum(pages_needed(len(e.key), self.page_tokens) for e in self.entries)
            return len(self.entries) > self.config.max_entries or bool(self.config.max_pages and pages > self.config.max_pages)
        while over() and len(self.entries) > 1:
            self.drop(min((e for e in self.entries if e is not newest), key=lambda e: e.tick))

    def match(self, tokens):
        query = tuple(int(t) for t in check_tokens(tokens, private=False))
        with self.lock:
            best, winner = 0, None
            for entry in self.entries:
                common = _common(entry.key, query)
                if common and (common > best or (common == best and entry.tick > winner.tick)):
                    best, winner = common, entry
            if winner is None:
                return self.adopt([], 0), 0
            self.stamp(winner)
            return self.adopt(winner.pages[:pages_needed(best, self.page_tokens)], best), best

    def stamp(self, entry: Entry) -> None:
        entry.tick = self.tick()

    def clear(self) -> None:
        with self.lock:
            for entry in list(self.entries):
                self.drop(entry)

    def observe(self) -> Observation:
        with self.lock:
            holders, lengths = {}, {}
            for serial, ctx in self.contexts.items():
                holders[f"ctx:{serial}"] = tuple(p.page_id for p in ctx.pages)
                lengths[f"ctx:{serial}"] = ctx.length
            for entry in self.entries:
                holders[f"entry:{entry.serial}"] = tuple(p.page_id for p in entry.pages)
                lengths[f"entry:{entry.serial}"] = len(entry.key)
            pages = {pid: PageView(pid, page.refcount, None) for pid, page in self.live.items()}
            return Observation(pages=pages, holders=holders, lengths=lengths,
                               pages_allocated=self.allocated, pages_freed=self.freed,
                               arena_size=None, arena_out={}, arena_free=(), tree=None, entries=None)


def _common(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)


def make_configs() -> list[Config]:
    base = dict(layout=LAYOUT, page_tokens=4, max_entries=4, match="token", on_full="evict")
    return [Config(precision="f32", pool_pages=12, **base),
            Config(precision="f16", pool_pages=10, **base),
            Config(precision="q8", pool_pages=12, max_pages=5, **base),
            Config(**{**base, "on_full": "refuse"}, precision="f32", pool_pages=10)]


def factory(config: Config) -> LockCache:
    return LockCache(config)


factory.configs = make_configs()
factory.thread_safe = True
