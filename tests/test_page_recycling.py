"""Heap pages of 2 MiB or more are recycled: a freed page's arrays go to the NumPy store's spares
(up to ``SPARE_BYTES``) and the next allocation or copy-on-write clone takes them, zeroed where a
zeroed page is promised, instead of faulting fresh memory in. Smaller pages are left to malloc."""

import numpy as np
import pytest

from kvstate.impl import numpy_store
from kvstate.impl.cache import Cache
from kvstate.spec.invariants import check_empty, check_liveness, check_refcounts
from kvstate.spec.layout import Layout

from helpers import StoreWithout

BIG = Layout(layers=2, kv_heads=16, head_dim=64)     # 16 KiB a position at f32: 2 MiB pages at 128 tokens
BIG_PAGE = 128


def values(layout, n, seed=0):
    return np.random.default_rng(seed).standard_normal(layout.batch_shape(n)).astype(np.float32) + 3


def test_a_freed_page_is_the_next_allocation_and_comes_back_zeroed():
    cache = Cache(BIG, page_tokens=BIG_PAGE)
    with cache.allocate() as first:
        first.extend(list(range(BIG_PAGE)), values(BIG, BIG_PAGE))
        old = first._pages[0].buffer.arrays[0]
    assert [arrays[0] is old for arrays in cache.store._spares] == [True]
    with cache.allocate() as second:
        second.extend([7], values(BIG, 1, seed=1))
        assert second._pages[0].buffer.arrays[0] is old          # reused, not faulted in anew
        assert cache.store.is_zero_from(second._pages[0].buffer, 1)
        np.testing.assert_array_equal(second.read()[0], values(BIG, 1, seed=1))
    assert cache.store._spares and cache.stats()["live_pages"] == 0


def test_a_copy_on_write_clone_takes_a_spare_and_holds_its_sources_bytes():
    cache = Cache(BIG, page_tokens=BIG_PAGE)
    with cache.allocate() as scratch:
        scratch.extend(list(range(2 * BIG_PAGE)), values(BIG, 2 * BIG_PAGE, seed=2))
    spares = [arrays[0] for arrays in cache.store._spares]
    assert len(spares) == 2
    parent = cache.allocate()
    parent.extend(list(range(10)), values(BIG, 10))
    child = parent.fork()
    child.overwrite(3, [99], values(BIG, 1, seed=3))             # clones the shared page
    assert {id(parent._pages[0].buffer.arrays[0]), id(child._pages[0].buffer.arrays[0])} == set(map(id, spares))
    reference = values(BIG, 10)
    np.testing.assert_array_equal(parent.read()[0], reference)
    reference[3] = values(BIG, 1, seed=3)[0]
    np.testing.assert_array_equal(child.read()[0], reference)
    assert cache.store.is_zero_from(child._pages[0].buffer, 10)   # the clone copied the zero tail too
    parent.close()
    child.close()


def test_spares_stay_within_their_byte_budget(monkeypatch):
    monkeypatch.setattr(numpy_store, "SPARE_BYTES", 3 * (2 << 20))
    cache = Cache(BIG, page_tokens=BIG_PAGE)
    contexts = []
    for seed in range(6):
        ctx = cache.allocate()
        ctx.extend(list(range(BIG_PAGE)), values(BIG, BIG_PAGE, seed=seed))
        contexts.append(ctx)
    for ctx in contexts:
        ctx.close()
    assert len(cache.store._spares) == 3


def test_small_pages_are_left_to_malloc():
    small = Layout(layers=2, kv_heads=2, head_dim=8)
    cache = Cache(small, page_tokens=4)
    with cache.allocate() as ctx:
        ctx.extend(list(range(9)), values(small, 9))
    assert cache.store._spares == []


# The lockstep machine with every page recycled is tests/test_lockstep.py's (one run per
# configuration checks the semantics and the recycling together).


def test_small_pages_are_let_go_without_a_sharing_test_and_a_restores_are_still_kept(monkeypatch, tmp_path):
    """A small heap page owns its arrays (``np.zeros``, no ``base``): it can never be a spare, and its
    free skips ``_unshared`` (most of a free at one-token pages). A restore's pages of any size are
    views of a block, so they are still tested, and kept."""
    tested = []
    real = numpy_store._unshared
    monkeypatch.setattr(numpy_store, "_unshared", lambda arrays: tested.append(arrays) or real(arrays))
    small = Layout(1, 1, 1)
    cache = Cache(small, page_tokens=1)
    ctx = cache.allocate()
    ctx.extend(list(range(300)), values(small, 300))
    ctx.snapshot(tmp_path / "small.kvs")
    ctx.close()
    assert cache.pool.freed == 300 and tested == [] and cache.store._spares == []
    cache.restore(tmp_path / "small.kvs").close()
    assert cache.pool.freed == 600 and len(tested) == 300 and len(cache.store._spares) == 300


def test_a_page_store_without_free_all_still_frees_every_page():
    small = Layout(1, 1, 1)
    cache = Cache(small, page_tokens=2, store=StoreWithout(numpy_store.NumpyStore(small, 2, "f32", 4), "free_all"))
    assert not hasattr(cache.store, "free_all")
    ctx = cache.allocate()
    ctx.extend(list(range(11)), values(small, 11))       # 6 pages: 4 in the arena, 2 on the heap
    ctx.close()
    obs = cache.observe()
    check_empty(obs)
    assert obs.pages_freed == 6


@pytest.mark.parametrize("store", ["numpy", "torch"])
def test_an_interrupt_part_way_through_a_free_costs_at_most_the_slot_it_hit(monkeypatch, store):
    """The store fails on the third of ten pages (as an asynchronous exception would): the context is
    closed, every page let go (the store frees the rest before re-raising) and the pool's books agree;
    only the slot whose give-back was cut short stays out, as a free cut short always could."""
    small = Layout(1, 1, 1)
    if store == "torch":
        pytest.importorskip("torch")
    cache = Cache(small, page_tokens=1, arena_pages=64, store=store)
    ctx = cache.allocate()
    ctx.extend(list(range(10)), values(small, 10))
    arena, calls = cache.store._arena, []
    real = arena.give_back

    def give_back(slot):
        calls.append(slot)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(slot)
    monkeypatch.setattr(arena, "give_back", give_back)
    with pytest.raises(KeyboardInterrupt):
        ctx.close()
    monkeypatch.undo()
    obs = cache.observe()
    check_refcounts(obs)
    check_liveness(obs)
    assert ctx.closed and len(calls) == 10 and obs.pages_freed == 10 and not obs.pages and not obs.holders
    assert sorted(obs.arena_out) == [calls[2]]      # the one slot whose give-back was interrupted
    assert len(obs.arena_free) == 63


def test_a_heap_page_freed_twice_is_never_kept_as_an_empty_spare(monkeypatch):
    monkeypatch.setattr(numpy_store, "RECYCLE_FROM_BYTES", 0)       # every page is a candidate spare
    store = numpy_store.NumpyStore(BIG, BIG_PAGE, "f32")
    buffer = store.allocate(1)
    store.free(buffer)
    store.free(buffer)
    assert [len(arrays) for arrays in store._spares] == [1]
