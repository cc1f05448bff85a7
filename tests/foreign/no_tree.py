"""An engine without a radix tree, written from README.md and ``kvstate.spec`` only.

Retained entries are a plain list scanned for the longest key that prefixes the query, so
``observe()`` reports ``tree=None``. Contexts hold page *ids*; a page table maps each id to its
refcount, arena slot and rows. Rows hold what a read returns (values already rounded by
``spec.precision.roundtrip``), so reads are plain copies. Pages come from an arena of
``config.arena_pages`` preallocated slots while any is free, from ordinary memory after.
No snapshots: the snapshot checks report n/a.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvstate.spec import Config, EntryView, Observation, PageView
from kvstate.spec import precision as precisions
from kvstate.spec.errors import ContextClosedError, EmptyContextError, PositionError
from kvstate.spec.layout import check_tokens, check_values, require_finite


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass
class PageRecord:
    refcount: int
    slot: int | None
    values: np.ndarray            # (page_tokens, layers, 2, kv_heads, head_dim) float32, as read
    tokens: np.ndarray
    written: int = 0              # rows at and past this were never written


@dataclass
class RetainedEntry:
    key: tuple[int, ...]
    page_ids: list[int]
    tick: int


class PageTable:
    """Every live page by id, the arena's slot books, and the allocation counters."""

    def __init__(self, config: Config):
        self.page_tokens = config.page_tokens
        self.row_shape = config.layout.position_shape
        self.records: dict[int, PageRecord] = {}
        self.allocated = 0
        self.freed = 0
        self.arena_size = config.arena_pages
        self.slab = np.zeros((self.arena_size, self.page_tokens, *self.row_shape), np.float32)
        self.slab_tokens = np.zeros((self.arena_size, self.page_tokens), np.int64)
        self.free_slots = sorted(range(self.arena_size), reverse=True)   # pop() issues slot 0 first
        self.slot_owner: dict[int, int] = {}

    def new(self) -> int:
        self.allocated += 1
        page_id = self.allocated
        if self.free_slots:
            slot = self.free_slots.pop()
            self.slot_owner[slot] = page_id
            self.slab[slot] = 0            # recycled: zero before anyone reads it
            self.slab_tokens[slot] = 0
            record = PageRecord(1, slot, self.slab[slot], self.slab_tokens[slot])
        else:
            record = PageRecord(1, None, np.zeros((self.page_tokens, *self.row_shape), np.float32),
                                np.zeros(self.page_tokens, np.int64))
        self.records[page_id] = record
        return page_id

    def share(self, page_ids) -> list[int]:
        for pid in page_ids:
            self.records[pid].refcount += 1
        return list(page_ids)

    def drop(self, page_ids) -> None:
        for pid in page_ids:
            record = self.records[pid]
            record.refcount -= 1
            if record.refcount == 0:
                del self.records[pid]
                self.freed += 1
                if record.slot is not None:
                    del self.slot_owner[record.slot]
                    self.free_slots.append(record.slot)


