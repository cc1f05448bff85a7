"""An engine without an arena that says so, written from README.md and ``kvstate.spec`` only.

``factory.configs`` declares the three precisions with ``arena_pages=0`` in the standard
layout, page size and entry limit, and the factory refuses an arena by name (``ConfigError``).

- Pages store the encoded form layer-major, ``(layers, 2, page_tokens, kv_heads, head_dim)``
  (``Layout.page_shape``: the order a forward pass reads), scales likewise for q8.
- Retained entries are a dict keyed by token tuple; ``match`` looks up the query's prefixes
  longest first, so it never walks a tree. ``observe()`` still reports one: the radix tree
  that spells the retained keys, built on demand.
- No snapshots.
"""

from __future__ import annotations

import numpy as np

from kvstate.spec import Config, EntryView, Layout, NodeView, Observation, PageView
from kvstate.spec import precision as precisions
from kvstate.spec.errors import ConfigError, ContextClosedError, EmptyContextError, PositionError
from kvstate.spec.layout import check_tokens, check_values, require_finite


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class Page:
    def __init__(self, page_id: int, shapes):
        self.page_id = page_id
        self.refs = 1
        self.parts = [np.zeros(shape, dtype) for shape, dtype in shapes]   # layer-major
        self.tokens = np.zeros(shapes[0][0][2], np.int64)


