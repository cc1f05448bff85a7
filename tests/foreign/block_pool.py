"""A block-hash prefix cache over a fixed page pool, as vLLM's v1 prefix cache is designed, written
from README.md and ``kvstate.spec`` only.

- A page is a block (``block_tokens == page_tokens``). Pages are rows of one preallocated table
  (``PageTable``: K/V in the cache's encoded form, token ids, refcounts, keepers), indexed by page
  id. The table starts at ``INITIAL_PAGES`` rows and doubles when a page is needed and no row is
  free, up to the pool's limit (``pool_pages``; 0: no limit).
- A context is a list of page ids, a length, and the chained hashes of its full blocks (vLLM's
  ``request.block_hashes``): block i's hash covers its tokens and block i-1's hash, so equal
  hashes mean equal prefixes. A block's hash joins the chain once its K/V are written, and leaves
  it when ``overwrite`` or ``truncate`` touches the block.
- ``retain`` keeps every page of the context for a new entry (README: the tree keeps a fork) and
  publishes the entry's chain in the hash index (hash -> entries whose key holds that block).
  A page is *cached* once no context lists it but an entry keeps it: refcount 0, listed
  ``cached=True`` in the pages tier, reclaimable.
- ``match`` walks the query's chained hashes through the index and stops at the first miss: the
  longest run of cached full blocks. Of the entries reaching that block, the most recently used
  gives the hit (``spec/semantics.py``, block ties); only it is stamped. A hit shares the entry's pages (refcount + 1), copies nothing.
- Writes copy a page that another holder lists or an entry keeps (``writable``): a cached block is
  never written in place (vLLM's ``is_block_writable``).
- ``on_full="evict-then-refuse"``: an operation counts the pages it needs before it changes
  anything. If the pages contexts hold plus that need pass the pool, ``CapacityError``, nothing
  changed. Otherwise free rows are used first, then entries are evicted, least recently used
  first, each one that keeps a cached page (a page no context holds), until the need fits.
  A cached page a hit takes again is the same live page: neither allocated nor freed.

Where this departs from vLLM, because README's promises say otherwise (each is observable):
an entry keeps its partly filled last page too (vLLM caches full blocks only; README's retain
keeps a fork, and the pool counts that page and the copy a later write makes of it); eviction
takes whole entries (vLLM reclaims single blocks, tail blocks first, leaving a shorter prefix
matchable); entries are bounded by ``max_entries`` (vLLM has only the pool); among entries
reaching the deepest block, the most recently used gives the hit (vLLM has no entries: a hash
maps to whichever block it cached first). Hashes are Python's 64-bit tuple hash (vLLM: sha256 or
xxhash): a collision would be a wrong hit, a risk vLLM takes too. Rows are not zeroed when
reused (no read reaches an unwritten row; no ``read_page``); no snapshots.

``factory`` observes as a black box; ``pages_factory`` exposes the pages tier (pages with
refcounts and ``cached``, context holders and lengths, pages allocated and freed); ``tree_factory``
the pages tier and the entries (keys in eviction order, each with no holder).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from kvstate.spec import Config, Layout, Observation, PageView
from kvstate.spec import precision as precisions
from kvstate.spec.arithmetic import pages_needed, pages_touched
from kvstate.spec.errors import (CapacityError, ConfigError, ContextClosedError, EmptyContextError,
                                 ForeignContextError, PositionError)
from kvstate.spec.layout import check_tokens, check_values, require_finite
from kvstate.spec.observation import EntryView, black_box

INITIAL_PAGES = 64      # rows the page table starts with; it doubles past them (the growth path)
ROOT_HASH = 0           # the parent hash of a context's first block


def block_hash(parent: int, block: tuple[int, ...]) -> int:
    """The chained hash of one full block: its tokens and its parent's hash."""
    return hash((parent, block))


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class PageTable:
    """Every page the pool has made, by page id: encoded K/V rows, token ids, and the books.

    ``refcount[p]`` counts the contexts listing page p; ``keepers[p]`` the entries keeping it.
    A page is live from ``take`` to ``give_back``; free ids are reused last-freed first."""

    def __init__(self, part_shapes, page_tokens: int, limit: int):
        self.limit = limit
        capacity = min(INITIAL_PAGES, limit) if limit else INITIAL_PAGES
        self.parts = [np.zeros((capacity, page_tokens, *shape), dtype) for shape, dtype in part_shapes]
        self.tokens = np.zeros((capacity, page_tokens), np.int64)
        self.refcount = np.zeros(capacity, np.int32)
        self.keepers = np.zeros(capacity, np.int32)
        self.free = list(range(capacity - 1, -1, -1))
        self.allocated = 0
        self.freed = 0

    @property
    def capacity(self) -> int:
        return len(self.refcount)

    def take(self) -> int:
        if not self.free:
            self.grow()
        self.allocated += 1
        return self.free.pop()

    def give_back(self, page: int) -> None:
        self.freed += 1
        self.free.append(page)

    def grow(self) -> None:
        """Double the rows (up to the pool's limit); every page keeps its id, contents and books."""
        old = self.capacity
        new = min(2 * old, self.limit) if self.limit else 2 * old
        if new == old:
            raise CapacityError(f"all {old} pages of the pool are live")   # make_room rules this out
        self.parts = [_grown(part, new) for part in self.parts]
        self.tokens = _grown(self.tokens, new)
        self.refcount = _grown(self.refcount, new)
        self.keepers = _grown(self.keepers, new)
        self.free[:0] = range(new - 1, old - 1, -1)      # the new rows are used after the freed ones

    def live(self) -> list[int]:
        free = set(self.free)
        return [page for page in range(self.capacity) if page not in free]


