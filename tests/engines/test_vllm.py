"""vLLM's released v1 block pool under ``kvstate conform`` (skipped where vllm is not installed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings

from kvstate.engines import sglang_loader, vllm_loader
from kvstate.reference.model import RefCache
from kvstate.spec.invariants import tiers
from kvstate.stateful.conform import conform

if vllm_loader.installed_version() is None:
    pytest.skip("vllm is not installed (pip install --no-deps vllm==0.33.0)", allow_module_level=True)

from kvstate.engines import vllm  # noqa: E402

from . import planted_vllm  # noqa: E402

SMALL = settings(max_examples=8, stateful_step_count=12, derandomize=True, deadline=None, database=None)
CHEAP = ["lockstep", "prefix edges"]


def _config(name):
    return next(c for c in vllm.factory.configs if c.name == name)


def test_the_loaded_pool_is_vllms_own_file():
    block_pool, utils = vllm_loader.load_block_pool()
    assert block_pool.__file__.replace("\\", "/").endswith("vllm/v1/core/block_pool.py")
    assert utils.__file__.replace("\\", "/").endswith("vllm/v1/core/kv_cache_utils.py")


def test_another_vllm_release_is_refused_by_name():
    with pytest.raises(vllm_loader.EngineVersionError, match="0.32.0"):
        vllm_loader.require_supported("0.32.0")


@pytest.mark.parametrize("name", ["block16-f32-heap-prefixkv"])
def test_vllm_passes_and_touches_no_stand_in(name):
    results = conform(vllm.factory, configs=[_config(name)], checks=CHEAP, settings=SMALL)
    assert results[0].passed, results[0].failure
    assert results[0].outcomes["lockstep"].steps > 50
    assert sglang_loader.STAND_IN_USES == []       # the two loaders share one record


def test_planted_clear_that_ignores_the_pools_refusal_breaks_the_clear_row():
    from kvstate.stateful.directed.semantics import ROWS

    row = next(row for row in ROWS if row.topic == "clear()")
    row.check(vllm.factory, _config("block16-f32-heap-prefixkv"), row.text)        # the control passes
    with pytest.raises(AssertionError):
        row.check(planted_vllm.reset_ignored, _config("block16-f32-heap-prefixkv"), row.text)


def test_planted_write_into_a_shared_block_is_rejected():
    results = conform(planted_vllm.writes_shared_block, configs=[_config("block16-f32-heap-prefixkv")],
                      checks=["fork isolation"], settings=SMALL)
    assert not results[0].passed


def test_the_pages_tier_reads_the_pools_ref_counts():
    cache = vllm.factory(_config("block16-f32-heap-prefixkv"))
    ctx = cache.allocate()
    ctx.extend(list(range(20)), np.zeros(cache.layout.batch_shape(20), np.float32))
    fork = ctx.fork()
    cache.retain(ctx)
    ctx.close()
    obs = cache.observe()
    assert tiers(obs) == ["pages"]
    assert [(p.refcount, p.cached) for p in obs.pages.values()] == [(1, False), (1, False)]
    fork.close()
    obs = cache.observe()
    assert [(p.refcount, p.cached) for p in obs.pages.values()] == [(0, True)]     # the full block stays cached
    assert obs.pages_allocated - obs.pages_freed == 1
    cache.clear()
    assert cache.observe().pages == {}


# A close that frees nothing is named at the close (invariant 1: a block counted for a request that no
# longer lists it): directed checks verify after every operation they apply, before teardown's 6.
@pytest.mark.parametrize("planted,check,invariant", [(planted_vllm.fork_without_touch, "fork allocates 0", 1),
                                                     (planted_vllm.leaked_blocks, "fork isolation", 1)])
def test_planted_ref_count_bug_is_rejected_on_the_pages_tier(planted, check, invariant):
    """Both bugs break only the block pool's books: values read right, so the black box passed them."""
    results = conform(planted, configs=[_config("block16-f32-heap-prefixkv")], checks=[check], settings=SMALL)
    assert not results[0].passed
    assert f"invariant {invariant}:" in results[0].failure


@pytest.mark.slow
def test_declaring_seeded_values_is_rejected():
    """Two requests caching one prefix leave two blocks under one hash; the first answers."""
    config = _config("block16-f32-heap-prefixkv").with_(values="seeded")
    results = conform(vllm.factory, configs=[config], checks=["prefix edges", "lockstep"], settings=SMALL)
    assert not results[0].passed


@pytest.mark.slow
def test_vllm_passes_the_ci_profile_in_every_configuration():
    results = conform(vllm.factory, profile="ci")
    assert [r.config.name for r in results] == [c.name for c in vllm.factory.configs]
    assert all(r.passed for r in results), [r.failure for r in results]



