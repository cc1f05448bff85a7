"""SGLang's released RadixCache under ``kvstate conform`` (skipped where sglang is not installed)."""

from __future__ import annotations

import pytest
from hypothesis import settings

from kvstate.engines import sglang_loader
from kvstate.stateful.conform import conform

if sglang_loader.installed_version() is None:
    pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23)", allow_module_level=True)

from kvstate.engines import sglang  # noqa: E402

from . import planted_sglang  # noqa: E402

SMALL = settings(max_examples=12, stateful_step_count=15, derandomize=True, deadline=None, database=None)
CHEAP = ["lockstep", "fork isolation", "pinned semantics", "prefix edges"]


def _config(name):
    return next(c for c in sglang.factory.configs if c.name == name)


def test_the_loaded_cache_is_sglangs_own_file():
    module = sglang_loader.load_radix_cache()
    assert module.__file__.replace("\\", "/").endswith("sglang/srt/mem_cache/radix_cache.py")
    import sys
    assert not any(name == "sglang" or name.startswith("sglang.") for name in sys.modules
                   if getattr(sys.modules[name], "__file__", None) is None)     # no bare packages left behind


@pytest.mark.parametrize("version", ["0.5.22", "0.6.0"])
def test_another_sglang_release_is_refused_by_name(version):
    with pytest.raises(sglang_loader.EngineVersionError, match=version):
        sglang_loader.require_supported(version)


def test_a_stand_in_raises_when_used():
    stand_in = sglang_loader._StandIn("sglang.srt.environ.envs")
    before = len(sglang_loader.STAND_IN_USES)
    with pytest.raises(sglang_loader.StandInCalled):
        stand_in()
    with pytest.raises(sglang_loader.StandInCalled):
        stand_in.SGLANG_MOONCAKE_CUSTOM_MEM_POOL
    del sglang_loader.STAND_IN_USES[before:]


@pytest.mark.parametrize("name", ["token-f32-heap-prefixkv", "block16-f32-heap-prefixkv"])
def test_sglang_passes_and_touches_no_stand_in(name):
    results = conform(sglang.factory, configs=[_config(name)], checks=CHEAP, settings=SMALL)
    assert results[0].passed, results[0].failure
    assert results[0].outcomes["lockstep"].steps > 50
    assert sglang_loader.STAND_IN_USES == []


@pytest.mark.parametrize("planted,check", [(planted_sglang.leaked_lock, "prefix edges"),
                                           (planted_sglang.writes_into_tree, "prefix edges")])
def test_planted_adapter_bug_is_rejected(planted, check):
    results = conform(planted, configs=[_config("token-f32-heap-prefixkv")], checks=[check], settings=SMALL)
    assert not results[0].passed


@pytest.mark.parametrize("name", ["token-f32-heap-prefixkv", "block16-f32-heap-prefixkv"])
def test_a_leaked_private_page_is_rejected_by_invariant_6(name):
    """In a pool no run fills, a page never given back shows only in SGLang's allocator: the
    teardown's invariant 6 reads it there (the adapter's observation is a black box otherwise)."""
    results = conform(planted_sglang.leaked_private_pages, configs=[_config(name)], checks=["lockstep"],
                      settings=SMALL)
    assert not results[0].passed
    assert "invariant 6" in results[0].failure and "still out" in results[0].failure


@pytest.mark.parametrize("factory,out", [(sglang.factory, 0), (planted_sglang.leaked_private_pages, 9)])
def test_the_pages_out_are_read_from_sglangs_allocator(factory, out):
    import numpy as np
    config = _config("token-f32-heap-prefixkv")
    cache = factory(config)
    for _ in range(3):
        ctx = cache.allocate()
        ctx.extend([1, 2, 3], np.ones(config.layout.batch_shape(3), np.float32))
        ctx.close()
    cache.clear()
    obs = cache.observe()
    assert (obs.pages_allocated, obs.pages_allocated - obs.pages_freed) == (9, out)
    assert cache.allocator.available_size() == cache.allocator.size - out


def test_declaring_seeded_values_is_rejected():
    """The values rule is what SGLang needs: declared with seeded values (two writes of one prefix
    may differ) the engine's keep-the-old-slots insert shows as wrong values."""
    config = _config("token-f32-heap-prefixkv").with_(values="seeded")
    results = conform(sglang.factory, configs=[config], checks=["prefix edges", "lockstep"], settings=SMALL)
    assert not results[0].passed
    assert "invariant 4" in results[0].failure or "values" in results[0].failure


