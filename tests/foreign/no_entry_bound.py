"""A block-hash prefix cache with no entry bound (an audit's ``auditkv``, trimmed to its heap).

As vLLM's: a block is a page; ``retain`` publishes the chained hash of each full block in a map from
hash to block (the block cached first under a hash wins), which holds no reference; a block nobody
holds stays cached until ``clear``. Nothing bounds the entries, so every configuration declares
``max_entries`` 2**30 (as vLLM's and SGLang's adapters do) and ``factory`` ignores the bound it is
handed. ``strict_factory`` refuses any other bound with ``ConfigError``. Observed through the pages
tier alone (no tree). One RLock around every operation: ``thread_safe``.

``match_unlocked`` is the planted race: ``match`` looks its blocks up and takes their references
without the lock, racing ``clear``, ``close`` and other matches.
"""

from __future__ import annotations

import threading

import numpy as np

from kvstate.spec import Config, Layout, Observation, PageView
from kvstate.spec import precision as precisions
from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.errors import ConfigError, ContextClosedError, EmptyContextError, PositionError
from kvstate.spec.layout import check_tokens, check_values, require_finite

BOUND = 1 << 30


class Block:
    def __init__(self, layout: Layout, size: int):
        self.ref, self.keys = 0, set()
        self.values = np.zeros((size, *layout.position_shape), np.float32)
        self.tokens = np.zeros(size, np.int64)