class PlainContext:
    def __init__(self, engine: "ListEngine", page_ids: list[int], length: int):
        self.engine = engine
        self.page_ids = page_ids
        self.length = length
        self.closed = False

    def __len__(self) -> int:
        return self.length

    def _check_open(self) -> None:
        if self.closed:
            raise ContextClosedError("context already closed")

    @property
    def tokens(self) -> list[int]:
        self._check_open()
        return self._rows(0, self.length)[1].tolist()

    def _rows(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        table = self.engine.table
        records = [table.records[pid] for pid in self.page_ids]
        if not records:
            return np.zeros((0, *table.row_shape), np.float32), np.zeros(0, np.int64)
        values = np.concatenate([r.values for r in records])
        tokens = np.concatenate([r.tokens for r in records])
        return values[start:stop].copy(), tokens[start:stop].copy()

    def read(self, start: int = 0, stop: int | None = None):
        self._check_open()
        if stop is None:
            stop = self.length
        if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= self.length):
            raise PositionError(f"cannot read [{start}, {stop}) of {self.length} positions")
        return self._rows(start, stop)

    def _prepare(self, tokens, kv, start=None):
        # README's order when several inputs are bad: tokens, array shape, the context, positions, values.
        tokens = check_tokens(tokens)
        kv = check_values(self.engine.layout, kv, len(tokens))
        self._check_open()
        if start is not None:
            if not (_is_int(start) and start >= 0 and start + len(tokens) <= self.length):
                raise PositionError(f"cannot overwrite [{start}, {start + len(tokens)}) of {self.length} positions")
        kv = np.asarray(kv)
        require_finite(kv)
        return tokens, self.engine.rounded(kv)

    def extend(self, tokens, kv) -> None:
        tokens, values = self._prepare(tokens, kv)
        self._put(self.length, tokens, values)
        self.length += len(tokens)

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, values = self._prepare(tokens, kv, start)
        self._put(start, tokens, values)

    def _put(self, start: int, tokens: np.ndarray, values: np.ndarray) -> None:
        size = self.engine.table.page_tokens
        for i in range(len(tokens)):
            index, offset = divmod(start + i, size)
            if index == len(self.page_ids):
                self.page_ids.append(self.engine.table.new())
            record = self.writable(index)
            record.values[offset] = values[i]
            record.tokens[offset] = tokens[i]
            record.written = max(record.written, offset + 1)

    def writable(self, index: int) -> PageRecord:
        """The record of page ``index``, made private (copied) if it is shared."""
        table = self.engine.table
        record = table.records[self.page_ids[index]]
        if record.refcount == 1:
            return record
        copy_id = table.new()
        copy = table.records[copy_id]
        copy.values[:] = record.values
        copy.tokens[:] = record.tokens
        copy.written = record.written
        table.drop([self.page_ids[index]])
        self.page_ids[index] = copy_id
        return copy

    def fork(self) -> "PlainContext":
        self._check_open()
        return self.engine.open_context(self.engine.table.share(self.page_ids), self.length)

    def pages_to_keep(self, n: int) -> int:
        return -(-n // self.engine.table.page_tokens)

    def truncate(self, n: int) -> None:
        self._check_open()
        if not (_is_int(n) and 0 <= n <= self.length):
            raise PositionError(f"cannot truncate {self.length} positions to {n}")
        keep = self.pages_to_keep(n)
        self.engine.table.drop(self.page_ids[keep:])
        del self.page_ids[keep:]
        self.length = n

    def close(self) -> None:
        self._check_open()
        self.engine.table.drop(self.page_ids)
        self.page_ids = []
        self.closed = True
        self.engine.live.remove(self)


class ListEngine:
    context_class = PlainContext

    def __init__(self, config: Config):
        self.layout = config.layout
        self.precision = precisions.check_precision(config.precision)
        self.max_entries = config.max_entries
        self.table = PageTable(config)
        self.live: list[PlainContext] = []
        self.entries: list[RetainedEntry] = []
        self.clock = 0

    def rounded(self, kv: np.ndarray) -> np.ndarray:
        return precisions.roundtrip(self.precision, kv)

    def open_context(self, page_ids: list[int], length: int) -> PlainContext:
        ctx = self.context_class(self, page_ids, length)
        self.live.append(ctx)
        return ctx

    def allocate(self) -> PlainContext:
        return self.open_context([], 0)

    def retain(self, ctx: PlainContext) -> None:
        ctx._check_open()
        if len(ctx) == 0:
            raise EmptyContextError("an empty context cannot be retained")
        key = tuple(ctx.tokens)
        for old in [e for e in self.entries if e.key == key]:
            self._forget(old)
        self.clock += 1
        fresh = RetainedEntry(key, self.table.share(ctx.page_ids), self.clock)
        self.entries.append(fresh)
        while len(self.entries) > self.max_entries:
            self._forget(min((e for e in self.entries if e is not fresh), key=lambda e: e.tick))

    def _forget(self, entry: RetainedEntry) -> None:
        self.entries.remove(entry)
        self.table.drop(entry.page_ids)

    def best_hit(self, query: tuple[int, ...]) -> RetainedEntry | None:
        """The entry whose key is the longest prefix of ``query``."""
        hits = [e for e in self.entries if query[:len(e.key)] == e.key]
        return max(hits, key=lambda e: len(e.key)) if hits else None

    def match(self, tokens):
        query = tuple(check_tokens(tokens).tolist())
        hit = self.best_hit(query)
        if hit is None:
            return self.allocate(), 0
        self.clock += 1
        hit.tick = self.clock
        return self.open_context(self.table.share(hit.page_ids), len(hit.key)), len(hit.key)

    def clear(self) -> None:
        for entry in list(self.entries):
            self._forget(entry)

    def observe(self) -> Observation:
        holders = {f"ctx:{i}": tuple(c.page_ids) for i, c in enumerate(self.live)}
        lengths = {f"ctx:{i}": c.length for i, c in enumerate(self.live)}
        views = []
        for i, entry in enumerate(sorted(self.entries, key=lambda e: e.tick)):
            holders[f"entry:{i}"] = tuple(entry.page_ids)
            lengths[f"entry:{i}"] = len(entry.key)
            views.append(EntryView(entry.key, entry.tick, f"entry:{i}"))
        pages = {}
        for pid, record in self.table.records.items():
            # only a page not yet full has a tail that can be dirty
            dirty = record.written < len(record.tokens) and bool(
                record.values[record.written:].any() or record.tokens[record.written:].any())
            pages[pid] = PageView(pid, record.refcount, record.slot, dirty_tail=dirty)
        return Observation(pages=pages, holders=holders, lengths=lengths,
                           pages_allocated=self.table.allocated, pages_freed=self.table.freed,
                           arena_size=self.table.arena_size, arena_out=dict(self.table.slot_owner),
                           arena_free=tuple(self.table.free_slots), tree=None, entries=tuple(views))


def factory(config: Config) -> ListEngine:
    return ListEngine(config)