@pytest.mark.slow
def test_sglang_passes_the_ci_profile_in_every_configuration():
    results = conform(sglang.factory, profile="ci")
    assert [r.config.name for r in results] == [c.name for c in sglang.factory.configs]
    assert all(r.passed for r in results), [r.failure for r in results]
    assert sglang_loader.STAND_IN_USES == []


# -- found by an audit: another cache's context, refusals half done -----------------------------

def test_retain_refuses_another_caches_context_by_name():
    from .adapter_checks import foreign_retain_is_refused
    foreign_retain_is_refused(sglang.factory, _config("block16-f32-heap-prefixkv"))


@pytest.fixture
def small_pool(monkeypatch):
    monkeypatch.setattr(sglang, "POOL_PAGES", 64)         # the suite's pool, shrunk so a filler can run it out


def _full(cache, config):
    """A filler context holding every free slot: the next allocation is refused."""
    import numpy as np
    free = cache.allocator.available_size()
    filler = cache.allocate()
    filler.extend([7] * free, np.zeros(config.layout.batch_shape(free), np.float32))
    return filler


def test_a_refused_fork_or_truncate_changes_nothing(small_pool):
    """At 16-token pages: a fork copies the private partial page, a truncate into the tree's part
    copies what it keeps of a tree page; with the pool full both are refused, and must change nothing."""
    import numpy as np
    from kvstate.engines.context_base import PoolExhausted
    config = _config("block16-f32-heap-prefixkv")
    cache = sglang.factory(config)
    key, values = list(range(32)), np.ones(config.layout.batch_shape(34), np.float32)
    ctx = cache.allocate()
    ctx.extend(key + [1, 2], values)                      # the tree takes the key, two positions stay private
    cache.retain(ctx)
    filler = _full(cache, config)
    for refused in (ctx.fork, lambda: ctx.truncate(20)):
        with pytest.raises(PoolExhausted):
            refused()
        assert len(ctx) == 34 and np.array_equal(ctx.read()[0], values)
    filler.close()
    ctx.extend([9] * 4, np.full(config.layout.batch_shape(4), 5, np.float32))
    ctx.close()
    probe, hit = cache.match(key)
    assert hit == 32 and np.array_equal(probe.read()[0], values[:32])     # the tree's values untouched
    probe.close()
    cache.clear()
    assert cache.match(key)[1] == 0 and cache.tree.protected_size() == 0    # no lock left behind


def test_a_reclaiming_pool_evicts_its_own_way_and_passes():
    from .adapter_checks import evicts_under_pressure
    evicts_under_pressure(sglang.factory, _config("token-f32-pool24-reclaim-prefixkv"), "evicted_tokens")


@pytest.mark.parametrize("name, page, filler", [("token-f32-pool24-reclaim-prefixkv", 1, 21),
                                                 ("block16-f32-pool12-reclaim-prefixkv", 16, 9)])
def test_a_refusal_after_a_pressed_retain_kept_its_own_pages_is_accepted(name, page, filler):
    """Found by review (a sweep at seeds 5000-5249 failed once): entry ``(4, 0, 0)``, its pages also a
    live fork's, is evicted under pressure; ``(4, 1)`` is then retained and SGLang keeps the
    context's own page for it, as the semantics allow a pressed retain to. The reference named that
    page as the evicted entry's (the fork's), one page fewer than SGLang holds, and called SGLang's
    correct refusal of the last page wrong ("the reference had room")."""
    from kvstate.stateful import ops as O
    from kvstate.stateful.lockstep import Lockstep

    def pages(*tokens):
        return tuple(t for t in tokens for _ in range(page))
    ops = [O.Allocate(), O.Extend("c1", pages(1, 2)), O.Retain("c1"),
           O.Allocate(), O.Extend("c2", pages(1, 2, 3)), O.Retain("c2"),
           O.Allocate(), O.Extend("c3", pages(*(9,) * filler)), O.Close("c3"),
           O.Allocate(), O.Extend("c4", pages(4, 0, 0)), O.Fork("c4"), O.Retain("c4"), O.Close("c4"),
           O.Allocate(), O.Extend("c6", pages(5, 5)), O.Retain("c6"), O.Close("c6"),
           O.Allocate(), O.Extend("c7", pages(7, 7, 7, 7) if page > 1 else (7,) * 16), O.Extend("c7", pages(7)),
           O.Close("c7"),
           O.Allocate(), O.Extend("c8", pages(4, 1)), O.Retain("c8"),
           O.Allocate(), O.Extend("c9", pages(8, 8, 8, 8) if page > 1 else (8,) * 16), O.Extend("c9", pages(8))]
    run = Lockstep(sglang.factory, _config(name))
    run.run(ops)        # was: InvariantViolation at the last extend, "the reference had room"
    assert "CapacityError" in run.history[-1]       # the refusal itself is checked, both sides refusing
    run.finish()