class _FourBlocks(vllm.VLLMCache):
    pool_blocks = 5                   # block 0 is vLLM's null block: 4 usable, the suite's pool_pages=4


class _FourBlockPool(_FourBlocks):
    def refuse_eviction(self, count: int) -> None:
        return None                   # let vLLM evict, to see what it evicts


def _request(cache, tokens, retain):
    ctx = cache.allocate()
    ctx.extend(tokens, np.zeros(cache.config.layout.batch_shape(len(tokens)), np.float32))
    if retain:
        cache.retain(ctx)
    return ctx


A, B, OTHER = list(range(32)), list(range(200, 216)), list(range(100, 148))


def _per_block(cache):
    """A (2 blocks) released, then a request needs 3 of the 4 blocks."""
    _request(cache, A, retain=True).close()
    _request(cache, OTHER, retain=False)
    return [cache.match(A)[1]]


def _release_order(cache):
    """A retained first but released last; B retained and released in between."""
    a = _request(cache, A[:16], retain=True)
    _request(cache, B, retain=True).close()
    a.close()
    _request(cache, OTHER, retain=False)
    return [cache.match(A[:16])[1], cache.match(B)[1]]


def _partial_block(cache):
    """A of 1.5 blocks released, then a request needs 3 of the 4 blocks."""
    _request(cache, A[:24], retain=True).close()
    _request(cache, OTHER, retain=False)
    return [cache.match(A[:24])[1]]


@pytest.mark.parametrize("scenario,engine_hits,suite_hits", [
    (_per_block, [16], [0]),          # vLLM evicts A's tail block only: A's first block still hits
    (_release_order, [16, 0], [0, 16]),   # vLLM: least recently *released* block; the suite: entry stamp
    (_partial_block, [16], [0]),      # the suite counts A's partly filled page live and evicts A; vLLM never cached it
])
def test_a_small_pool_evicts_in_ways_the_suites_evict_then_refuse_cannot_express(scenario, engine_hits, suite_hits):
    """Why no vLLM configuration declares a small pool (README, "left out"): under pressure vLLM's
    free queue evicts single blocks, tail first, in the order holders released them; the suite's
    ``evict-then-refuse`` evicts whole entries in the order they were retained or hit. If these
    ever agree, a small-pool configuration can be declared honestly."""
    config = _config("block16-f32-heap-prefixkv")
    assert scenario(_FourBlockPool(config)) == engine_hits
    assert scenario(RefCache(config.with_(pool_pages=4, on_full="evict-then-refuse"))) == suite_hits


def test_the_adapter_refuses_rather_than_let_the_pool_evict_a_cached_block():
    """The declared pool never evicts: where get_new_blocks would take a cached block, PoolExhausted."""
    with pytest.raises(vllm.PoolExhausted, match="would evict cached block 2"):
        _per_block(_FourBlocks(_config("block16-f32-heap-prefixkv")))


def test_retain_refuses_another_caches_context_by_name():
    from .adapter_checks import foreign_retain_is_refused
    foreign_retain_is_refused(vllm.factory, vllm.factory.configs[0])


def test_a_reclaiming_pool_evicts_its_own_way_and_passes():
    from .adapter_checks import evicts_under_pressure
    config = _config("block16-f32-pool12-reclaim-fifo-prefixkv").with_(page_tokens=1, block_tokens=1, pool_pages=24)
    evicts_under_pressure(vllm.factory, config, "evicted")       # at block size 1: a scenario of a few blocks


def test_a_retains_copy_that_evicts_a_cached_block_is_pressure():
    # (5,)*16 cached; c2's 32 ones retained, then overwritten in its first block (a copy); c3's 8 blocks take
    # the last never used ones (12 handed out, no pressure). c2's retain caches a copy of its second block
    # (cached under the old chain): get_new_blocks takes the free queue's head, (5,)*16's block, and evicts
    # it. The probe of that entry then misses, which the reference must allow: the copy was pressure.
    from kvstate.stateful import ops as O
    from kvstate.stateful.lockstep import Lockstep
    ops = [O.Allocate(), O.Extend("c1", (5,) * 16), O.Retain("c1"), O.Close("c1"),
           O.Allocate(), O.Extend("c2", (1,) * 32), O.Retain("c2"), O.Overwrite("c2", 0, (7,)),
           O.Allocate(), O.Extend("c3", (3,) * 128), O.Retain("c2"), O.Match((5,) * 16)]
    run = Lockstep(vllm.factory, _config("block16-f32-pool12-reclaim-fifo-prefixkv"))
    run.run(ops)
    assert run.engine.evicted == 1 and run.reference.pressed
    run.finish()


