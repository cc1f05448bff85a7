"""vLLM 0.33.0's own v1 block pool (prefix caching by block hash), driven through the kvstate protocol.

    python -m kvstate conform kvstate.engines.vllm

The engine is vLLM's released ``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py``, loaded
unmodified by ``kvstate.engines.vllm_loader`` (which lists every stand-in, and why
``kv_cache_manager.py`` itself is not loaded). The adapter plays ``FullAttentionManager``:

- a context is a request's block table: ``KVCacheBlock`` objects from ``get_new_blocks``, shared
  by reference count (``touch``); a block is written only when ``is_block_writable`` (refcount 1,
  no hash), else it is first copied into a new block and the old one released (``free_blocks``);
- ``match`` hashes the query's full blocks with ``hash_block_tokens`` (chained, as vLLM's
  request block hasher does) and takes the longest run that ``get_cached_block`` finds, then
  ``touch`` (a cached block at refcount 0 leaves the free queue);
- ``retain`` hashes the context's full blocks and ``cache_full_blocks`` each one not yet cached
  under that hash (a block cached under another chain, after an overwrite, is copied first);
- ``close`` is ``free_blocks`` of the table in reverse order (the tail is evicted first), as
  ``KVCacheManager.free``; ``clear`` is ``evict_blocks`` of every block (``reset_prefix_cache``
  refuses while any request holds a block); ``fork`` is ``touch`` of the whole table.

The K/V values live in the adapter's own array, indexed by ``block_id * block_size + offset``.

Declared semantics, from the engine's code: ``match="block"`` with ``block_tokens`` = block size
(only full blocks are hashed); ``values="prefix"`` (two requests caching one prefix leave two
blocks under one hash and ``get_cached_block`` returns the first); no entry bound. Two kinds of
pool:

- the first configurations: a pool larger than any run needs: ``PoolExhausted`` if not, and also
  where ``get_new_blocks`` would evict a cached block (its free queue reaches the cached blocks
  once the never used ones are gone, which ``clear()`` can bring about before the pool is full),
  rather than let vLLM evict behind the suite's back;
- ``RECLAIM_POOLS``: a pool of the declared size (plus the null block), ``on_full="reclaim-fifo"``:
  ``get_new_blocks`` evicts cached blocks from its free queue as vLLM does (single blocks, tail
  first, in the order their holders released them: no order ``evict-then-refuse`` expresses,
  ``tests/engines/test_vllm.py`` shows each difference), and an operation is refused with
  ``CapacityError``, changing nothing, when the free blocks, cached ones included, are fewer than
  it needs. A retain whose blocks are cached under another chain (after an overwrite) copies them
  into blocks only the cache keeps, so the request holds what it held.

Observation: the pages tier (``vllm_pages``), read from the pool itself: each block's own
``ref_cnt`` against the block tables that list it, cached blocks at ``ref_cnt`` 0 in the free queue
listed as ``cached``, and the pool's count of blocks out against the blocks the tables and the
hash map account for. No tree tier: vLLM keeps a flat map of chained block hashes, not keys (a
retained prefix of a retained key leaves no mark of its own), so there are no entries to list.
"""

from __future__ import annotations

import hashlib
import pickle

from kvstate.spec import Config, Layout
from kvstate.spec.errors import CapacityError, EmptyContextError
from kvstate.spec.layout import check_tokens
from kvstate.spec.observation import Observation
from kvstate.spec.semantics import reclaims

from .context_base import ENTRY_BOUND, EngineCache, EngineContext, PoolExhausted
from .vllm_loader import SUPPORTED_VERSION, load_block_pool
from .vllm_pages import observe_pool

POOL_BLOCKS = 1 << 14
GROUP = 0                     # one KV cache group: full attention
# The reclaiming configurations' pools (block size, blocks): small enough that runs evict cached blocks. At
# block size 1 a 200-seed sweep once met two ways vLLM holds other blocks than the reference counted, each a
# false rejection, not an engine bug: a retain after an overwrite copies blocks cached under the old chain
# (since modelled: the reference names such a copy both ways), and a hit takes the first block cached
# under each hash (since counted as ``reference.model.CACHED_FIRST``): README, vLLM.
RECLAIM_POOLS = ((16, 12), (1, 24))