def test_a_retain_after_pressure_may_take_another_entrys_page_of_the_same_prefix():
    """A sweep (seed 5180, after the fix above): once pressed, entries of one prefix no longer hold one
    page there. ``(1, 0, 0, ...)`` was retained by c7, whose tail SGLang then reclaimed, and by c8 with
    pages of its own; c4's retain of ``(1, 0, 0)`` took c8's pages, where the reference named c7's
    entry's, which c4 already held, so it counted two pages fewer than SGLang held and called its
    refusal of c8's extend wrong."""
    from kvstate.stateful.ops import op_from_json
    from kvstate.stateful.replay import execute

    ops = [{"op": "allocate"}, {"op": "extend", "ctx": "c1", "tokens": [0]}, {"op": "allocate"},
           {"op": "extend", "ctx": "c2", "tokens": [0, 0, 0]}, {"op": "fork", "ctx": "c2"}, {"op": "fork", "ctx": "c3"},
           {"op": "overwrite", "ctx": "c4", "start": 0, "tokens": [1]}, {"op": "allocate"},
           {"op": "extend", "ctx": "c5", "tokens": [1, 1, 1]}, {"op": "fork", "ctx": "c4"},
           {"op": "retain", "ctx": "c5"}, {"op": "fork", "ctx": "c6"}, {"op": "match", "tokens": [1]},
           {"op": "extend", "ctx": "c8", "tokens": [0] * 7}, {"op": "extend", "ctx": "c7", "tokens": [0] * 7},
           {"op": "retain", "ctx": "c7"}, {"op": "close", "ctx": "c7"}, {"op": "extend", "ctx": "c5", "tokens": [0] * 3},
           {"op": "retain", "ctx": "c8"}, {"op": "extend", "ctx": "c6", "tokens": [0] * 4},
           {"op": "retain", "ctx": "c4"}, {"op": "truncate", "ctx": "c8", "n": 0}, {"op": "close", "ctx": "c5"},
           {"op": "extend", "ctx": "c6", "tokens": [0] * 6}, {"op": "extend", "ctx": "c8", "tokens": [0] * 7}]
    failure, lockstep = execute(sglang.factory, _config("token-f32-pool24-reclaim-prefixkv"),
                                [op_from_json({"seed": 0, **op} if op["op"] in ("extend", "overwrite") else op) for op in ops])
    assert failure is None, str(failure)        # was: "the reference had room: 22 pages ... of the pool's 24"
    assert "refused" in next(h for h in reversed(lockstep.history) if h.startswith("extend(ctx='c8'"))  # both sides


def test_sglang_choosing_locked_leaves_to_evict_is_rejected_by_the_full_pool_row(monkeypatch):
    # An audit (s73) left ``lock_ref`` out of SGLang's own ``_update_leaf_status``: an older leaf a request
    # holds was evicted for room and the new page written over its values. ``ci`` passed it at block
    # size 16 (at page 1 only ``seeded`` caught it); the "full pool" row's held entry rejects it.
    tree = sglang_loader.load_radix_cache().RadixCache
    keep_status = tree._update_leaf_status

    def any_leaf_evictable(self, node):
        if node.evicted or node is self.root_node or any(not c.evicted for c in node.children.values()):
            return keep_status(self, node)
        self.evictable_leaves.add(node)
    monkeypatch.setattr(tree, "_update_leaf_status", any_leaf_evictable)
    [result] = conform(sglang.factory, configs=[_config("block16-f32-pool12-reclaim-prefixkv")],
                       checks=["pinned semantics"])
    assert not result.passed and "invariant 4" in result.failure and "runs out" in result.failure, result.failure
