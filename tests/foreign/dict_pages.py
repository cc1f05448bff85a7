"""A dict-of-pages engine, written from README.md and ``kvstate.spec`` only.

- Pages live in a dict by id and store the cache's encoded form (``spec.precision.encode``):
  float32, float16, or int8 codes plus float32 scales, position-major.
- ``fork`` shares pages (refcount + 1); ``writable`` copies a shared page before a write.
- An arena of ``config.arena_pages`` preallocated slots; a page that finds none free lives in
  ordinary memory. A slot is zeroed when it is issued, and ``observe()`` reports a page's
  ``dirty_tail`` by looking at its bytes past the high-water mark.
- Retained entries sit in a small radix tree (edges split on insert, collapsed on removal),
  evicted least recently used first by a logical clock.
- ``ctx.snapshot(path_or_stream)`` / ``cache.restore(path_or_stream)`` in the format of
  ``spec/snapshot_format.py``.

Every step is a small method so ``bugs.py`` can break one promise per subclass.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from kvstate.spec import Config, EntryView, NodeView, Observation, PageView
from kvstate.spec import precision as precisions
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.errors import (ContextClosedError, EmptyContextError, ForeignContextError, PositionError,
                                 SnapshotCorruptError, SnapshotLayoutError, SnapshotNotFoundError,
                                 SnapshotTruncatedError, SnapshotWriteError)
from kvstate.spec.layout import check_tokens, check_values, require_finite


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _pages_for(n: int, page_tokens: int) -> int:
    return -(-n // page_tokens)


# -- pages and the arena ---------------------------------------------------------------------

class Page:
    __slots__ = ("page_id", "refcount", "slot", "parts", "tokens", "filled")

    def __init__(self, page_id: int, slot: int | None, parts: tuple[np.ndarray, ...], tokens: np.ndarray):
        self.page_id = page_id
        self.refcount = 1
        self.slot = slot
        self.parts = parts        # encoded rows, (page_tokens, ...) each
        self.tokens = tokens
        self.filled = 0           # high-water mark: rows at and past it were never written


class Arena:
    """Preallocated page slots; ``take`` returns None when every slot is out."""

    def __init__(self, size: int, part_shapes, page_tokens: int):
        self.size = size
        self.blocks = [np.zeros((size, *shape), dtype) for shape, dtype in part_shapes]
        self.token_block = np.zeros((size, page_tokens), np.int64)
        self.free: list[int] = list(range(size - 1, -1, -1))   # a stack: the slot freed last is reused first
        self.out: dict[int, int] = {}

    def take(self, page_id: int) -> int | None:
        if not self.free:
            return None
        slot = self.free.pop()
        self.out[slot] = page_id
        self.scrub(slot)
        return slot

    def scrub(self, slot: int) -> None:
        """A recycled slot must read zero wherever its new page has not written."""
        for block in self.blocks:
            block[slot] = 0
        self.token_block[slot] = 0

    def give_back(self, slot: int) -> None:
        del self.out[slot]
        self.free.append(slot)


# -- the radix tree of retained entries ------------------------------------------------------

class Entry:
    __slots__ = ("key", "pages", "tick", "node")

    def __init__(self, key: tuple[int, ...], pages: list[Page], tick: int):
        self.key = key
        self.pages = pages
        self.tick = tick
        self.node: Node | None = None


class Node:
    __slots__ = ("edge", "entry", "children", "parent")

    def __init__(self, edge: tuple[int, ...], parent: "Node | None"):
        self.edge = edge
        self.entry: Entry | None = None
        self.children: dict[int, Node] = {}
        self.parent = parent


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RadixTree:
    def __init__(self):
        self.root = Node((), None)

    def insert(self, entry: Entry) -> None:
        key, node, depth = entry.key, self.root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                child = Node(key[depth:], node)
                node.children[key[depth]] = child
                node, depth = child, len(key)
                break
            shared = _common(child.edge, key[depth:])
            if shared < len(child.edge):
                child = self._split(child, shared)
            node, depth = child, depth + shared
        node.entry = entry
        entry.node = node

    def _split(self, child: Node, at: int) -> Node:
        """Cut ``child``'s edge after ``at`` tokens; the new middle node has no entry."""
        parent = child.parent
        middle = Node(child.edge[:at], parent)
        parent.children[middle.edge[0]] = middle
        child.edge = child.edge[at:]
        child.parent = middle
        middle.children[child.edge[0]] = child
        return middle

    def longest(self, query: tuple[int, ...]) -> Entry | None:
        """The entry with the longest key that is a prefix of ``query``."""
        node, depth, best = self.root, 0, None
        while True:
            if node.entry is not None:
                best = node.entry
            if depth >= len(query):
                return best
            child = node.children.get(query[depth])
            if child is None or query[depth:depth + len(child.edge)] != child.edge:
                return best
            node, depth = child, depth + len(child.edge)

    def remove(self, entry: Entry) -> None:
        node = entry.node
        node.entry = None
        while node is not self.root and node.entry is None:
            if not node.children:                  # prune, then look at the parent
                del node.parent.children[node.edge[0]]
                node = node.parent
                continue
            if len(node.children) == 1:            # collapse into the only child
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                child.parent = node.parent
                node.parent.children[child.edge[0]] = child
            break

    def view(self) -> NodeView:
        return _view(self.root)


