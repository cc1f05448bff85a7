"""The pages observation tier of the vLLM adapter, read from the block pool's own state.

A page is a ``KVCacheBlock``; its refcount is the block's own ``ref_cnt``, which ``get_new_blocks``,
``touch`` and ``free_blocks`` keep. The holders are the requests (``ctx:N``, each its block table).
vLLM's hash map holds no reference (a cached block a request holds has ``ref_cnt`` = its requests),
so entries are not holders: a block cached at ``ref_cnt`` 0 in the free queue is listed as
``cached`` (spec ``cached pages``), and invariant 1 asks of every block that its ``ref_cnt`` equal
the number of requests listing it.

Live pages are the blocks some request lists plus the blocks the hash map keeps
(``cached_block_hash_to_block``: a hash maps to one block, or to several by id). The pool counts no frees, so ``pages_freed`` is the blocks
allocated less the pool's own count of live blocks (those out of the free queue, the null block
aside, plus the cached ones in it): invariant 2's "allocated - freed = live" then holds exactly when
the blocks the requests and the hash map account for are the blocks the pool has out. A block
held but never listed (a leak), or listed but back in the free queue, breaks it.
"""

from __future__ import annotations

from kvstate.spec.observation import Observation, PageView


def observe_pool(pool, contexts, allocated: int) -> Observation:
    """``pool`` a vLLM ``BlockPool``; ``contexts`` the adapter's live requests (``serial``, ``blocks``);
    ``allocated`` the blocks ``get_new_blocks`` handed out so far."""
    holders, lengths, blocks = {}, {}, {}
    for ctx in contexts:
        holders[f"ctx:{ctx.serial}"] = tuple(block.block_id for block in ctx.blocks)
        lengths[f"ctx:{ctx.serial}"] = len(ctx)
        blocks.update((block.block_id, block) for block in ctx.blocks)
    hashed = _hashed_blocks(pool)
    blocks.update(hashed)
    pages = {block_id: PageView(block_id, block.ref_cnt, None, cached=block.ref_cnt == 0 and block_id in hashed)
             for block_id, block in sorted(blocks.items())}
    out = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()        # ref_cnt > 0; the null block aside
    cached_free = sum(1 for block in hashed.values() if block.ref_cnt == 0)
    return Observation(pages=pages, holders=holders, lengths=lengths,
                       pages_allocated=allocated, pages_freed=allocated - out - cached_free,
                       arena_size=None, arena_out={}, arena_free=(), tree=None, entries=None)


def _hashed_blocks(pool) -> dict:
    """Every block the pool's hash map keeps, by id (``BlockHashToBlockMap`` holds a block, or a
    dict of blocks by id where several share a hash)."""
    hashed = {}
    for held in pool.cached_block_hash_to_block._cache.values():
        for block in (held.values() if isinstance(held, dict) else (held,)):
            hashed[block.block_id] = block
    return hashed
