"""``no_entry_bound``'s block cache over a fixed pool that reclaims in release order (an audit's
``auditkv`` with its pool, ``on_full="reclaim-fifo"``).

As vLLM's free queue: ``pool_pages`` blocks, those at refcount 0 (cached or not) queued in the order
they were released; a new block is the front one, and a cached block taken so leaves the hash map.
A write counts the blocks it needs (new ones, and copies of shared or cached ones) and is refused
with ``CapacityError``, nothing changed, when the queue is shorter. One RLock around every
operation, the check and the allocation under one hold: ``thread_safe``.

``check_then_act`` is the planted race: ``extend`` checks the room under the lock and takes the
blocks after letting it go, so two threads can both pass the check for the last blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from kvstate.spec import Config
from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.errors import CapacityError

from .no_entry_bound import BOUND, LAYOUT, Block, BlockCache, Ctx


class PoolCtx(Ctx):
    def _need(self, first: int, n: int) -> int:
        """Blocks a write of ``n`` positions at ``first`` takes: new ones, and a copy of each shared or cached one."""
        if n == 0:
            return 0
        c, stop = self.cache, first + n
        written = range(first // c.B, min((stop - 1) // c.B, len(self.blocks) - 1) + 1)
        copies = sum(1 for i in written if c.blocks[self.blocks[i]].ref > 1 or c.blocks[self.blocks[i]].keys)
        return max(0, pages_needed(stop, c.B) - len(self.blocks)) + copies

    def extend(self, tokens, kv) -> None:
        with self.cache.lock:
            first, tokens, values = self._prepare(tokens, kv)
            self.cache.require(self._need(first, len(tokens)))
            self.length += self._put(first, tokens, values)

    def overwrite(self, start, tokens, kv) -> None:
        with self.cache.lock:
            first, tokens, values = self._prepare(tokens, kv, start)
            self.cache.require(self._need(first, len(tokens)))
            self._put(first, tokens, values)


class PoolCache(BlockCache):
    ctx_class = PoolCtx

    def __init__(self, config: Config):
        super().__init__(config)
        self.free: OrderedDict[int, None] = OrderedDict()     # refcount-0 blocks, in release order
        for bid in range(config.pool_pages):
            self.blocks[bid] = Block(self.layout, self.B)
            self.free[bid] = None

    def require(self, need: int) -> None:
        if need > len(self.free):
            raise CapacityError(f"need {need} blocks, {len(self.free)} free")

    def new_block(self) -> int:
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        if block.keys:                  # a cached block reclaimed: it leaves the map, freed, and is reused
            for key in block.keys:
                if self.map.get(key) == bid:
                    del self.map[key]
            block.keys.clear()
            self.freed += 1
        block.values[:], block.tokens[:], block.ref = 0, 0, 1
        self.live.add(bid)
        self.allocated += 1
        return bid

    def release(self, bid: int) -> None:
        super().release(bid)
        if self.blocks[bid].ref == 0:
            self.free[bid] = None

    def adopt(self, blocks: list[int], length: int) -> Ctx:
        for bid in blocks:
            self.free.pop(bid, None)    # a cached block a hit takes leaves the queue
        return super().adopt(blocks, length)


class CheckThenActCtx(PoolCtx):
    def extend(self, tokens, kv) -> None:
        with self.cache.lock:
            first, tokens, values = self._prepare(tokens, kv)
            self.cache.require(self._need(first, len(tokens)))
        time.sleep(0)                   # the lock let go between the check and the allocation
        with self.cache.lock:
            self.length += self._put(first, tokens, values)


class CheckThenAct(PoolCache):
    ctx_class = CheckThenActCtx


CONFIGS = [Config(LAYOUT, page_tokens=B, precision="f32", max_entries=BOUND, match="block", block_tokens=B,
                  values="prefix", pool_pages=pool, on_full="reclaim-fifo") for B, pool in ((1, 24), (4, 12))]


def factory(config: Config) -> PoolCache:
    return PoolCache(config)


def check_then_act(config: Config) -> PoolCache:
    return CheckThenAct(config)


for _made in (factory, check_then_act):
    _made.configs, _made.any_page_size, _made.thread_safe = CONFIGS, False, True