def test_a_hit_of_a_block_copied_at_retain_is_a_page_of_its_own():
    # kvstate sweep, seed 451 (16 steps): c3 retained, overwritten in its first block and retained again:
    # its second block is cached under the first chain, so the adapter caches a copy for the second
    # (vLLM hashes a block once). The hit c4 holds that copy, not c3's block: 11 blocks held by requests
    # where the reference, sharing it, counted 10, and c4's last extend is refused, rightly.
    from kvstate.stateful.lockstep import Lockstep
    from kvstate.stateful.ops import op_from_json
    a, b = [0, 1, 2, 0, 2, 2, 1, 1, 1], [2, 1, 1, 1, 2, 2, 2, 1, 1, 1, 2, 2, 2, 1, 1]
    ops = [{"op": "allocate"}, {"op": "extend", "ctx": "c1", "tokens": [2, 0, 0, 1, 1, 0, 1, 1, 0, 1, 1]},
           {"op": "fork", "ctx": "c1"}, {"op": "extend", "ctx": "c2", "tokens": a * 2 + a[:4]},
           {"op": "retain", "ctx": "c2"}, {"op": "match", "tokens": [2, 0, 0, 1, 1, 0, 1, 1, 0, 1, 1] + a * 2 + a[:3]},
           {"op": "truncate", "ctx": "c3", "n": 26}, {"op": "extend", "ctx": "c3", "tokens": b},
           {"op": "retain", "ctx": "c3"}, {"op": "overwrite", "ctx": "c3", "start": 6, "tokens": [2, 0, 0, 0, 0]},
           {"op": "retain", "ctx": "c3"}, {"op": "extend", "ctx": "c3", "tokens": [0] * 24},
           {"op": "match", "tokens": [2, 0, 0, 1, 1, 0, 2, 0, 0, 0, 0] + a + a[:6] + b[:6]},
           {"op": "extend", "ctx": "c4", "tokens": [0] * 15}, {"op": "extend", "ctx": "c4", "tokens": [0] * 18}]
    run = Lockstep(vllm.factory, _config("block16-f32-pool12-reclaim-fifo-prefixkv"))
    run.run([op_from_json({**op, "seed": 0} if op["op"] in ("extend", "overwrite") else op) for op in ops])
    assert "refused" in run.history[-1]
    run.finish()


def test_a_hit_shares_the_block_cached_first_under_its_hash():
    # kvstate sweep at block size 1, seed 212, minimised (22 steps). c10 and c8 retain one key, so each
    # of its block hashes is cached twice; vLLM's hit c11 takes the first block cached under each
    # (``get_cached_block``), c10's, where the reference's ways of counting had it share c8's (forks and
    # retains: the newest entry's) or the tree's (retains sharing by prefix, closed at steps 11-13 by
    # vLLM's answers). With the cache cleared, c8's overwrite needs no copy in vLLM, but two as the
    # reference counted, which a pool one page short of them refused: a false rejection, until the
    # reference counted pages a fourth way (``CACHED_FIRST``), the one left open.
    from kvstate.reference.model import CACHED_FIRST, KEEP_ENTRY
    from kvstate.stateful.lockstep import Lockstep
    from kvstate.stateful.ops import op_from_json
    ops = [{"op": "allocate"}, {"op": "fork", "ctx": "c1"}, {"op": "extend", "ctx": "c2", "tokens": [0] * 5}]
    ops += [{"op": "fork", "ctx": ctx} for ctx in ("c1", "c3", "c4", "c5", "c5")] + [{"op": "allocate"}]
    ops += [{"op": "extend", "ctx": "c7", "tokens": [0] * 2}, {"op": "extend", "ctx": "c6", "tokens": [0] * 8},
            {"op": "fork", "ctx": "c6"}, {"op": "overwrite", "ctx": "c9", "start": 0, "tokens": [0, 0]},
            {"op": "allocate"}, {"op": "extend", "ctx": "c10", "tokens": [1, 2, 0]}, {"op": "retain", "ctx": "c10"},
            {"op": "extend", "ctx": "c8", "tokens": [1, 2, 0]}, {"op": "retain", "ctx": "c8"},
            {"op": "match", "tokens": [1, 2]}, {"op": "extend", "ctx": "c11", "tokens": [0, 0]}, {"op": "clear"},
            {"op": "overwrite", "ctx": "c8", "start": 0, "tokens": [0, 0]}]
    run = Lockstep(vllm.factory, _config("block1-f32-pool24-reclaim-fifo-prefixkv"))
    run.run([op_from_json({**op, "seed": 0} if op["op"] in ("extend", "overwrite") else op) for op in ops])
    # open still: CACHED_FIRST, and KEEP_ENTRY (a key retained again keeps its entry), which vLLM's answers here
    # agree with too (c8's retain of c10's key left the blocks cached under it first)
    assert "refused" not in run.history[-1] and run.reference.viable == (CACHED_FIRST, KEEP_ENTRY)
    run.finish()
