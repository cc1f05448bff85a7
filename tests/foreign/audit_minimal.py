"""An audit's engine, written from README.md and ``kvstate.spec`` alone: a block-hash prefix cache
over a fixed page pool, observed as a black box.

The combination no other foreign backend covers: ``match="block"`` by chained hashes of full
blocks (vLLM's design; a block may span several pages, or be smaller than one, so a hit can end
inside a page it then shares with the entry), entries holding a reference on their pages, the lowest observation tier
(``observe()`` is ``black_box()``), and a fixed pool that either evicts least recently used
entries and then falls back to ordinary memory (``on_full="evict"``) or refuses
(``on_full="refuse"``), one configuration with a ``max_pages`` budget.

- A page is a fixed-size array of rows holding what a read returns (values already rounded by
  ``spec.precision.roundtrip``), its token ids, and two counts: references from contexts and
  references from entries (refcount = their sum). ``fork`` shares pages; a write into a page with
  refcount > 1 copies it first.
- ``retain`` shares every page of the context with a new entry (a partly filled last page too),
  and publishes the chained hashes of the key's full blocks in an index (hash -> entries).
- ``match`` walks the query's chained hashes and stops at the first one no entry has: the hit is
  that many whole blocks, taken from the most recently used entry having the last one (block
  ties), which alone is stamped. The hit shares that entry's pages.
- The pool counts live pages (pages with refcount > 0). An operation counts its need before it
  changes anything (``extend``: new pages plus a copy of a shared, partly filled last page;
  ``overwrite``: a copy of each shared page it touches). ``evict``: entries keeping a page no
  context lists are evicted, least recently used first, until live + need fits, then pages come
  from ordinary memory anyway. ``refuse``: ``CapacityError``, nothing changed.

Planted bugs: ``tests/foreign/audit_bugs.py`` (one subclass each).

    kvstate conform tests/foreign/audit_minimal.py
"""

from __future__ import annotations

import numpy as np

from kvstate.spec import Config, Layout
from kvstate.spec import precision as precisions
from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.errors import (CapacityError, ConfigError, ContextClosedError, EmptyContextError,
                                 ForeignContextError, PositionError)
from kvstate.spec.layout import check_tokens, check_values, require_finite
from kvstate.spec.observation import black_box


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


class Page:
    __slots__ = ("values", "tokens", "ctx_refs", "entry_refs")

    def __init__(self, layout: Layout, page_tokens: int):
        self.values = np.zeros((page_tokens, *layout.position_shape), np.float32)
        self.tokens = np.zeros(page_tokens, np.int64)
        self.ctx_refs = 0
        self.entry_refs = 0

    @property
    def refcount(self) -> int:
        return self.ctx_refs + self.entry_refs


class Entry:
    __slots__ = ("key", "pages", "stamp", "hashes")

    def __init__(self, key, pages, stamp, hashes):
        self.key, self.pages, self.stamp, self.hashes = key, pages, stamp, hashes