class Ctx:
    def __init__(self, cache: "BlockCache", blocks: list[int], length: int):
        self.cache, self.blocks, self.length, self.closed = cache, blocks, length, False

    def __len__(self) -> int:
        return self.length

    def _open(self) -> None:
        if self.closed:
            raise ContextClosedError("context closed")

    def _gather(self, start: int, stop: int):
        B, blocks = self.cache.B, self.cache.blocks
        values = np.zeros((stop - start, *self.cache.layout.position_shape), np.float32)
        tokens = np.zeros(stop - start, np.int64)
        for i, p in enumerate(range(start, stop)):
            block = blocks[self.blocks[p // B]]
            values[i], tokens[i] = block.values[p % B], block.tokens[p % B]
        return values, tokens

    @property
    def tokens(self) -> list[int]:
        with self.cache.lock:
            self._open()
            return [int(t) for t in self._gather(0, self.length)[1]]

    def read(self, start=0, stop=None):
        with self.cache.lock:
            self._open()
            stop = self.length if stop is None else stop
            if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= self.length):
                raise PositionError(f"read [{start},{stop}) outside {self.length}")
            return self._gather(start, stop)

    def _write(self, tokens, kv, start=None) -> int:
        """Write at ``start`` (an overwrite) or at the end; the number of tokens written."""
        first, tokens, values = self._prepare(tokens, kv, start)
        return self._put(first, tokens, values)

    def _prepare(self, tokens, kv, start=None):
        """The checked input of a write at ``start`` (or at the end): its first position, tokens and values."""
        tokens = check_tokens(tokens)
        kv = check_values(self.cache.layout, kv, len(tokens))
        self._open()
        if start is not None and not (isinstance(start, int) and 0 <= start and start + len(tokens) <= self.length):
            raise PositionError(f"overwrite [{start},{start + len(tokens)}) outside {self.length}")
        require_finite(kv)
        return (self.length if start is None else start), tokens, precisions.roundtrip(self.cache.precision, kv)

    def _put(self, first: int, tokens, values) -> int:
        c = self.cache
        for i, p in enumerate(range(first, first + len(tokens))):
            index, offset = divmod(p, c.B)
            if index == len(self.blocks):
                self.blocks.append(c.new_block())
            elif c.blocks[self.blocks[index]].ref > 1 or c.blocks[self.blocks[index]].keys:   # shared or cached
                old, self.blocks[index] = self.blocks[index], c.new_block()
                new = c.blocks[self.blocks[index]]
                new.values[:], new.tokens[:] = c.blocks[old].values, c.blocks[old].tokens
                c.release(old)
            block = c.blocks[self.blocks[index]]
            block.values[offset], block.tokens[offset] = values[i], tokens[i]
        return len(tokens)

    def extend(self, tokens, kv) -> None:
        with self.cache.lock:
            self.length += self._write(tokens, kv)

    def overwrite(self, start, tokens, kv) -> None:
        with self.cache.lock:
            self._write(tokens, kv, start)

    def fork(self) -> "Ctx":
        with self.cache.lock:
            self._open()
            return self.cache.adopt(list(self.blocks), self.length)

    def truncate(self, n) -> None:
        with self.cache.lock:
            self._open()
            if not (isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= self.length):
                raise PositionError(f"truncate to {n} outside {self.length}")
            keep = pages_needed(n, self.cache.B)
            for block in reversed(self.blocks[keep:]):
                self.cache.release(block)
            del self.blocks[keep:]
            self.length = n

    def close(self) -> None:
        with self.cache.lock:
            self._open()
            for block in reversed(self.blocks):
                self.cache.release(block)
            self.blocks, self.closed = [], True
            self.cache.contexts.remove(self)


class BlockCache:
    ctx_class = Ctx

    def __init__(self, config: Config):
        self.layout, self.B, self.precision = config.layout, config.page_tokens, config.precision
        self.lock = threading.RLock()
        self.blocks: dict[int, Block] = {}
        self.map: dict[tuple, int] = {}          # chained hash -> block id
        self.live: set[int] = set()              # held or cached
        self.allocated = self.freed = 0
        self.contexts: list[Ctx] = []

    def new_block(self) -> int:
        bid = len(self.blocks)
        self.blocks[bid] = Block(self.layout, self.B)
        self.blocks[bid].ref = 1
        self.live.add(bid)
        self.allocated += 1
        return bid

    def release(self, bid: int) -> None:
        block = self.blocks[bid]
        block.ref -= 1
        if block.ref == 0 and not block.keys:
            self.live.discard(bid)
            self.freed += 1

    def adopt(self, blocks: list[int], length: int) -> Ctx:
        for bid in blocks:
            self.blocks[bid].ref += 1
        ctx = self.ctx_class(self, blocks, length)
        self.contexts.append(ctx)
        return ctx

    def chain(self, tokens, n: int) -> list[tuple]:
        keys, parent = [], None
        for i in range(n):
            parent = hash((parent, tuple(int(t) for t in tokens[i * self.B:(i + 1) * self.B])))
            keys.append((i, parent))
        return keys

    def hit(self, tokens) -> list[int]:
        hit = []
        for key in self.chain(tokens, len(tokens) // self.B):
            if key not in self.map:
                break
            hit.append(self.map[key])
        return hit

    def allocate(self) -> Ctx:
        with self.lock:
            return self.adopt([], 0)

    def retain(self, ctx: Ctx) -> None:
        with self.lock:
            ctx._open()
            if ctx.length == 0:
                raise EmptyContextError("cannot retain an empty context")
            tokens = ctx._gather(0, ctx.length)[1]
            for i, key in enumerate(self.chain(tokens, ctx.length // self.B)):
                if key not in self.map:          # the block cached first under a hash stays
                    self.blocks[ctx.blocks[i]].keys.add(key)
                    self.map[key] = ctx.blocks[i]

    def match(self, tokens):
        with self.lock:
            hit = self.hit(check_tokens(tokens))
            return self.adopt(hit, len(hit) * self.B), len(hit) * self.B

    def clear(self) -> None:
        with self.lock:
            for bid, block in self.blocks.items():
                if block.keys:
                    block.keys.clear()
                    if block.ref == 0:
                        self.live.discard(bid)
                        self.freed += 1
            self.map.clear()

    def observe(self) -> Observation:
        with self.lock:
            pages = {bid: PageView(bid, self.blocks[bid].ref, None, cached=self.blocks[bid].ref == 0)
                     for bid in self.live}
            holders = {f"ctx:{i}": tuple(c.blocks) for i, c in enumerate(self.contexts)}
            lengths = {f"ctx:{i}": c.length for i, c in enumerate(self.contexts)}
            return Observation(pages=pages, holders=holders, lengths=lengths, pages_allocated=self.allocated,
                               pages_freed=self.freed, arena_size=None, arena_out={}, arena_free=(), tree=None,
                               entries=None)


class MatchUnlocked(BlockCache):
    def match(self, tokens):
        hit = self.hit(check_tokens(tokens))          # no lock: a clear or close may cut in
        for bid in hit:
            self.blocks[bid].ref += 1
        with self.lock:
            ctx = Ctx(self, hit, len(hit) * self.B)
            self.contexts.append(ctx)
        return ctx, len(hit) * self.B


LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)
CONFIGS = [Config(LAYOUT, page_tokens=B, precision=p, max_entries=BOUND, match="block", block_tokens=B,
                  values="prefix") for B, p in ((1, "f32"), (4, "f16"))]


def factory(config: Config) -> BlockCache:
    return BlockCache(config)          # whatever max_entries it is handed: there is no entry bound


def strict_factory(config: Config) -> BlockCache:
    if config.max_entries != BOUND:
        raise ConfigError(f"no entry bound: max_entries={config.max_entries} is not supported")
    return BlockCache(config)


def match_unlocked(config: Config) -> BlockCache:
    return MatchUnlocked(config)


for _made in (factory, strict_factory, match_unlocked):
    _made.configs, _made.any_page_size, _made.thread_safe = CONFIGS, False, True