class Block:
    """The engine's context: a list of pages and a length."""

    def __init__(self, engine: "HeapEngine", pages: list[Page], length: int):
        self.engine = engine
        self.pages = pages
        self.length = length
        self.closed = False

    def __len__(self) -> int:
        return self.length

    def _alive(self) -> None:
        if self.closed:
            raise ContextClosedError("this context was closed")

    @property
    def tokens(self) -> list[int]:
        self._alive()
        return self.read(0, self.length)[1].tolist()

    def read(self, start: int = 0, stop: int | None = None):
        self._alive()
        stop = self.length if stop is None else stop
        if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= self.length):
            raise PositionError(f"read [{start}, {stop}) but the context has {self.length} positions")
        size = self.engine.page_tokens
        encoded, tokens = [[] for _ in self.engine.shapes], []
        for position in range(start, stop, 1):
            page, offset = self.pages[position // size], position % size
            for rows, part in zip(encoded, page.parts):
                rows.append(part[:, :, offset])          # (layers, 2, ...) of one position
            tokens.append(page.tokens[offset])
        parts = tuple(np.stack(rows) if rows else np.zeros((0, *shape[:2], *shape[3:]), dtype)
                      for rows, (shape, dtype) in zip(encoded, self.engine.shapes))
        return precisions.decode(self.engine.precision, parts), np.array(tokens, np.int64)

    def _accept(self, tokens, kv, start=None):
        # README's order when several inputs are bad: tokens, array shape, the context, positions, values.
        tokens = check_tokens(tokens)
        kv = check_values(self.engine.layout, kv, len(tokens))
        self._alive()
        if start is not None:
            if not (_is_int(start) and 0 <= start <= self.length - len(tokens)):
                raise PositionError(f"overwrite [{start}, {start + len(tokens)}) but the context has "
                                    f"{self.length} positions")
        kv = np.asarray(kv)
        require_finite(kv)
        return tokens, self.engine.encode(kv)

    def extend(self, tokens, kv) -> None:
        tokens, parts = self._accept(tokens, kv)
        self._store(self.length, tokens, parts)
        self.length += len(tokens)

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, parts = self._accept(tokens, kv, start)
        self._store(start, tokens, parts)

    def _store(self, start: int, tokens: np.ndarray, parts) -> None:
        size = self.engine.page_tokens
        for i, token in enumerate(tokens):
            index, offset = divmod(start + i, size)
            if index == len(self.pages):
                self.pages.append(self.engine.new_page())
            page = self.writable(index)
            for dst, src in zip(page.parts, parts):
                dst[:, :, offset] = src[i]
            page.tokens[offset] = token

    def writable(self, index: int) -> Page:
        page = self.pages[index]
        if page.refs > 1:
            copy = self.engine.new_page()
            for dst, src in zip(copy.parts, page.parts):
                dst[...] = src
            copy.tokens[:] = page.tokens
            self.engine.unref([page])
            self.pages[index] = copy
        return self.pages[index]

    def fork(self) -> "Block":
        self._alive()
        return self.engine.new_block(self.engine.ref(self.pages), self.length)

    def truncate(self, n: int) -> None:
        self._alive()
        if not (_is_int(n) and 0 <= n <= self.length):
            raise PositionError(f"truncate to {n} but the context has {self.length} positions")
        keep = (n + self.engine.page_tokens - 1) // self.engine.page_tokens
        self.engine.unref(self.pages[keep:])
        self.pages = self.pages[:keep]
        self.length = n

    def close(self) -> None:
        self._alive()
        self.release_pages()
        self.closed = True
        del self.engine.blocks[id(self)]

    def release_pages(self) -> None:
        self.engine.unref(self.pages)
        self.pages = []


class HeapEngine:
    block_class = Block

    def __init__(self, config: Config):
        if config.arena_pages:
            raise ConfigError(f"this engine has no arena; arena_pages={config.arena_pages} is not supported")
        self.layout = config.layout
        self.page_tokens = config.page_tokens
        self.precision = precisions.check_precision(config.precision)
        self.max_entries = config.max_entries
        page_shape = self.layout.page_shape(self.page_tokens)
        self.shapes = [(page_shape, precisions.VALUE_DTYPES[self.precision])]
        if self.precision == "q8":
            self.shapes.append((page_shape[:-1], np.float32))
        self.live: dict[int, Page] = {}
        self.allocated = 0
        self.freed = 0
        self.blocks: dict[int, Block] = {}
        self.retained: dict[tuple[int, ...], list] = {}     # key -> [pages, tick]
        self.clock = 0

    def encode(self, kv: np.ndarray) -> tuple[np.ndarray, ...]:
        return precisions.encode(self.precision, kv)

    def new_page(self) -> Page:
        self.allocated += 1
        page = Page(self.allocated, self.shapes)
        self.live[page.page_id] = page
        return page

    def ref(self, pages: list[Page]) -> list[Page]:
        for page in pages:
            page.refs += 1
        return list(pages)

    def unref(self, pages: list[Page]) -> None:
        for page in pages:
            page.refs -= 1
            if page.refs == 0:
                del self.live[page.page_id]
                self.freed += 1

    def new_block(self, pages: list[Page], length: int) -> Block:
        block = self.block_class(self, pages, length)
        self.blocks[id(block)] = block
        return block

    def allocate(self) -> Block:
        return self.new_block([], 0)

    def retain(self, ctx: Block) -> None:
        ctx._alive()
        if ctx.length == 0:
            raise EmptyContextError("nothing to retain: the context is empty")
        key = tuple(ctx.tokens)
        if key in self.retained:
            self.evict(key)
        self.clock += 1
        self.retained[key] = [self.ref(ctx.pages), self.clock]
        while len(self.retained) > self.max_entries:
            self.evict(self.eviction_victim(newest=key))

    def eviction_victim(self, newest: tuple[int, ...]) -> tuple[int, ...]:
        """The least recently used key, never the one just retained."""
        return min((k for k in self.retained if k != newest), key=lambda k: self.retained[k][1])

    def evict(self, key: tuple[int, ...]) -> None:
        pages, _ = self.retained.pop(key)
        self.unref(pages)

    def lookup(self, query: tuple[int, ...]) -> tuple[int, ...] | None:
        for cut in range(len(query), 0, -1):
            if query[:cut] in self.retained:
                return query[:cut]
        return None

    def matched_count(self, key: tuple[int, ...], query: tuple[int, ...]) -> int:
        return len(key)

    def match(self, tokens):
        query = tuple(int(t) for t in check_tokens(tokens))
        key = self.lookup(query)
        if key is None:
            return self.allocate(), 0
        self.clock += 1
        self.retained[key][1] = self.clock
        return self.new_block(self.ref(self.retained[key][0]), len(key)), self.matched_count(key, query)

    def clear(self) -> None:
        for key in list(self.retained):
            self.evict(key)

    def observe(self) -> Observation:
        holders, lengths = {}, {}
        for i, block in enumerate(self.blocks.values()):
            holders[f"ctx:{i}"] = tuple(p.page_id for p in block.pages)
            lengths[f"ctx:{i}"] = block.length
        ordered = sorted(self.retained.items(), key=lambda item: item[1][1])
        entries = []
        for i, (key, (pages, tick)) in enumerate(ordered):
            holders[f"entry:{i}"] = tuple(p.page_id for p in pages)
            lengths[f"entry:{i}"] = len(key)
            entries.append(EntryView(key, tick, f"entry:{i}"))
        pages = {pid: PageView(pid, page.refs, None) for pid, page in self.live.items()}
        return Observation(pages=pages, holders=holders, lengths=lengths,
                           pages_allocated=self.allocated, pages_freed=self.freed,
                           arena_size=0, arena_out={}, arena_free=(), tree=radix_view(self.retained),
                           entries=tuple(entries))


def radix_view(keys) -> NodeView:
    """The radix tree spelling ``keys``: a token trie with entry-less single-child chains collapsed."""
    trie: dict = {}
    for key in keys:
        node = trie
        for token in key:
            node = node.setdefault(token, {})
        node[None] = key

    def collapse(edge: tuple[int, ...], node: dict) -> NodeView:
        while None not in node and len(node) == 1:
            ((token, node),) = node.items()
            edge += (token,)
        return NodeView(edge, node.get(None), children_of(node))

    def children_of(node: dict) -> tuple[NodeView, ...]:
        return tuple(collapse((token,), node[token]) for token in sorted(t for t in node if t is not None))

    return NodeView((), None, children_of(trie))


LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)   # the standard layout of the conformance machine


def factory(config: Config) -> HeapEngine:
    return HeapEngine(config)


# No arena: declare the three precisions without one, at the standard page size and entry limit.
factory.configs = [Config(LAYOUT, page_tokens=4, precision=p, arena_pages=0, max_entries=2)
                   for p in precisions.PRECISIONS]
factory.any_page_size = True      # written for any page size: checked at sizes drawn 1-8 per run