class AuditContext:
    def __init__(self, cache: "AuditCache", pages: list[Page], length: int):
        self.cache = cache
        self.pages = pages
        self.length = length
        self.closed = False
        for page in pages:
            cache.ref(page, ctx=True)

    def __len__(self) -> int:
        return self.length

    def _open(self) -> None:
        if self.closed:
            raise ContextClosedError("this context is closed")

    @property
    def tokens(self) -> list[int]:
        self._open()
        return [int(t) for t in self._gather(0, self.length)[1]]

    def _gather(self, start: int, stop: int):
        P = self.cache.page_tokens
        values = np.zeros((stop - start, *self.cache.layout.position_shape), np.float32)
        tokens = np.zeros(stop - start, np.int64)
        for i, pos in enumerate(range(start, stop)):
            page, off = divmod(pos, P)
            values[i] = self.pages[page].values[off]
            tokens[i] = self.pages[page].tokens[off]
        return values, tokens

    def read(self, start: int = 0, stop: int | None = None):
        self._open()
        stop = self.length if stop is None else stop
        if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= self.length):
            raise PositionError(f"read of [{start}, {stop}) outside length {self.length}")
        return self._gather(int(start), int(stop))

    def _prepare(self, tokens, kv, start=None):
        tokens = check_tokens(tokens)
        kv = check_values(self.cache.layout, kv, len(tokens))
        self._open()
        if start is not None and not (_is_int(start) and 0 <= start and start + len(tokens) <= self.length):
            raise PositionError(f"overwrite of [{start}, {start}+{len(tokens)}) outside length {self.length}")
        kv = np.asarray(kv, np.float32)
        require_finite(kv)
        return tokens, precisions.roundtrip(self.cache.precision, kv)

    # -- needs, counted before anything changes ---------------------------------------------

    def extend_need(self, n: int) -> int:
        if n == 0:
            return 0
        P = self.cache.page_tokens
        need = pages_needed(self.length + n, P) - len(self.pages)
        if self.length % P and self.pages[-1].refcount > 1:
            need += 1
        return need

    def overwrite_need(self, start: int, n: int) -> int:
        if n == 0:
            return 0
        P = self.cache.page_tokens
        first, last = start // P, (start + n - 1) // P
        return sum(1 for i in range(first, last + 1) if self.pages[i].refcount > 1)

    def writable(self, index: int) -> Page:
        page = self.pages[index]
        if page.refcount > 1:
            copy = self.cache.new_page()
            copy.values[:] = page.values
            copy.tokens[:] = page.tokens
            self.cache.ref(copy, ctx=True)
            self.cache.unref(page, ctx=True)
            self.pages[index] = copy
        return self.pages[index]

    def _store(self, start: int, tokens: np.ndarray, values: np.ndarray) -> None:
        P = self.cache.page_tokens
        for i, pos in enumerate(range(start, start + len(tokens))):
            index, off = divmod(pos, P)
            while index >= len(self.pages):
                page = self.cache.new_page()
                self.cache.ref(page, ctx=True)
                self.pages.append(page)
            page = self.writable(index)
            page.values[off] = values[i]
            page.tokens[off] = tokens[i]

    def extend(self, tokens, kv) -> None:
        tokens, values = self._prepare(tokens, kv)
        if not len(tokens):
            return
        self.cache.make_room(self.extend_need(len(tokens)))
        self._store(self.length, tokens, values)
        self.length += len(tokens)

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, values = self._prepare(tokens, kv, start)
        if not len(tokens):
            return
        start = int(start)
        self.cache.make_room(self.overwrite_need(start, len(tokens)))
        self._store(start, tokens, values)

    def fork(self) -> "AuditContext":
        self._open()
        return self.cache.new_context(list(self.pages), self.length)

    def truncate(self, n: int) -> None:
        self._open()
        if not (_is_int(n) and 0 <= n <= self.length):
            raise PositionError(f"truncate to {n} outside length {self.length}")
        keep = pages_needed(int(n), self.cache.page_tokens)
        for page in self.pages[keep:]:
            self.cache.unref(page, ctx=True)
        del self.pages[keep:]
        self.length = int(n)

    def close(self) -> None:
        self._open()
        for page in self.pages:
            self.cache.unref(page, ctx=True)
        self.pages = []
        self.length = 0
        self.closed = True


