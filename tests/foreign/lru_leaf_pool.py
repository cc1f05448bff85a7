"""A fixed-pool, token-matching prefix cache seen as a black box (an audit's engine, session 67).

The shape of a serving engine wrapped from outside:
- one fixed pool of ``pool_pages`` pages (a NumPy block), a free list and a refcount per page;
- contexts list page ids; ``fork`` copies the list and bumps refcounts; ``_writable`` copies a page
  only when its refcount is above one;
- the prefix cache is a per-token trie of entries, each entry holding its own fork of the pages;
  ``match`` is token-granular (longest common prefix with any key, most recently used entry of those
  reaching it gives the hit and is stamped);
- when the pool is full: ``evict-then-refuse`` (evict LRU entries keeping a page no context lists,
  refuse when contexts' pages + need pass the pool), ``refuse``, or ``reclaim`` (evict LRU leaf
  entries only, as SGLang does);
- observation: the black box (``black_box()``), nothing else.

A bug is planted by setting ``BUG`` to its name (the ``BUG ==`` tests below); "" is the correct engine.
"""

from __future__ import annotations

import threading

import numpy as np

from kvstate.spec import Config, Layout
from kvstate.spec import precision as precisions
from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.errors import (CapacityError, ConfigError, ContextClosedError, EmptyContextError,
                                 ForeignContextError, PositionError)
from kvstate.spec.layout import check_tokens, check_values, require_finite
from kvstate.spec.observation import Observation, black_box

BUG = ""


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class Node:
    __slots__ = ("children", "entry", "parent", "token")

    def __init__(self, parent, token):
        self.children: dict[int, Node] = {}
        self.entry = None
        self.parent = parent
        self.token = token


class Entry:
    __slots__ = ("key", "pages", "stamp", "node")

    def __init__(self, key, pages, stamp, node):
        self.key = key
        self.pages = pages
        self.stamp = stamp
        self.node = node