def _view(node: Node) -> NodeView:
    children = tuple(_view(node.children[first]) for first in sorted(node.children))
    return NodeView(node.edge, node.entry.key if node.entry is not None else None, children)


# -- contexts ----------------------------------------------------------------------------------

class DictContext:
    def __init__(self, cache: "DictCache", context_id: int, pages: list[Page], length: int):
        self.cache = cache
        self.context_id = context_id
        self.pages = pages
        self.length = length
        self.closed = False

    def __len__(self) -> int:
        return self.length

    def _require_open(self) -> None:
        if self.closed:
            raise ContextClosedError(f"context {self.context_id} is closed")

    @property
    def tokens(self) -> list[int]:
        self._require_open()
        return [int(t) for t in self._gather_tokens(0, self.length)]

    # -- reads

    def read(self, start: int = 0, stop: int | None = None):
        self._require_open()
        stop = self.length if stop is None else stop
        if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= self.length):
            raise PositionError(f"read of [{start}, {stop}) is outside context {self.context_id} "
                                f"of length {self.length}")
        values = precisions.decode(self.cache.precision, self._gather_parts(start, stop))
        return values, self._gather_tokens(start, stop)

    def _spans(self, start: int, stop: int):
        """(page, lo, hi) for each page rows ``[start, stop)`` touch, offsets inside the page."""
        size = self.cache.page_tokens
        for index in range(start // size, _pages_for(stop, size)):
            base = index * size
            yield self.pages[index], max(start, base) - base, min(stop, base + size) - base

    def _gather_parts(self, start: int, stop: int) -> tuple[np.ndarray, ...]:
        pieces = [[part[lo:hi] for part in page.parts] for page, lo, hi in self._spans(start, stop)]
        if not pieces:
            return tuple(np.zeros((0, *shape), dtype) for shape, dtype in self.cache.part_shapes)
        return tuple(np.concatenate(rows) for rows in zip(*pieces))

    def _gather_tokens(self, start: int, stop: int) -> np.ndarray:
        pieces = [page.tokens[lo:hi] for page, lo, hi in self._spans(start, stop)]
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)

    # -- writes

    def _validated(self, tokens, kv, start=None):
        # README's order when several inputs are bad: tokens, array shape, the context, positions, values.
        tokens = check_tokens(tokens)
        kv = check_values(self.cache.layout, kv, len(tokens))
        self._require_open()
        if start is not None:
            if not (_is_int(start) and 0 <= start and start + len(tokens) <= self.length):
                raise PositionError(f"overwrite of [{start}, {start + len(tokens)}) is outside context "
                                    f"{self.context_id} of length {self.length}")
        kv = np.asarray(kv)
        require_finite(kv)
        return tokens, self.cache.encode(kv)

    def extend(self, tokens, kv) -> None:
        tokens, parts = self._validated(tokens, kv)
        self._write(self.length, tokens, parts)
        self.length += len(tokens)

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, parts = self._validated(tokens, kv, start)
        self._write(start, tokens, parts)

    def _write(self, start: int, tokens: np.ndarray, parts: tuple[np.ndarray, ...]) -> None:
        """Rows ``[start, start + n)``: new pages past the end, shared pages copied first."""
        n = len(tokens)
        if n == 0:
            return      # nothing to write: no page is allocated or copied
        size = self.cache.page_tokens
        for index in range(start // size, _pages_for(start + n, size)):
            while index >= len(self.pages):
                self.pages.append(self.cache.new_page())
            page = self.writable(index)
            base = index * size
            lo, hi = max(start, base), min(start + n, base + size)
            for dst, src in zip(page.parts, parts):
                dst[lo - base:hi - base] = src[lo - start:hi - start]
            page.tokens[lo - base:hi - base] = tokens[lo - start:hi - start]
            page.filled = max(page.filled, hi - base)

    def writable(self, index: int) -> Page:
        """Page ``index``, copied first if another holder lists it."""
        page = self.pages[index]
        if page.refcount > 1:
            private = self.cache.new_page()
            for dst, src in zip(private.parts, page.parts):
                dst[:] = src
            private.tokens[:] = page.tokens
            private.filled = page.filled
            self.cache.release(page)
            self.pages[index] = private
        return self.pages[index]

    # -- lifecycle

    def fork(self) -> "DictContext":
        self._require_open()
        return self.cache.adopt(list(self.pages), self.length)

    def truncate(self, n: int) -> None:
        self._require_open()
        if not (_is_int(n) and 0 <= n <= self.length):
            raise PositionError(f"truncate to {n} is outside context {self.context_id} of length {self.length}")
        keep = _pages_for(n, self.cache.page_tokens)
        for page in self.pages[keep:]:
            self.cache.release(page)
        del self.pages[keep:]
        self.length = n

    def close(self) -> None:
        self._require_open()
        for page in self.pages:
            self.cache.release(page)
        self.pages = []
        self.closed = True
        del self.cache.contexts[self.context_id]

    def snapshot(self, target) -> None:
        """Write this context to a path (atomically) or to an open binary stream."""
        self._require_open()
        self.cache.write_snapshot(self, target)


# -- the cache ---------------------------------------------------------------------------------

class DictCache:
    context_class = DictContext
    arena_class = Arena

    def __init__(self, config: Config):
        self.config = config
        self.layout = config.layout
        self.page_tokens = config.page_tokens
        self.precision = precisions.check_precision(config.precision)
        self.max_entries = config.max_entries
        self.part_shapes = self._part_shapes()
        self.pages: dict[int, Page] = {}
        self.allocated = 0
        self.freed = 0
        self.contexts: dict[int, DictContext] = {}
        self.next_context = 0
        row_shapes = [((self.page_tokens, *shape), dtype) for shape, dtype in self.part_shapes]
        self.arena = self.arena_class(self.arena_size(config), row_shapes, self.page_tokens)
        self.tree = RadixTree()
        self.entries: dict[tuple[int, ...], Entry] = {}
        self.clock = 0

    def _part_shapes(self):
        """(shape of one position, dtype) of each encoded part."""
        position = self.layout.position_shape
        shapes = [(position, precisions.VALUE_DTYPES[self.precision])]
        if self.precision == "q8":
            shapes.append((position[:-1], np.float32))
        return shapes

    def arena_size(self, config: Config) -> int:
        return config.arena_pages

    def encode(self, kv: np.ndarray) -> tuple[np.ndarray, ...]:
        return precisions.encode(self.precision, kv)

    # -- pages

    def new_page(self) -> Page:
        self.allocated += 1
        page_id = self.allocated
        slot = self.arena.take(page_id)
        if slot is None:
            parts = tuple(np.zeros((self.page_tokens, *shape), dtype) for shape, dtype in self.part_shapes)
            page = Page(page_id, None, parts, np.zeros(self.page_tokens, np.int64))
        else:
            page = Page(page_id, slot, tuple(block[slot] for block in self.arena.blocks), self.arena.token_block[slot])
        self.pages[page_id] = page
        return page

    def release(self, page: Page) -> None:
        page.refcount -= 1
        if page.refcount == 0:
            del self.pages[page.page_id]
            self.freed += 1
            if page.slot is not None:
                self.arena.give_back(page.slot)

    def adopt(self, pages: list[Page], length: int) -> DictContext:
        for page in pages:
            page.refcount += 1
        self.next_context += 1
        ctx = self.context_class(self, self.next_context, pages, length)
        self.contexts[ctx.context_id] = ctx
        return ctx

    # -- the protocol

    def allocate(self) -> DictContext:
        return self.adopt([], 0)

    def _own(self, ctx) -> DictContext:
        if not isinstance(ctx, DictContext) or ctx.cache is not self:
            raise ForeignContextError("the context belongs to another cache")
        ctx._require_open()
        return ctx

    def retain(self, ctx) -> None:
        """Keep a fork of ``ctx`` under its tokens; an entry with the same key is replaced."""
        ctx = self._own(ctx)
        if ctx.length == 0:
            raise EmptyContextError("cannot retain an empty context")
        key = tuple(ctx.tokens)
        if key in self.entries:
            self._drop(self.entries[key])
        entry = Entry(key, list(ctx.pages), self._tick())
        for page in entry.pages:
            page.refcount += 1
        self.entries[key] = entry
        self.tree.insert(entry)
        while len(self.entries) > self.max_entries:
            self.evict(self._victim(spare=entry))

    def _victim(self, spare: Entry) -> Entry:
        """The least recently used entry other than ``spare`` (the one just retained)."""
        return min((e for e in self.entries.values() if e is not spare), key=lambda e: e.tick)

    def evict(self, entry: Entry) -> None:
        """Eviction goes through the same release path as everything else."""
        self._drop(entry)

    def _drop(self, entry: Entry) -> None:
        self.tree.remove(entry)
        del self.entries[entry.key]
        for page in entry.pages:
            self.release(page)

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def match(self, tokens):
        """A fork of the entry whose key is the longest prefix of ``tokens``, and that key's length."""
        query = tuple(int(t) for t in check_tokens(tokens))
        entry = self.tree.longest(query)
        if entry is None:
            return self.allocate(), 0
        entry.tick = self._tick()
        return self.adopt(list(entry.pages), len(entry.key)), len(entry.key)

    def clear(self) -> None:
        for entry in list(self.entries.values()):
            self._drop(entry)

    def read_page(self, page_id: int) -> tuple[np.ndarray, ...]:
        """The optional raw-page read (README: observation tiers): every row as stored, written or not."""
        return tuple(part.copy() for part in self.pages[page_id].parts)

    def observe(self) -> Observation:
        holders, lengths = {}, {}
        for cid, ctx in self.contexts.items():
            holders[f"ctx:{cid}"] = tuple(p.page_id for p in ctx.pages)
            lengths[f"ctx:{cid}"] = ctx.length
        views = []
        for i, entry in enumerate(sorted(self.entries.values(), key=lambda e: e.tick)):
            holders[f"entry:{i}"] = tuple(p.page_id for p in entry.pages)
            lengths[f"entry:{i}"] = len(entry.key)
            views.append(EntryView(entry.key, entry.tick, f"entry:{i}"))
        pages = {pid: PageView(pid, page.refcount, page.slot, dirty_tail=self.dirty_tail(page))
                 for pid, page in self.pages.items()}
        return Observation(pages=pages, holders=holders, lengths=lengths,
                           pages_allocated=self.allocated, pages_freed=self.freed,
                           arena_size=self.arena.size, arena_out=dict(self.arena.out),
                           arena_free=tuple(self.arena.free), tree=self.tree.view(), entries=tuple(views))

    def dirty_tail(self, page: Page) -> bool:
        """Whether anything past the page's high-water mark reads non-zero (a full page has no tail:
        at one-token pages that is every page, thousands of them in ``scale``, observed every step)."""
        if page.filled >= len(page.tokens):
            return False
        return bool(any(part[page.filled:].any() for part in page.parts) or page.tokens[page.filled:].any())

    # -- snapshots

    def snapshot_sections(self, ctx: DictContext) -> list[np.ndarray]:
        """The body's sections in file order: tokens, values, (scales)."""
        tokens = ctx._gather_tokens(0, ctx.length)
        return [tokens, *ctx._gather_parts(0, ctx.length)]

    def snapshot_bytes(self, ctx: DictContext) -> bytes:
        dtypes = [dtype for _, dtype, _ in fmt.body_sections(self.layout, self.precision, ctx.length)]
        body = b"".join(np.ascontiguousarray(section, dtype=dtype).tobytes()
                        for section, dtype in zip(self.snapshot_sections(ctx), dtypes))
        return fmt.pack_header(self.precision, self.layout, ctx.length, fmt.crc32(body)) + body

    def write_snapshot(self, ctx: DictContext, target) -> None:
        data = self.snapshot_bytes(ctx)
        try:
            if hasattr(target, "write"):
                target.write(data)
                if hasattr(target, "flush"):
                    target.flush()
                return
            self._write_atomic(os.fspath(target), data)
        except OSError as error:
            raise SnapshotWriteError(f"writing a snapshot to {target!r} failed: {error}") from error

    @staticmethod
    def _write_atomic(path: str, data: bytes) -> None:
        """A temporary file in the target's folder, synced, renamed over it, then the folder synced."""
        folder = os.path.dirname(os.path.abspath(path))
        fd, temp = tempfile.mkstemp(prefix=fmt.TEMP_PREFIX + os.path.basename(path) + ".",
                                    suffix=fmt.TEMP_SUFFIX, dir=folder)
        try:
            with open(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, path)
        except BaseException:
            if os.path.exists(temp):
                os.unlink(temp)
            raise
        folder_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(folder_fd)
        finally:
            os.close(folder_fd)

    def restore(self, source) -> DictContext:
        """A new context from a snapshot, validated in full before any page is allocated."""
        if hasattr(source, "read"):
            data = source.read()
        else:
            try:
                with open(os.fspath(source), "rb") as file:
                    data = file.read()
            except FileNotFoundError as error:
                raise SnapshotNotFoundError(f"no snapshot at {os.fspath(source)!r}") from error
        header = fmt.parse_header(data)     # reads the header's first bytes: 48, or 64 (version 3)
        if header.layout != self.layout:
            raise SnapshotLayoutError(f"snapshot layout {header.layout} differs from the cache's {self.layout}")
        total = header.size + header.body_bytes
        if len(data) < total:
            raise SnapshotTruncatedError(f"snapshot holds {len(data)} bytes; its header declares {total}")
        if len(data) > total:
            raise SnapshotCorruptError(f"{len(data) - total} unexpected bytes after the body, from offset {total}")
        arrays = fmt.check_body(header, memoryview(data)[header.size:])
        parts = (arrays["values"], arrays["scales"]) if header.precision == "q8" else (arrays["values"],)
        if header.precision != self.precision:
            parts = self.encode(precisions.decode(header.precision, parts))
        ctx = self.allocate()
        ctx._write(0, arrays["tokens"].astype(np.int64), parts)
        ctx.length = header.positions
        return ctx


def factory(config: Config) -> DictCache:
    return DictCache(config)
