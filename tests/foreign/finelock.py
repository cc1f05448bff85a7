"""A fine-grained-locking KV cache (audit s67/audit3), written against ``kvstate.spec`` only.
``finelock_plants.py`` plants seven concurrency bugs in it, one per factory; ``finelock_trylock.py``
refuses a busy context instead of waiting for it.

Locks (ORDER: context lock -> tree lock -> pool lock; never two context locks at once):
  ctx.lock   (one per context)  serialises every operation on that context, readers included
  tree.lock  (one)              the entries, their keys and the clock: match, retain, evict, clear
  pool.lock  (one)              page allocation, refcounts, the live-page books, the context registry,
                                and every publication of a context's (pages, length) pair
A context's state is an immutable pair (tuple of pages, length) replaced in one assignment under the
pool lock, so ``len()`` reads it with no lock and ``observe()`` (tree then pool lock) sees refcounts,
page lists and lengths consistent. Page bytes are written under the context lock alone, only into
pages with refcount 1 that only this context lists (sharing such a page needs this context's lock).
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

from kvstate.spec import Config, EntryView, Layout, Observation, PageView
from kvstate.spec import precision as precisions
from kvstate.spec.errors import ContextClosedError, EmptyContextError, PositionError
from kvstate.spec.layout import check_tokens, check_values, require_finite
from kvstate.spec.positions import as_position


def _pos(value, what):
    p = as_position(value)
    if p is None:
        raise PositionError(f"{what} must be an int, got {type(value).__name__}")
    return p


class Page:
    __slots__ = ("page_id", "refcount", "values", "tokens")

    def __init__(self, page_id, layout, page_tokens):
        self.page_id = page_id
        self.refcount = 1
        self.values = np.zeros((page_tokens, *layout.position_shape), np.float32)
        self.tokens = np.zeros(page_tokens, np.int64)


class Pool:
    """Pages, refcounts and the registry of live contexts; every change under ``self.lock``."""

    def __init__(self, layout, page_tokens):
        self.lock = threading.Lock()
        self.layout = layout
        self.page_tokens = page_tokens
        self.live = {}
        self.allocated = 0
        self.freed = 0
        self.contexts = {}          # serial -> context
        self.serials = itertools.count(1)

    # all of these: caller holds self.lock
    def new_page(self):
        self.allocated += 1
        page = Page(self.allocated, self.layout, self.page_tokens)
        self.live[page.page_id] = page
        return page

    def incref(self, pages):
        for page in pages:
            page.refcount += 1

    def release(self, pages):
        for page in pages:
            page.refcount -= 1
            if page.refcount == 0:
                del self.live[page.page_id]
                self.freed += 1


class Context:
    def __init__(self, cache, pages, length):
        self.cache = cache
        self.lock = threading.Lock()
        self.state = (tuple(pages), length)      # replaced whole, under the pool lock
        self.closed = False
        self.serial = None

    def __len__(self):
        return self.state[1]

    def _open(self):
        if self.closed:
            raise ContextClosedError("this context is closed")

    def _gather(self, start, stop):
        pages, _ = self.state
        layout = self.cache.layout
        if not pages:
            return np.zeros((0, *layout.position_shape), np.float32), np.zeros(0, np.int64)
        values = np.concatenate([p.values for p in pages])[start:stop].copy()
        tokens = np.concatenate([p.tokens for p in pages])[start:stop].copy()
        return values, tokens

    @property
    def tokens(self):
        with self.lock:
            self._open()
            return [int(t) for t in self._gather(0, self.state[1])[1]]

    def read(self, start=0, stop=None):
        with self.lock:
            self._open()
            length = self.state[1]
            start = _pos(start, "start")
            stop = length if stop is None else _pos(stop, "stop")
            if not 0 <= start <= stop <= length:
                raise PositionError(f"read of [{start}, {stop}) outside length {length}")
            return self._gather(start, stop)

    def _encode(self, tokens, kv):
        tokens = check_tokens(tokens)
        kv = check_values(self.cache.layout, kv, len(tokens))
        require_finite(kv)
        return tokens, precisions.roundtrip(self.cache.precision, kv)

    def _write(self, start, tokens, values, grow):
        """Under ``self.lock``: make pages [start, start+n) private (and grow), publish, then write bytes."""
        n = len(tokens)
        if n == 0:
            return
        pt = self.cache.page_tokens
        pool = self.cache.pool
        with pool.lock:
            pages, length = self.state
            pages = list(pages)
            first, last = start // pt, (start + n - 1) // pt
            for index in range(first, min(last + 1, len(pages))):
                page = pages[index]
                if page.refcount > 1:          # writable: copy a shared page
                    private = pool.new_page()
                    private.values[:] = page.values
                    private.tokens[:] = page.tokens
                    pool.release([page])
                    pages[index] = private
            while len(pages) <= last:
                pages.append(pool.new_page())
            self.state = (tuple(pages), start + n if grow else length)
        for i in range(n):
            index, offset = divmod(start + i, pt)
            pages[index].values[offset] = values[i]
            pages[index].tokens[offset] = tokens[i]

    def extend(self, tokens, kv):
        tokens, values = self._encode(tokens, kv)
        with self.lock:
            self._open()
            self._write(self.state[1], tokens, values, grow=True)

    def overwrite(self, start, tokens, kv):
        tokens, values = self._encode(tokens, kv)
        start = _pos(start, "start")
        with self.lock:
            self._open()
            length = self.state[1]
            if not (0 <= start and start + len(tokens) <= length):
                raise PositionError(f"overwrite of [{start}, {start + len(tokens)}) outside length {length}")
            self._write(start, tokens, values, grow=False)

    def fork(self):
        with self.lock:
            self._open()
            pages, length = self.state
            return self.cache._adopt(pages, length)

    def truncate(self, n):
        n = _pos(n, "n")
        with self.lock:
            self._open()
            pages, length = self.state
            if not 0 <= n <= length:
                raise PositionError(f"truncate to {n} outside length {length}")
            keep = -(-n // self.cache.page_tokens)
            pool = self.cache.pool
            with pool.lock:
                pool.release(pages[keep:])
                self.state = (pages[:keep], n)

    def close(self):
        with self.lock:
            self._open()
            pool = self.cache.pool
            with pool.lock:
                pool.release(self.state[0])
                self.state = ((), 0)
                self.closed = True
                pool.contexts.pop(self.serial, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self.closed:
            self.close()


class Entry:
    __slots__ = ("key", "pages", "length", "tick")

    def __init__(self, key, pages, length, tick):
        self.key, self.pages, self.length, self.tick = key, pages, length, tick


class FineLockCache:
    context_class = Context

    def __init__(self, config: Config):
        self.layout = config.layout
        self.page_tokens = config.page_tokens
        self.precision = config.precision
        self.max_entries = config.max_entries
        self.pool = Pool(config.layout, config.page_tokens)
        self.tree_lock = threading.Lock()
        self.entries = {}      # key -> Entry
        self.clock = 0

    def _adopt(self, pages, length):
        """A new registered context holding ``pages`` (caller may hold ctx/tree locks, not the pool lock)."""
        ctx = self.context_class(self, pages, length)
        with self.pool.lock:
            self.pool.incref(pages)
            ctx.serial = next(self.pool.serials)
            self.pool.contexts[ctx.serial] = ctx
        return ctx

    def allocate(self):
        return self._adopt((), 0)

    def retain(self, ctx):
        with ctx.lock:
            ctx._open()
            pages, length = ctx.state
            if length == 0:
                raise EmptyContextError("cannot retain an empty context")
            key = tuple(int(t) for t in ctx._gather(0, length)[1])
            with self.tree_lock:
                self.clock += 1
                entry = Entry(key, pages, length, self.clock)
                with self.pool.lock:
                    self.pool.incref(pages)
                    old = self.entries.pop(key, None)
                    if old is not None:
                        self.pool.release(old.pages)
                    self.entries[key] = entry
                    while len(self.entries) > self.max_entries:
                        victim = min((e for e in self.entries.values() if e is not entry), key=lambda e: e.tick)
                        del self.entries[victim.key]
                        self.pool.release(victim.pages)

    def match(self, tokens):
        query = tuple(int(t) for t in check_tokens(tokens))
        with self.tree_lock:
            best = self._longest(query)
            if best is None:
                return self._adopt((), 0), 0
            self.clock += 1
            best.tick = self.clock
            return self._adopt(best.pages, best.length), len(best.key)

    def _longest(self, query):
        """The entry whose key is the longest prefixing ``query``, or None (under the tree lock)."""
        best = None
        for key, entry in self.entries.items():
            if len(key) <= len(query) and query[:len(key)] == key and (best is None or len(key) > len(best.key)):
                best = entry
        return best

    def clear(self):
        with self.tree_lock:
            with self.pool.lock:
                for entry in list(self.entries.values()):
                    self.pool.release(entry.pages)
                self.entries.clear()

    def observe(self):
        with self.tree_lock:
            with self.pool.lock:
                return self._observe_locked()

    def _observe_locked(self):
        """The observation, under both the tree and the pool lock."""
        holders, lengths = {}, {}
        for serial, ctx in self.pool.contexts.items():
            pages, length = ctx.state
            holders[f"ctx:{serial}"] = tuple(p.page_id for p in pages)
            lengths[f"ctx:{serial}"] = length
        views = []
        for i, entry in enumerate(sorted(self.entries.values(), key=lambda e: e.tick)):
            holders[f"entry:{i}"] = tuple(p.page_id for p in entry.pages)
            lengths[f"entry:{i}"] = entry.length
            views.append(EntryView(entry.key, entry.tick, f"entry:{i}"))
        pages = {pid: PageView(pid, page.refcount, None) for pid, page in self.pool.live.items()}
        return Observation(pages=pages, holders=holders, lengths=lengths,
                           pages_allocated=self.pool.allocated, pages_freed=self.pool.freed,
                           arena_size=0, arena_out={}, arena_free=(), tree=None, entries=tuple(views))


def factory(config: Config) -> FineLockCache:
    return FineLockCache(config)


factory.configs = [Config(Layout(layers=2, kv_heads=2, head_dim=4), page_tokens=4, precision=p,
                          arena_pages=0, max_entries=4) for p in precisions.PRECISIONS]
factory.any_page_size = True
factory.thread_safe = True