class AuditCache:
    context_class = AuditContext

    def __init__(self, config: Config):
        if config.match != "block":
            raise ConfigError(f"block matching only, not {config.name}")
        if config.on_full not in ("fallback", "evict", "refuse") or config.arena_pages:
            raise ConfigError(f"no arena; on_full fallback, evict or refuse only, not {config.name}")
        self.config = config
        self.layout = config.layout
        self.page_tokens = config.page_tokens
        self.block = config.block_tokens
        self.precision = config.precision
        self.pool = config.pool_pages
        self.live = 0
        self.entries: list[Entry] = []
        self.index: dict[int, list[Entry]] = {}
        self.clock = 0

    # -- pages -----------------------------------------------------------------------------

    def new_page(self) -> Page:
        return Page(self.layout, self.page_tokens)

    def ref(self, page: Page, ctx: bool) -> None:
        if page.refcount == 0:
            self.live += 1
        if ctx:
            page.ctx_refs += 1
        else:
            page.entry_refs += 1

    def unref(self, page: Page, ctx: bool) -> None:
        if ctx:
            page.ctx_refs -= 1
        else:
            page.entry_refs -= 1
        if page.refcount == 0:
            self.live -= 1

    def new_context(self, pages, length) -> AuditContext:
        return self.context_class(self, pages, length)

    def make_room(self, need: int) -> None:
        if not need or not self.pool or self.live + need <= self.pool:
            return
        if self.config.on_full == "refuse":
            raise CapacityError(f"{need} pages needed, {self.pool - self.live} free of {self.pool}")
        if self.config.on_full == "evict":
            for entry in sorted(self.entries, key=lambda e: e.stamp):
                if self.live + need <= self.pool:
                    break
                if any(p.ctx_refs == 0 for p in entry.pages):
                    self.drop(entry)
        # then ordinary memory

    # -- hashing -----------------------------------------------------------------------------

    def chain(self, tokens, limit: int | None = None) -> list[int]:
        B = self.block
        hashes, parent = [], 0
        full = len(tokens) // B
        for i in range(full if limit is None else min(full, limit)):
            parent = hash((parent, tuple(int(t) for t in tokens[i * B:(i + 1) * B])))
            hashes.append(parent)
        return hashes

    # -- the protocol ------------------------------------------------------------------------

    def allocate(self) -> AuditContext:
        return self.new_context([], 0)

    def retain(self, ctx) -> None:
        if not isinstance(ctx, AuditContext) or ctx.cache is not self:
            raise ForeignContextError("not a context of this cache")
        ctx._open()
        if ctx.length == 0:
            raise EmptyContextError("cannot retain an empty context")
        key = tuple(ctx.tokens)
        for old in [e for e in self.entries if e.key == key]:
            self.drop(old)
        self.clock += 1
        entry = Entry(key, list(ctx.pages), self.clock, self.chain(key))
        for page in entry.pages:
            self.ref(page, ctx=False)
        self.entries.append(entry)
        for h in entry.hashes:
            self.index.setdefault(h, []).append(entry)
        self.bound(entry)

    def entry_cost(self, entry: Entry) -> int:
        return pages_needed(len(entry.key), self.page_tokens)

    def over_bounds(self) -> bool:
        if len(self.entries) > self.config.max_entries:
            return True
        return bool(self.config.max_pages) and sum(self.entry_cost(e) for e in self.entries) > self.config.max_pages

    def bound(self, newest: Entry) -> None:
        while len(self.entries) > 1 and self.over_bounds():
            self.drop(min((e for e in self.entries if e is not newest), key=lambda e: e.stamp))

    def drop(self, entry: Entry) -> None:
        self.entries.remove(entry)
        for h in entry.hashes:
            holders = self.index[h]
            holders.remove(entry)
            if not holders:
                del self.index[h]
        for page in entry.pages:
            self.unref(page, ctx=False)

    def lookup(self, query) -> tuple[Entry | None, int]:
        """The entry giving the hit and the number of whole blocks hit."""
        blocks, parent, best = 0, 0, None
        B = self.block
        for i in range(len(query) // B):
            parent = hash((parent, tuple(int(t) for t in query[i * B:(i + 1) * B])))
            holders = [e for e in self.index.get(parent, ()) if e.key[:(i + 1) * B] == tuple(query[:(i + 1) * B])]
            if not holders:
                break
            blocks, best = i + 1, holders
        if not blocks:
            return None, 0
        return max(best, key=lambda e: e.stamp), blocks

    def match(self, tokens):
        query = tuple(int(t) for t in check_tokens(tokens))
        entry, blocks = self.lookup(query)
        if entry is None:
            return self.allocate(), 0
        self.clock += 1
        entry.stamp = self.clock
        n = blocks * self.block
        return self.new_context(list(entry.pages[:pages_needed(n, self.page_tokens)]), n), n

    def clear(self) -> None:
        for entry in list(self.entries):
            self.drop(entry)

    def observe(self):
        return black_box()


def factory(config: Config) -> AuditCache:
    return AuditCache(config)


LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)
factory.configs = [
    Config(LAYOUT, page_tokens=4, precision="f32", max_entries=3, match="block", block_tokens=4,
           pool_pages=10, on_full="evict"),
    Config(LAYOUT, page_tokens=2, precision="q8", max_entries=4, match="block", block_tokens=4,
           pool_pages=12, on_full="refuse", max_pages=6),
    Config(LAYOUT, page_tokens=3, precision="f16", max_entries=3, match="block", block_tokens=3,
           pool_pages=8, on_full="evict", max_pages=5),
    # blocks smaller than a page: a hit may end inside a page it then shares with the entry
    Config(LAYOUT, page_tokens=4, precision="f32", max_entries=3, match="block", block_tokens=2,
           pool_pages=9, on_full="refuse"),
]


# -- the same engine behind one lock, claiming thread safety (``races``) ------------------------------

import functools  # noqa: E402
import threading  # noqa: E402


def _locked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with (self.cache if isinstance(self, AuditContext) else self).lock:
            return method(self, *args, **kwargs)
    return wrapper


class LockedContext(AuditContext):
    pass


class LockedCache(AuditCache):
    context_class = LockedContext

    def __init__(self, config: Config):
        self.lock = threading.RLock()
        super().__init__(config)


for _cls, _names in ((LockedContext, ("__len__", "read", "extend", "overwrite", "fork", "truncate", "close")),
                     (LockedCache, ("allocate", "retain", "match", "clear", "observe"))):
    for _name in _names:
        setattr(_cls, _name, _locked(getattr(_cls, _name)))
LockedContext.tokens = property(_locked(AuditContext.tokens.fget))


def locked(config: Config) -> LockedCache:
    return LockedCache(config)


locked.configs = factory.configs
locked.thread_safe = True
