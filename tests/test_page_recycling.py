"""Heap pages are recycled: a freed page's buffer goes to the NumPy store's spares (up to
``SPARE_BYTES``) and the next allocation, copy-on-write clone or restore takes it, zeroed where a
zeroed page is promised, instead of faulting fresh memory in (pages of 2 MiB or more) or making
and dropping arrays a page (one-token pages). A buffer something still holds is never reused."""

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
        old = id(first._pages[0].buffer.arrays[0])      # an id: an array held here would not be reused
    assert [id(buffer.arrays[0]) for buffer in cache.store._spares] == [old]
    with cache.allocate() as second:
        second.extend([7], values(BIG, 1, seed=1))
        assert id(second._pages[0].buffer.arrays[0]) == old      # reused, not faulted in anew
        assert cache.store.is_zero_from(second._pages[0].buffer, 1)
        np.testing.assert_array_equal(second.read()[0], values(BIG, 1, seed=1))
    assert cache.store._spares and cache.stats()["live_pages"] == 0


def test_a_copy_on_write_clone_takes_a_spare_and_holds_its_sources_bytes():
    cache = Cache(BIG, page_tokens=BIG_PAGE)
    with cache.allocate() as scratch:
        scratch.extend(list(range(2 * BIG_PAGE)), values(BIG, 2 * BIG_PAGE, seed=2))
    spares = [id(buffer.arrays[0]) for buffer in cache.store._spares]
    assert len(spares) == 2
    parent = cache.allocate()
    parent.extend(list(range(10)), values(BIG, 10))
    child = parent.fork()
    child.overwrite(3, [99], values(BIG, 1, seed=3))             # clones the shared page
    assert {id(parent._pages[0].buffer.arrays[0]), id(child._pages[0].buffer.arrays[0])} == set(spares)
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


def test_small_pages_are_recycled_too_and_come_back_zeroed():
    small = Layout(layers=2, kv_heads=2, head_dim=8)
    cache = Cache(small, page_tokens=4)
    with cache.allocate() as ctx:
        ctx.extend(list(range(8)), values(small, 8))      # two full pages, every byte non-zero
        first = [id(page.buffer) for page in ctx._pages]      # ids: a buffer held here would not be reused
    assert list(map(id, cache.store._spares)) == first    # both pages' buffers, kept whole
    with cache.allocate() as ctx:
        ctx.extend([5, 6], values(small, 2, seed=1))
        (page,) = ctx._pages
        assert id(page.buffer) == first[-1]       # the last freed, taken first
        assert cache.store.is_zero_from(page.buffer, 2)        # its old bytes from 2 on are gone
        np.testing.assert_array_equal(ctx.read()[0], values(small, 2, seed=1))


def test_one_token_pages_reuse_every_freed_buffer():
    """At one-token pages an eviction frees hundreds of pages and the next extend makes as many: the
    extend takes the freed buffers instead of making new arrays (``bench/bounded_vs_sglang.py``)."""
    small = Layout(1, 1, 1)
    cache = Cache(small, page_tokens=1)
    made = []
    fresh = numpy_store.NumpyStore._fresh_buffer
    cache.store._fresh_buffer = lambda zero: made.append(zero) or fresh(cache.store, zero)     # new arrays
    ctx = cache.allocate()
    ctx.extend(list(range(300)), values(small, 300))
    assert len(made) == 300 and cache.store._spares == []
    ctx.close()
    assert len(cache.store._spares) == 300
    ctx = cache.allocate()
    ctx.extend(list(range(200)), values(small, 200, seed=1))
    assert len(made) == 300 and len(cache.store._spares) == 100      # every page a freed one
    np.testing.assert_array_equal(ctx.read()[0], values(small, 200, seed=1))
    ctx.close()


def test_a_buffer_something_still_holds_is_dropped_not_reused():
    """A freed page still listed somewhere (a caller kept the ``Page``), or whose arrays a view still
    sees, keeps its buffer: the next allocation makes a new one, and what the holder sees stays put."""
    small = Layout(1, 1, 1)
    cache = Cache(small, page_tokens=2)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3], values(small, 3))
    kept_page = ctx._pages[0]
    view = ctx._pages[1].buffer.arrays[0][:, :, :1]
    seen = kept_page.buffer.arrays[0].copy(), view.copy()
    ctx.close()
    assert len(cache.store._spares) == 2
    ctx = cache.allocate()
    ctx.extend([4, 5, 6], values(small, 3, seed=1))
    assert not {id(page.buffer) for page in ctx._pages} & {id(kept_page.buffer)}
    assert cache.store._spares == []
    np.testing.assert_array_equal(kept_page.buffer.arrays, ())          # dropped, as a freed page always was
    np.testing.assert_array_equal(view, seen[1])
    np.testing.assert_array_equal(ctx.read()[0], values(small, 3, seed=1))
    ctx.close()


