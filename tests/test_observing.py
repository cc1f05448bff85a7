"""``Cache.observe``'s page views (``impl/observing.py``) reuse the last observation's views only
where a page is unchanged: every change to a refcount, a slot or a tail still shows."""

from __future__ import annotations

import numpy as np
import pytest

from kvstate.impl import Cache
from kvstate.spec.layout import Layout

LAYOUT = Layout(layers=1, kv_heads=1, head_dim=2)


def values(n: int) -> np.ndarray:
    return np.ones(LAYOUT.batch_shape(n), np.float32)


def refcounts(cache: Cache) -> list[int]:
    return [page.refcount for page in cache.observe().pages.values()]


def test_a_refcount_change_shows_in_the_next_observation():
    cache = Cache(LAYOUT, page_tokens=2)
    ctx = cache.allocate()
    ctx.extend([1, 2], values(2))
    assert refcounts(cache) == [1]
    fork = ctx.fork()
    assert refcounts(cache) == [2]
    fork.close()
    assert refcounts(cache) == [1]


def test_a_tail_dirtied_behind_the_cache_shows_in_the_next_observation():
    cache = Cache(LAYOUT, page_tokens=4, arena_pages=2)
    ctx = cache.allocate()
    ctx.extend([1], values(1))
    (before,) = cache.observe().pages.values()
    assert not before.dirty_tail
    (array,) = ctx._pages[0].buffer.arrays
    array[:, :, 3] = 7.0        # a byte past the page's filled mark
    (after,) = cache.observe().pages.values()
    assert after.dirty_tail and after.slot == before.slot


def test_an_unchanged_page_keeps_its_view():
    cache = Cache(LAYOUT, page_tokens=2)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3], values(3))
    first, second = cache.observe().pages, cache.observe().pages
    assert first == second and all(first[pid] is second[pid] for pid in first)


def test_liveness_names_the_holder_and_place_of_a_freed_page():
    from kvstate.spec.errors import InvariantViolation
    from kvstate.spec.invariants import check_liveness
    from kvstate.spec.observation import Observation, PageView

    pages = {1: PageView(1, 2, None), 2: PageView(2, 1, None, freed=True)}
    obs = Observation(pages=pages, holders={"ctx:0": (1,), "ctx:1": (1, 2, 3)}, lengths=None,
                      pages_allocated=2, pages_freed=0, arena_size=None, arena_out={}, arena_free=(),
                      tree=None, entries=None)
    with pytest.raises(InvariantViolation, match=r"ctx:1 page list\[1\] points at freed page 2") as caught:
        check_liveness(obs)
    assert caught.value.invariant == 2


def test_page_counts_hold_for_the_engine_and_name_a_holder_with_pages_past_its_length():
    """Invariant 2's page count: every holder lists exactly ``pages_needed(length)`` pages; the engine
    keeps it through extend, fork, truncate and retain, and a page kept past a truncate is named."""
    from kvstate.spec.errors import InvariantViolation
    from kvstate.spec.invariants import check_page_counts
    from kvstate.stateful.planted import PLANTED

    def drive(cache):
        ctx = cache.allocate()
        ctx.extend([1, 2, 3, 4, 5], values(5))
        fork = ctx.fork()
        cache.retain(ctx)
        ctx.truncate(3)
        fork.truncate(0)
        check_page_counts(cache.observe(), 2)
        hit, matched = cache.match([1, 2, 3, 4, 5, 6])
        assert matched == 5
        hit.truncate(1)
        return cache.observe()

    check_page_counts(drive(Cache(LAYOUT, page_tokens=2)), 2)
    with PLANTED["truncate_releases_nothing"]():
        with pytest.raises(InvariantViolation, match=r"lists 3 pages for its 3 positions, which need 2 at 2 a "
                                                     r"page: pages past its length are still held") as caught:
            drive(Cache(LAYOUT, page_tokens=2))
    assert caught.value.invariant == 2


def test_page_counts_name_positions_without_a_page():
    from kvstate.spec.errors import InvariantViolation
    from kvstate.spec.invariants import check_page_counts
    from kvstate.spec.observation import Observation, PageView

    obs = Observation(pages={1: PageView(1, 1, None)}, holders={"entry:4": (1,)}, lengths={"entry:4": 5},
                      pages_allocated=1, pages_freed=0, arena_size=None, arena_out={}, arena_free=(),
                      tree=None, entries=None)
    check_page_counts(obs, 8)
    with pytest.raises(InvariantViolation, match=r"entry:4 lists 1 page for its 5 positions, which need 3 at 2 a "
                                                 r"page: positions without a page"):
        check_page_counts(obs, 2)