class PoolContext:
    def __init__(self, cache: "PoolCache", pages: list[int], tokens: list[int]):
        self.cache = cache
        self.pages = pages
        self.token_list = tokens
        self.closed = False

    def __len__(self) -> int:
        return len(self.token_list)

    def _open(self) -> None:
        if self.closed:
            raise ContextClosedError("this context is closed")

    @property
    def tokens(self) -> list[int]:
        with self.cache.lock:
            self._open()
            return list(self.token_list)

    def _checked(self, tokens, kv):
        tokens = check_tokens(tokens)
        kv = check_values(self.cache.layout, kv, len(tokens))
        self._open()
        return [int(t) for t in tokens], kv

    def _stored(self, kv) -> np.ndarray:
        kv = np.asarray(kv, dtype=np.float32)
        require_finite(kv)
        return precisions.roundtrip(self.cache.precision, kv)

    # -- writes ----------------------------------------------------------------------
    def extend(self, tokens, kv) -> None:
        with self.cache.lock:
            tokens, kv = self._checked(tokens, kv)
            if not tokens:
                return
            values = self._stored(kv)
            P = self.cache.page_tokens
            n = len(self.token_list)
            need = pages_needed(n + len(tokens), P) - len(self.pages)
            if n % P and self.cache.refcount[self.pages[-1]] > 1:
                need += 1
            self.cache.make_room(need)
            while len(self.pages) < pages_needed(n + len(tokens), P):
                self.pages.append(self.cache.take_page())
            self._store(n, values)
            self.token_list.extend(tokens)

    def overwrite(self, start, tokens, kv) -> None:
        with self.cache.lock:
            tokens, kv = self._checked(tokens, kv)
            if not _is_int(start) or start < 0 or start + len(tokens) > len(self.token_list):
                raise PositionError(f"overwrite of {len(tokens)} at {start!r} outside length {len(self.token_list)}")
            if not tokens:
                return
            values = self._stored(kv)
            P = self.cache.page_tokens
            touched = range(start // P, (start + len(tokens) - 1) // P + 1)
            need = sum(self.cache.refcount[self.pages[i]] > 1 for i in touched)
            if BUG == "overwrite_pin_leak":
                pinned = [self.pages[i] for i in touched]
                for page in pinned:                 # pin the touched pages while room is made
                    self.cache.refcount[page] += 1
                self.cache.make_room(need)          # planted: a refusal leaves the pins in place
                for page in pinned:
                    self.cache.refcount[page] -= 1
            else:
                self.cache.make_room(need)
            self._store(start, values)
            self.token_list[start:start + len(tokens)] = tokens

    def _store(self, start: int, values: np.ndarray) -> None:
        P = self.cache.page_tokens
        data = self.cache.data
        for i in range(len(values)):
            pos = start + i
            index = pos // P
            if BUG == "fork_write_in_place" and pos >= len(self.token_list):
                page = self.pages[index]       # planted: the extend into a shared last page skips writable
            else:
                page = self._writable(index)
            data[page, :, :, pos % P] = values[i]

    def _writable(self, index: int) -> int:
        cache = self.cache
        page = self.pages[index]
        if cache.refcount[page] > 1:
            new = cache.take_page()
            cache.data[new] = cache.data[page]
            cache.release(page)
            self.pages[index] = new
            return new
        return page

    # -- reads and shape -------------------------------------------------------------
    def read(self, start=0, stop=None):
        if BUG == "unlocked_read":
            return self._read(start, stop)
        with self.cache.lock:
            return self._read(start, stop)

    def _read(self, start, stop):
        self._open()
        n = len(self.token_list)
        stop = n if stop is None else stop
        if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= n):
            raise PositionError(f"read of [{start}, {stop}) outside length {n}")
        P = self.cache.page_tokens
        out = np.empty(self.cache.layout.batch_shape(stop - start), np.float32)
        pages = list(self.pages)
        for i, pos in enumerate(range(start, stop)):
            out[i] = self.cache.data[pages[pos // P], :, :, pos % P]
        return out, np.array(self.token_list[start:stop], dtype=np.int64)

    def fork(self) -> "PoolContext":
        if BUG == "fork_unlocked":              # planted: refcounts bumped outside the lock
            self._open()
            pages = list(self.pages)
            for page in pages:
                self.cache.refcount[page] += 1
            with self.cache.lock:
                return self.cache.adopt(pages, list(self.token_list))
        with self.cache.lock:
            self._open()
            for page in self.pages:
                self.cache.refcount[page] += 1
            return self.cache.adopt(list(self.pages), list(self.token_list))

    def truncate(self, n) -> None:
        with self.cache.lock:
            self._open()
            if not (_is_int(n) and 0 <= n <= len(self.token_list)):
                raise PositionError(f"truncate to {n!r} outside length {len(self.token_list)}")
            keep = pages_needed(int(n), self.cache.page_tokens)
            for page in self.pages[keep:]:
                self.cache.release(page)
            del self.pages[keep:]
            del self.token_list[int(n):]

    def close(self) -> None:
        with self.cache.lock:
            self._open()
            for page in self.pages:
                self.cache.release(page)
            self.pages = []
            self.closed = True
            self.cache.contexts.discard(self)


class PoolCache:
    def __init__(self, config: Config):
        if config.match != "token" or config.on_full not in ("refuse", "evict-then-refuse", "reclaim") \
                or not config.pool_pages or config.arena_pages or config.max_pages:
            raise ConfigError(f"poolserve: token match over a fixed pool only, not {config.name}")
        self.config = config
        self.layout = config.layout
        self.page_tokens = config.page_tokens
        self.precision = config.precision
        self.lock = threading.RLock()
        L = config.layout
        self.data = np.zeros((config.pool_pages, L.layers, 2, config.page_tokens, L.kv_heads, L.head_dim),
                             np.float32)
        self.refcount = np.zeros(config.pool_pages, np.int64)
        self.free = list(range(config.pool_pages - 1, -1, -1))
        self.contexts: set[PoolContext] = set()
        self.root = Node(None, None)
        self.entries: dict[tuple, Entry] = {}
        self.clock = 0

    # -- pool ------------------------------------------------------------------------
    def take_page(self) -> int:
        if not self.free:
            raise CapacityError("pool exhausted")     # never reached: make_room counted first
        page = self.free.pop()
        self.refcount[page] = 1
        self.data[page] = 0
        return page

    def release(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self.free.append(page)

    def live(self) -> int:
        return self.config.pool_pages - len(self.free)

    def make_room(self, need: int) -> None:
        if need <= 0:
            return
        limit = self.config.pool_pages
        if (self.live() + need < limit) if BUG == "pool_edge_off_by_one" else (self.live() + need <= limit):
            return
        if self.config.on_full == "refuse":
            raise CapacityError(f"{self.live()} live + {need} needed > pool {limit}")
        held = set()
        for ctx in self.contexts:
            held.update(ctx.pages)
        if len(held) + need > limit:
            raise CapacityError(f"contexts hold {len(held)} pages + {need} needed > pool {limit}")
        def fits():
            if BUG == "pool_edge_off_by_one":
                return self.live() + need < limit
            return self.live() + need <= limit
        if self.config.on_full == "reclaim":
            # SGLang's way: least recently used *leaf* entries go first, whatever they free
            while not fits():
                leaves = [e for e in self.entries.values() if not e.node.children]
                if not leaves:
                    raise CapacityError(f"pool exhausted: {self.live()} live + {need} needed > pool {limit}")
                self._drop(min(leaves, key=lambda e: e.stamp))
            return
        for entry in sorted(self.entries.values(), key=lambda e: e.stamp):
            if fits():
                break
            if BUG == "evict_lock_ref":
                evictable = all(page not in held for page in entry.pages)   # planted: any held page locks it
            else:
                evictable = any(page not in held for page in entry.pages)
            if evictable:
                self._drop(entry)

    # -- contexts --------------------------------------------------------------------
    def adopt(self, pages, tokens) -> PoolContext:
        ctx = PoolContext(self, pages, tokens)
        self.contexts.add(ctx)
        return ctx

    def allocate(self) -> PoolContext:
        with self.lock:
            return self.adopt([], [])

    # -- prefix cache ----------------------------------------------------------------
    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def retain(self, ctx: PoolContext) -> None:
        with self.lock:
            if not isinstance(ctx, PoolContext) or ctx.cache is not self:
                raise ForeignContextError("retain of a context from another cache")
            ctx._open()
            if not ctx.token_list:
                raise EmptyContextError("cannot retain an empty context")
            key = tuple(ctx.token_list)
            old = self.entries.get(key)
            for page in ctx.pages:
                self.refcount[page] += 1
            if old is not None:
                self._drop(old)
            node = self.root
            for t in key:
                node = node.children.setdefault(t, Node(node, t))
            entry = Entry(key, list(ctx.pages), self._tick(), node)
            node.entry = entry
            self.entries[key] = entry
            while len(self.entries) > self.config.max_entries:
                victim = min((e for e in self.entries.values() if e is not entry), key=lambda e: e.stamp)
                self._drop(victim)

    def _drop(self, entry: Entry) -> None:
        del self.entries[entry.key]
        for page in entry.pages:
            self.release(page)
        node = entry.node
        node.entry = None
        if BUG == "stale_nodes_longer_hit":
            return                                   # planted: lazy deletion, nodes stay
        while node.parent is not None and node.entry is None and (
                BUG == "prune_split_node" or not node.children):
            del node.parent.children[node.token]
            node = node.parent

    def match(self, tokens):
        query = [int(t) for t in check_tokens(tokens)]
        if BUG == "match_unlocked_walk":
            return self._match_unlocked(query)
        with self.lock:
            node, depth = self.root, 0
            for t in query:
                child = node.children.get(t)
                if child is None:
                    break
                node, depth = child, depth + 1
            if BUG == "stale_nodes_longer_hit":
                best = None
                while node is not self.root:
                    best = self._newest_below(node)
                    if best is not None:
                        break
                    node = node.parent            # planted: climbs to a live entry, keeps depth
                if best is None:
                    return self.adopt([], []), 0
            if depth == 0:
                return self.adopt([], []), 0
            if BUG != "stale_nodes_longer_hit":
                best = self._newest_below(node)
            length = depth
            if BUG == "hit_edge_off_by_one" and length == len(best.key) and length % self.page_tokens == 0:
                length -= 1                            # planted: a whole-key hit ending on a page edge
            if not (BUG == "stale_stamp_short_hit" and length < len(best.key)):
                best.stamp = self._tick()              # planted bug skips the stamp of a partial hit
            pages = best.pages[:pages_needed(length, self.page_tokens)]
            for page in pages:
                self.refcount[page] += 1
            return self.adopt(list(pages), list(best.key[:length])), length

    def _match_unlocked(self, query):
        # planted: the lookup reads the tree without the lock; only the stamp and the refcounts take it
        node, depth = self.root, 0
        for t in query:
            child = node.children.get(t)
            if child is None:
                break
            node, depth = child, depth + 1
        if depth == 0:
            with self.lock:
                return self.adopt([], []), 0
        best = self._newest_below(node)
        with self.lock:
            best.stamp = self._tick()
            pages = best.pages[:pages_needed(depth, self.page_tokens)]
            for page in pages:
                self.refcount[page] += 1
            return self.adopt(list(pages), list(best.key[:depth])), depth

    def _newest_below(self, node: Node) -> Entry:
        best, stack = None, [node]
        while stack:
            n = stack.pop()
            if n.entry is not None and (best is None or n.entry.stamp > best.stamp):
                best = n.entry
            stack.extend(n.children.values())
        return best

    def clear(self) -> None:
        with self.lock:
            for entry in list(self.entries.values()):
                self._drop(entry)

    def observe(self) -> Observation:
        return black_box()


def factory(config: Config) -> PoolCache:
    return PoolCache(config)


_LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)
factory.configs = [
    Config(_LAYOUT, page_tokens=4, precision="f32", max_entries=4, match="token", pool_pages=12,
           on_full="evict-then-refuse"),
    Config(_LAYOUT, page_tokens=4, precision="f16", max_entries=3, match="token", pool_pages=10,
           on_full="refuse"),
    Config(_LAYOUT, page_tokens=4, precision="f32", max_entries=4, match="token", pool_pages=12,
           on_full="reclaim", values="prefix"),
]
factory.any_page_size = True
factory.thread_safe = True