def _grown(array: np.ndarray, rows: int) -> np.ndarray:
    bigger = np.zeros((rows, *array.shape[1:]), array.dtype)
    bigger[:len(array)] = array
    return bigger


class Entry:
    __slots__ = ("key", "pages", "hashes", "tick")

    def __init__(self, key: tuple[int, ...], pages: list[int], hashes: list[int], tick: int):
        self.key = key
        self.pages = pages        # every page of the retained context, the partly filled last one too
        self.hashes = hashes      # chained hashes of its full blocks
        self.tick = tick


class BlockContext:
    def __init__(self, cache: "BlockPoolCache", pages: list[int], length: int, hashes: list[int]):
        self.cache = cache
        self.pages = pages
        self.length = length
        self.hashes = hashes
        self.closed = False

    def __len__(self) -> int:
        return self.length

    def _require_open(self) -> None:
        if self.closed:
            raise ContextClosedError("this context is closed")

    @property
    def tokens(self) -> list[int]:
        self._require_open()
        return self._tokens(0, self.length).tolist()

    def _rows(self, array: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Positions ``[start, stop)`` of ``array`` (a table part), gathered by page id: a copy."""
        size = self.cache.page_tokens
        first, end = pages_touched(start, stop, size)
        rows = array[self.pages[first:end]]
        return rows.reshape(-1, *array.shape[2:])[start - first * size:stop - first * size]

    def _tokens(self, start: int, stop: int) -> np.ndarray:
        return self._rows(self.cache.table.tokens, start, stop)

    def read(self, start: int = 0, stop: int | None = None):
        self._require_open()
        stop = self.length if stop is None else stop
        if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= self.length):
            raise PositionError(f"read of [{start}, {stop}) outside length {self.length}")
        if start == stop:
            return (precisions.decode(self.cache.precision, self.cache.empty_parts()), np.zeros(0, np.int64))
        parts = tuple(self._rows(part, start, stop) for part in self.cache.table.parts)
        return precisions.decode(self.cache.precision, parts), self._tokens(start, stop)

    # -- writes: validate, count the pages needed, make room, then write

    def _validated(self, tokens, kv, start: int | None = None):
        tokens = check_tokens(tokens)
        kv = check_values(self.cache.layout, kv, len(tokens))
        self._require_open()
        if start is not None and not (_is_int(start) and 0 <= start and start + len(tokens) <= self.length):
            raise PositionError(f"overwrite of [{start}, {start + len(tokens)}) outside length {self.length}")
        kv = np.asarray(kv)
        require_finite(kv)
        return tokens, self.cache.encode(kv)

    def extend(self, tokens, kv) -> None:
        tokens, parts = self._validated(tokens, kv)
        if not len(tokens):
            return
        size = self.cache.page_tokens
        copy = self.length % size != 0 and self.cache.shared(self.pages[-1])   # the partly filled last page
        self.cache.make_room(copy + pages_needed(self.length + len(tokens), size) - len(self.pages))
        self._write(self.length, tokens, parts)

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, parts = self._validated(tokens, kv, start)
        if not len(tokens):
            return
        first, end = pages_touched(start, start + len(tokens), self.cache.page_tokens)
        self.cache.make_room(sum(self.cache.shared(page) for page in self.pages[first:end]))
        del self.hashes[first:]          # the blocks it rewrites are hashed again once written
        self._write(start, tokens, parts)

    def _write(self, start: int, tokens: np.ndarray, parts: tuple[np.ndarray, ...]) -> None:
        """Positions ``[start, start + n)``: new pages past the end, shared or cached pages copied
        first; then every block that is now full and not in the chain is hashed."""
        size, table, n = self.cache.page_tokens, self.cache.table, len(tokens)
        first, end = pages_touched(start, start + n, size)
        for index in range(first, end):
            if index == len(self.pages):
                self.pages.append(self.cache.new_page())
            page = self.writable(index)
            lo, hi = max(start, index * size), min(start + n, (index + 1) * size)
            for dst, src in zip(table.parts, parts):
                dst[page, lo - index * size:hi - index * size] = src[lo - start:hi - start]
            table.tokens[page, lo - index * size:hi - index * size] = tokens[lo - start:hi - start]
        self.length = max(self.length, start + n)
        self.extend_chain()

    def extend_chain(self) -> None:
        """Hash every full block past the chain's end (its K/V are written by now)."""
        size, table = self.cache.page_tokens, self.cache.table
        parent = self.hashes[-1] if self.hashes else ROOT_HASH
        for index in range(len(self.hashes), self.length // size):
            parent = block_hash(parent, tuple(table.tokens[self.pages[index]].tolist()))
            self.hashes.append(parent)

    def writable(self, index: int) -> int:
        """Page ``index``, first copied into a new page if any other holder lists it or an entry keeps it."""
        page = self.pages[index]
        if self.cache.shared(page):
            private = self.cache.new_page()
            table = self.cache.table
            for part in table.parts:
                part[private] = part[page]
            table.tokens[private] = table.tokens[page]
            self.cache.release([page])
            self.pages[index] = private
        return self.pages[index]

    # -- lifecycle

    def fork(self) -> "BlockContext":
        self._require_open()
        return self.cache.adopt(list(self.pages), self.length, list(self.hashes))

    def truncate(self, n: int) -> None:
        self._require_open()
        if not (_is_int(n) and 0 <= n <= self.length):
            raise PositionError(f"truncate to {n} outside length {self.length}")
        keep = pages_needed(n, self.cache.page_tokens)
        self.cache.release(self.pages[keep:])
        del self.pages[keep:]
        del self.hashes[n // self.cache.page_tokens:]
        self.length = n

    def close(self) -> None:
        self._require_open()
        self.cache.release(self.pages)
        self.pages = []
        self.closed = True
        self.cache.contexts.remove(self)


class BlockPoolCache:
    context_class = BlockContext
    table_class = PageTable

    def __init__(self, config: Config):
        if config.match != "block" or config.block_tokens != config.page_tokens:
            raise ConfigError(f"a block is a page here: match='block' with block_tokens == page_tokens, not {config.name} "
                              f"at page_tokens {config.page_tokens}")
        if config.arena_pages or config.max_pages or config.on_full not in ("fallback", "evict-then-refuse"):
            raise ConfigError(f"this pool reclaims cached pages, then refuses (no arena, no max_pages), not {config.name}")
        if (config.on_full == "fallback") != (config.pool_limit == 0):
            raise ConfigError(f"a pool of pool_pages pages evicts then refuses; without one, the table grows: {config.name}")
        self.layout = config.layout
        self.page_tokens = config.page_tokens
        self.precision = precisions.check_precision(config.precision)
        self.max_entries = config.max_entries
        position = self.layout.position_shape
        self.part_shapes = [(position, precisions.VALUE_DTYPES[self.precision])]
        if self.precision == "q8":
            self.part_shapes.append((position[:-1], np.float32))
        self.table = self.table_class(self.part_shapes, self.page_tokens, config.pool_limit)
        self.held = 0                                    # pages some context lists (refcount > 0)
        self.contexts: list[BlockContext] = []
        self.entries: dict[tuple[int, ...], Entry] = {}  # least recently used first
        self.index: dict[int, dict[tuple[int, ...], Entry]] = {}   # block hash -> entries holding that block
        self.clock = 0

    def encode(self, kv: np.ndarray) -> tuple[np.ndarray, ...]:
        return precisions.encode(self.precision, kv)

    def empty_parts(self) -> tuple[np.ndarray, ...]:
        return tuple(np.zeros((0, *shape), dtype) for shape, dtype in self.part_shapes)

    # -- pages

    def shared(self, page: int) -> bool:
        return int(self.table.refcount[page]) + int(self.table.keepers[page]) > 1

    def new_page(self) -> int:
        page = self.table.take()
        self.hold([page])
        return page

    def hold(self, pages: list[int]) -> None:
        refcount = self.table.refcount
        refcount[pages] += 1
        self.held += int(np.count_nonzero(refcount[pages] == 1))

    def release(self, pages: list[int]) -> None:
        """Contexts stop listing ``pages``: a page nobody lists is cached if an entry keeps it, else free."""
        table = self.table
        for page in pages:
            table.refcount[page] -= 1
            if table.refcount[page] == 0:
                self.held -= 1
                if table.keepers[page] == 0:
                    table.give_back(page)

    def adopt(self, pages: list[int], length: int, hashes: list[int]) -> BlockContext:
        self.hold(pages)
        ctx = self.context_class(self, pages, length, hashes)
        self.contexts.append(ctx)
        return ctx

    def make_room(self, needed: int) -> None:
        """``on_full="evict-then-refuse"`` for an operation needing ``needed`` new pages, before it changes anything."""
        limit = self.table.limit
        if not needed or not limit or self.live_pages() + needed <= limit:
            return
        if self.held + needed > limit:
            raise CapacityError(f"{self.held} pages held by contexts + {needed} needed > pool of {limit}")
        while self.live_pages() + needed > limit:
            self.evict(self.victim())

    def victim(self) -> Entry:
        """The least recently used entry keeping a cached page (one no context holds)."""
        return next(entry for entry in self.entries.values() if np.any(self.table.refcount[entry.pages] == 0))

    def live_pages(self) -> int:
        return self.table.allocated - self.table.freed

    # -- entries

    def allocate(self) -> BlockContext:
        return self.adopt([], 0, [])

    def retain(self, ctx) -> None:
        """Keep every page of ``ctx`` for an entry under its tokens, and publish its full blocks' hashes."""
        if not isinstance(ctx, BlockContext) or ctx.cache is not self:
            raise ForeignContextError("the context belongs to another cache")
        ctx._require_open()
        if not ctx.length:
            raise EmptyContextError("cannot retain an empty context")
        key = tuple(ctx.tokens)
        if key in self.entries:
            self.evict(self.entries[key])
        entry = Entry(key, list(ctx.pages), list(ctx.hashes), self.tick())
        self.table.keepers[entry.pages] += 1
        self.entries[key] = entry
        for h in entry.hashes:
            self.index.setdefault(h, {})[key] = entry
        while len(self.entries) > self.max_entries:
            self.evict(next(iter(self.entries.values())))     # the oldest; the newest is last

    def evict(self, entry: Entry) -> None:
        del self.entries[entry.key]
        for h in entry.hashes:
            holders = self.index[h]
            del holders[entry.key]
            if not holders:
                del self.index[h]
        table = self.table
        for page in entry.pages:
            table.keepers[page] -= 1
            if table.keepers[page] == 0 and table.refcount[page] == 0:
                table.give_back(page)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def stamp(self, entry: Entry) -> None:
        """A hit makes its entry the most recently used."""
        entry.tick = self.tick()
        self.entries[entry.key] = self.entries.pop(entry.key)

    def match(self, tokens):
        query = tuple(check_tokens(tokens, private=False).tolist())
        size, parent, found, hashes = self.page_tokens, ROOT_HASH, {}, []
        for index in range(len(query) // size):
            h = block_hash(parent, query[index * size:(index + 1) * size])
            if h not in self.index:
                break
            parent, found = h, self.index[h]
            hashes.append(h)
        if not hashes:
            return self.allocate(), 0
        blocks = len(hashes)
        best = max(found.values(), key=lambda entry: entry.tick)
        self.stamp(best)
        return self.adopt(best.pages[:blocks], blocks * size, hashes), blocks * size

    def clear(self) -> None:
        for entry in list(self.entries.values()):
            self.evict(entry)

    def observe(self) -> Observation:
        return black_box()


@functools.lru_cache(maxsize=1 << 16)
def _page_view(page: int, refcount: int, cached: bool) -> PageView:
    """Speed only: a view is frozen, so one made before serves again (the scale check observes
    thousands of pages after every operation, and making each view anew was most of its time)."""
    return PageView(page, refcount, None, cached=cached)


class PagesTierCache(BlockPoolCache):
    """The same cache, observed through the pages tier: live pages from the table's own books
    (a page is live from ``take`` to ``give_back``), refcount and ``cached`` per page, the pages
    and length of every context (entries keep pages but are not holders: they are vLLM's free
    queue, not its requests)."""

    def observe(self) -> Observation:
        table = self.table
        refcount, keepers = table.refcount.tolist(), table.keepers.tolist()
        pages = {page: _page_view(page, refcount[page], refcount[page] == 0 and keepers[page] > 0)
                 for page in table.live()}
        holders = {f"ctx:{i}": tuple(ctx.pages) for i, ctx in enumerate(self.contexts)}
        lengths = {f"ctx:{i}": ctx.length for i, ctx in enumerate(self.contexts)}
        return Observation(pages=pages, holders=holders, lengths=lengths, pages_allocated=table.allocated,
                           pages_freed=table.freed, arena_size=None, arena_out={}, arena_free=(), tree=None,
                           entries=None)


class TreeTierCache(PagesTierCache):
    """The pages tier and the tree tier's entries: each entry's key in eviction order, oldest first,
    with no holder (``EntryView.holder`` None), since entries here hold no reference to their pages."""

    def observe(self) -> Observation:
        obs = super().observe()
        entries = tuple(EntryView(entry.key, entry.tick, None) for entry in self.entries.values())
        return dataclasses.replace(obs, entries=entries)


def factory(config: Config) -> BlockPoolCache:
    return BlockPoolCache(config)


def pages_factory(config: Config) -> PagesTierCache:
    return PagesTierCache(config)


def tree_factory(config: Config) -> TreeTierCache:
    return TreeTierCache(config)


LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)   # the standard layout of the conformance machine
POOL_PAGES = 10                                     # small, so the suite's runs fill it often

# A block is a page of 4 tokens. Each precision twice: a table that grows without limit (entries
# bounded by max_entries 2, so retains evict often), and a pool of 10 pages that evicts cached
# pages, then refuses (max_entries 8, so the pool binds first).
CONFIGS = [Config(LAYOUT, page_tokens=4, precision=p, max_entries=2, match="block", block_tokens=4)
           for p in precisions.PRECISIONS] + \
          [Config(LAYOUT, page_tokens=4, precision=p, max_entries=8, match="block", block_tokens=4,
                  pool_pages=POOL_PAGES, on_full="evict-then-refuse") for p in precisions.PRECISIONS]
for _factory in (factory, pages_factory, tree_factory):
    _factory.configs = CONFIGS
    _factory.any_page_size = False     # its block is its page: run at the declared page size only