def sha256(value) -> bytes:
    """vLLM's ``vllm.utils.hashing.sha256`` (sha256 over pickle), written with hashlib."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


class _Request:
    """What ``BlockPool.cache_full_blocks`` reads of a request (events off): its block hashes."""

    def __init__(self, block_hashes):
        self.block_hashes = block_hashes


class VLLMContext(EngineContext):
    """One request: tokens and its block table (``KVCacheBlock`` objects of the engine's pool)."""

    def __init__(self, cache: "VLLMCache", tokens: list[int], blocks: list):
        super().__init__(cache, tokens)
        self.blocks = blocks

    def _slots(self, start: int, stop: int) -> list[int]:
        size = self.cache.block_size
        return [self.blocks[p // size].block_id * size + p % size for p in range(start, stop)]

    def _writable(self, first: int, last: int) -> None:
        """Blocks ``first..last`` made writable: each one shared or cached is copied first."""
        cache, pool = self.cache, self.cache.pool
        stale = [i for i in range(first, min(last, len(self.blocks) - 1) + 1)
                 if not pool.is_block_writable(self.blocks[i])]
        cache.require(len(stale))                       # every copy's block first: a refusal changes nothing
        for i in stale:
            fresh = cache.new_blocks(1)[0]
            cache.copy_block(self.blocks[i], fresh)
            pool.free_blocks([self.blocks[i]])
            self.blocks[i] = fresh

    def extend(self, tokens, kv) -> None:
        tokens, values = self._encode(tokens, kv)
        if not tokens:
            return
        size = self.cache.block_size
        length = len(self)
        total = length + len(tokens)
        partial = length % size != 0 and not self.cache.pool.is_block_writable(self.blocks[-1])
        more = -(-total // size) - len(self.blocks)
        self.cache.require(more + partial)              # refuse before changing anything
        if length % size:
            self._writable(len(self.blocks) - 1, len(self.blocks) - 1)
        if more > 0:
            self.blocks += self.cache.new_blocks(more)
        self._tokens += tokens
        self.cache.store(self._slots(length, total), values)

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, values = self._encode(tokens, kv, start)
        if not tokens:
            return
        size = self.cache.block_size
        self._writable(start // size, (start + len(tokens) - 1) // size)
        self._tokens[start:start + len(tokens)] = tokens
        self.cache.store(self._slots(start, start + len(tokens)), values)

    def fork(self) -> "VLLMContext":
        self._open()
        self.cache.pool.touch(self.blocks)
        return self.cache.register(self.cache.context_class(self.cache, list(self._tokens), list(self.blocks)))

    def truncate(self, n: int) -> None:
        self._check_truncate(n)
        keep = -(-n // self.cache.block_size)
        self.cache.pool.free_blocks(list(reversed(self.blocks[keep:])))
        del self.blocks[keep:]
        del self._tokens[n:]

    def close(self) -> None:
        self._open()
        self.cache.pool.free_blocks(list(reversed(self.blocks)))
        self.blocks, self.closed = [], True
        self.cache.contexts.remove(self)


class VLLMCache(EngineCache):
    context_class = VLLMContext
    pool_blocks = POOL_BLOCKS     # the engine's num_gpu_blocks; block 0 is its null block

    def __init__(self, config: Config):
        super().__init__(config)
        block_pool, utils = load_block_pool()
        self.utils = utils
        utils.init_none_hash(sha256)
        self.block_size = config.page_tokens
        self.reclaims = reclaims(config.on_full)
        if self.reclaims:
            self.pool_blocks = config.pool_limit + 1          # the declared pool, and the null block
        self.pool = block_pool.BlockPool(self.pool_blocks, enable_caching=True, hash_block_size=self.block_size)
        self.allocated = 0            # blocks get_new_blocks handed out (the pool counts none)
        self.evicted = 0              # cached blocks get_new_blocks evicted (a measure of pressure, for reports)

    # -- the adapter's K/V array is indexed by block_id * block_size + offset -------------

    def copy_block(self, source, target) -> None:
        size = self.block_size
        rows = range(source.block_id * size, source.block_id * size + size)
        self.store(list(range(target.block_id * size, target.block_id * size + size)), self.values_at(list(rows)))

    # -- the engine's operations ---------------------------------------------------------

    def require(self, blocks: int) -> None:
        """Refused before anything changes when the free queue, cached blocks included, is short:
        ``CapacityError`` where the pool is declared (``reclaim``), else the adapter's own pool ran out."""
        free = self.pool.get_num_free_blocks()
        if blocks > free and self.reclaims:
            raise CapacityError(f"{blocks} blocks wanted, {free} free (cached ones included)")
        if blocks > free:
            raise PoolExhausted(f"the adapter's pool of {self.pool_blocks} blocks ran out ({blocks} more wanted)")

    def new_blocks(self, count: int) -> list:
        self.require(count)
        if self.reclaims:
            self.evicted += self.cached_at_head(count)      # get_new_blocks evicts them, as vLLM does
        else:
            self.refuse_eviction(count)
        blocks = self.pool.get_new_blocks(count)
        self.allocated += len(blocks)
        return blocks

    def cached_at_head(self, count: int) -> int:
        """How many of the ``count`` blocks at the free queue's head are cached (``get_new_blocks`` evicts them)."""
        block, cached = self.pool.free_block_queue.fake_free_list_head.next_free_block, 0
        for _ in range(count):
            cached += block.block_hash is not None
            block = block.next_free_block
        return cached

    def refuse_eviction(self, count: int) -> None:
        """``PoolExhausted`` rather than let ``get_new_blocks`` evict a cached block behind the suite's back.

        The free queue hands out its head: freed uncached blocks, then never used ones, then cached
        blocks in release order (after ``clear()``, uncached ones among them). Where a cached block
        comes up before ``count`` are taken, vLLM would evict it while the declared pool has room."""
        block = self.pool.free_block_queue.fake_free_list_head.next_free_block
        for _ in range(count):
            if block.block_hash is not None:
                raise PoolExhausted(f"the adapter's pool of {self.pool_blocks} blocks would evict cached block "
                                    f"{block.block_id} (its free queue reached the cached blocks)")
            block = block.next_free_block

    def block_hashes(self, tokens: list[int]) -> list:
        """The chained hash of each full block, as vLLM's request block hasher computes them."""
        hashes, parent, size = [], None, self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            parent = self.utils.hash_block_tokens(sha256, parent, tokens[start:start + size], None)
            hashes.append(parent)
        return hashes

    # -- the protocol ----------------------------------------------------------------

    def allocate(self) -> VLLMContext:
        return self.register(self.context_class(self, [], []))

    def retain(self, ctx: VLLMContext) -> None:
        self.own(ctx)
        if len(ctx) == 0:
            raise EmptyContextError("cannot retain an empty context")
        hashes = self.block_hashes(ctx._tokens)
        keys = [self.utils.make_block_hash_with_group_id(h, GROUP) for h in hashes]
        foreign = [i for i, key in enumerate(keys)
                   if ctx.blocks[i].block_hash is not None and ctx.blocks[i].block_hash != key]
        request = _Request(hashes)
        if self.reclaims:
            self._cache_with_copies(request, ctx.blocks, foreign)
            return
        self.require(len(foreign))
        for i in foreign:                                 # cached under another chain: copy, then cache
            ctx._writable(i, i)
        for i, key in enumerate(keys):
            if ctx.blocks[i].block_hash is None:
                self.pool.cache_full_blocks(request, ctx.blocks, i, i + 1, self.block_size, GROUP)

    def _cache_with_copies(self, request, blocks: list, foreign: list[int]) -> None:
        """A retain in a declared pool: the blocks cached under another chain (``foreign``) are copied into
        blocks the cache alone keeps (released at once, cached at refcount 0: reclaimable as any cached
        block), so the request holds what it held and the pages contexts hold stay as counted. Where the
        free queue is short of the copies (a retain is never refused), those blocks are not cached under
        this chain: the key's cached run ends before the first of them, as if reclaimed."""
        if len(foreign) > self.pool.get_num_free_blocks():
            foreign = []
        table, copies = list(blocks), self.new_blocks(len(foreign))
        for i, fresh in zip(foreign, copies):
            self.copy_block(blocks[i], fresh)
            table[i] = fresh
        for i in range(len(request.block_hashes)):
            if table[i].block_hash is None:
                self.pool.cache_full_blocks(request, table, i, i + 1, self.block_size, GROUP)
        self.pool.free_blocks(list(reversed(copies)))

    def match(self, tokens):
        query = [int(t) for t in check_tokens(tokens, private=False)]
        hit = []
        for block_hash in self.block_hashes(query):
            found = self.pool.get_cached_block(block_hash, [GROUP])
            if found is None:
                break
            hit.append(found[0])
        if not hit:
            return self.allocate(), 0
        self.pool.touch(hit)
        length = len(hit) * self.block_size
        return self.register(self.context_class(self, query[:length], hit)), length

    def clear(self) -> None:
        self.pool.evict_blocks({block.block_id for block in self.pool.blocks if block.block_hash is not None})

    def observe(self) -> Observation:
        return observe_pool(self.pool, self.contexts, self.allocated)


def _configs() -> list[Config]:
    layout = Layout(layers=2, kv_heads=2, head_dim=4)
    configs = []
    for block in (1, 16, 64):
        for precision in (("f32", "f16", "q8") if block == 16 else ("f32",)):
            configs.append(Config(layout, page_tokens=block, precision=precision, max_entries=ENTRY_BOUND,
                                  match="block", block_tokens=block, values="prefix"))
    return configs + [Config(layout, page_tokens=block, precision="f32", max_entries=ENTRY_BOUND, match="block",
                             block_tokens=block, values="prefix", pool_pages=pool, on_full="reclaim-fifo")
                      for block, pool in RECLAIM_POOLS]


def factory(config: Config) -> VLLMCache:
    return VLLMCache(config)


factory.configs = _configs()
factory.any_page_size = False
factory.engine_version = SUPPORTED_VERSION