@pytest.mark.parametrize("missing", ["free_all", "allocate_all", "write_whole"])
def test_a_page_store_without_a_batch_method_still_makes_writes_and_frees_every_page(missing):
    """The pool and contexts call a store's batch methods where it has them, and its per-page ones
    (``free``, ``allocate``, ``write``) where it was written before them."""
    small = Layout(1, 1, 1)
    cache = Cache(small, page_tokens=2, store=StoreWithout(numpy_store.NumpyStore(small, 2, "f32", 4), missing))
    assert not hasattr(cache.store, missing)
    ctx = cache.allocate()
    ctx.extend(list(range(11)), values(small, 11))       # 6 pages: 4 in the arena, 2 on the heap
    np.testing.assert_array_equal(ctx.read()[0], values(small, 11))
    assert cache.store.counters.heap_pages == 2 and cache.stats()["live_pages"] == 6
    ctx.close()
    obs = cache.observe()
    check_empty(obs)
    assert obs.pages_freed == 6


def test_pages_made_in_one_call_past_a_full_arena_are_counted_as_page_by_page():
    """``allocate_all`` skips ``_take`` a page where no slot is free; the counters say what ``issue``
    would have said of each page (a heap page, and a fallback since there is an arena)."""
    small = Layout(1, 1, 1)
    cache = Cache(small, page_tokens=1, arena_pages=2)
    ctx = cache.allocate()
    ctx.extend([1, 2], values(small, 2))       # the arena's two slots, page by page
    ctx.extend([3, 4, 5], values(small, 3, seed=1))     # the arena full: one call for three heap pages
    counters = cache.store.counters
    assert (counters.arena_issued, counters.heap_pages, counters.heap_fallbacks) == (2, 3, 3)
    assert [page.buffer.slot for page in ctx._pages] == [0, 1, None, None, None]
    ctx.close()


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


@pytest.mark.parametrize("page_tokens", [4, BIG_PAGE])       # arrays of their own; views of a 2 MiB block
@pytest.mark.parametrize("held", ["buffer", "tuple", "array", "view"])
def test_a_freed_buffer_is_not_reused_while_anything_of_it_is_held(page_tokens, held):
    store = numpy_store.NumpyStore(BIG, page_tokens, "f32")
    buffer = store.allocate(1)
    keep = {"buffer": buffer, "tuple": buffer.arrays, "array": buffer.arrays[0],
            "view": buffer.arrays[0][:, :1]}[held]
    store.free(buffer)
    del buffer
    assert store._spare() is None and store._spares == []
    del keep
    store.free(store.allocate(2))
    assert store._spare() is not None          # the same store reuses what nothing holds
    assert numpy_store._reuse_is_safe()        # and the import-time probe of this interpreter agrees


def test_spares_of_tiny_pages_are_budgeted_by_their_objects_too(monkeypatch):
    """A one-token page of a 1x1x1 layout stores 8 bytes, but its kept buffer costs some 400 in
    objects: the budget counts each at ``SPARE_OVERHEAD`` at least, not at its 8 bytes."""
    monkeypatch.setattr(numpy_store, "SPARE_BYTES", 10 * numpy_store.SPARE_OVERHEAD)
    small = Layout(1, 1, 1)
    cache = Cache(small, page_tokens=1)
    ctx = cache.allocate()
    ctx.extend(list(range(30)), values(small, 30))
    ctx.close()
    assert len(cache.store._spares) == 10 and cache.observe().pages_freed == 30


def test_a_heap_page_freed_twice_is_kept_once():
    store = numpy_store.NumpyStore(BIG, BIG_PAGE, "f32")
    buffer = store.allocate(1)
    store.free(buffer)
    store.free(buffer)
    assert store._spares == [buffer]
    kept, buffer = id(buffer), None       # held here, it would not be reused
    assert id(store.allocate(2)) == kept and store._spares == []


def test_a_batch_freed_twice_without_an_arena_never_hands_a_buffer_out_twice():
    """Without an arena ``free_all`` keeps a batch whole, marking no buffer: one listed twice (a second
    free, which the pool refuses before it reaches the store) is then dropped, never given to two pages."""
    store = numpy_store.NumpyStore(Layout(1, 1, 1), 1, "f32")
    one, two = store.allocate_all(1, 2)
    store.free_all([one, two])
    store.free_all([one])
    assert len(store._spares) == 3
    one = two = None        # noqa: F841 - held here, neither would be reused
    made = store.allocate_all(3, 3)
    assert len({id(buffer.arrays[0]) for buffer in made}) == 3 and store._spares == []


def test_a_holder_listing_a_page_twice_is_named_so():
    """An audit (s66) read "page 0 has refcount 1 but 2 holders ['ctx:2 (c4)']": one holder, listing it twice."""
    from kvstate.spec.errors import InvariantViolation
    from kvstate.spec.observation import Observation, PageView

    obs = Observation(pages={0: PageView(0, 1, None)}, holders={"ctx:2": (0, 0), "ctx:3": (1,)},
                      lengths={"ctx:2": 2, "ctx:3": 1}, pages_allocated=2, pages_freed=0, arena_size=None,
                      arena_out={}, arena_free=(), tree=None, entries=None)
    with pytest.raises(InvariantViolation, match=r"refcount 1 but 2 holders \['ctx:2, 2 times'\]"):
        check_refcounts(obs)
