"""Refcount slots go back to the pool in one step a release (``PagePool._give_back``: a mask) and an
extend takes the lowest free ones (``_take_slots``, ``_grow``): every slot is free or holds one live
page, never both, never two; a failure part way takes none; freed slots come back consecutive."""

import numpy as np
import pytest

from kvstate.impl import page_table
from kvstate.impl.cache import Cache
from kvstate.impl.pages import PageAccountingError
from kvstate.spec.layout import Layout

TINY = Layout(1, 1, 1)


def _zeros(n: int) -> np.ndarray:
    return np.zeros(TINY.batch_shape(n), np.float32)


def _accounted(pool) -> None:
    """Live pages' slots and the slots the mask marks free split ``range(_next_ref)`` exactly."""
    live = sorted(page.ref for page in pool.live.values())
    free = np.flatnonzero(pool._free_mask[:pool._next_ref]).tolist()
    assert sorted(live + free) == list(range(pool._next_ref)), (live, free)
    assert pool._free_slots == len(free) and pool.live_count == len(live)
    assert not pool.refcounts[free].any()


def test_a_pool_that_cannot_grow_takes_no_free_slot(monkeypatch):
    """250 slots free, 300 wanted: growing the arrays for the other 50 fails before a free slot is taken."""
    cache = Cache(TINY, page_tokens=1)
    first, second = cache.allocate(), cache.allocate()
    first.extend(list(range(250)), _zeros(250))
    second.extend(list(range(5)), _zeros(5))
    first.close()
    mask, free = cache.pool._free_mask.copy(), cache.pool._free_slots

    def no_memory(table, size):
        raise MemoryError("out of memory")
    monkeypatch.setattr(page_table.PageTable, "grow", no_memory)
    with pytest.raises(MemoryError):
        second.extend(list(range(300)), _zeros(300))
    assert (cache.pool._free_mask == mask).all() and cache.pool._free_slots == free == 250
    _accounted(cache.pool)
    monkeypatch.undo()
    second.extend(list(range(300)), _zeros(300))
    assert len(second) == 305
    _accounted(cache.pool)


def test_a_truncated_context_extended_again_gets_consecutive_slots():
    """A truncate frees its pages in one step: the next extend takes their slots back as a range
    (refcount steps on a range are slices), not as scattered slots."""
    cache = Cache(TINY, page_tokens=1)
    ctx = cache.allocate()
    ctx.extend(list(range(1000)), _zeros(1000))
    ctx.truncate(1)
    assert np.flatnonzero(cache.pool._free_mask).tolist() == list(range(1, 1000))
    ctx.extend(list(range(500)), _zeros(500))
    assert ctx._holding.slots == range(0, 501)
    _accounted(cache.pool)


def test_slots_freed_one_by_one_in_any_order_come_back_as_one_range():
    cache = Cache(TINY, page_tokens=1)
    ctx = cache.allocate()
    ctx.extend(list(range(8)), _zeros(8))
    for index in (5, 3, 4, 2):        # as copy-on-write lets go of the shared pages it replaced, one by one
        cache.pool.release(ctx._pages[index])
    other = cache.allocate()
    other.extend(list(range(4)), _zeros(4))
    assert other._holding.slots == range(2, 6)


def test_a_page_freed_twice_is_refused_and_nothing_changes():
    """A second free would give the slot back twice, and the next two pages would share it."""
    cache = Cache(TINY, page_tokens=1)
    ctx = cache.allocate()
    ctx.extend(list(range(3)), _zeros(3))
    page = ctx._pages[2]
    one = range(page.ref, page.ref + 1)
    cache.pool.books.counts[page.ref] = 0
    cache.pool._free((page,), one)
    mask, freed, spares = cache.pool._free_mask.copy(), cache.pool.freed, len(cache.store._spares)
    with pytest.raises(RuntimeError, match="freed but not live"):
        cache.pool._free((page,), one)
    assert (cache.pool._free_mask == mask).all() and (cache.pool.freed, len(cache.store._spares)) == (freed, spares)


def test_an_extend_takes_the_lowest_free_slots_then_new_ones():
    """Slots from several holes and the pool's end come back in one sorted array (a range where they join)."""
    cache = Cache(TINY, page_tokens=1)
    contexts = [cache.allocate() for _ in range(3)]
    for ctx in contexts:
        ctx.extend(list(range(4)), _zeros(4))
    contexts[0].close()         # slots 0-3
    contexts[2].close()         # slots 8-11
    ctx = cache.allocate()
    ctx.extend(list(range(10)), _zeros(10))      # both runs, then two new slots
    assert sorted(np.asarray(ctx._holding.slots).tolist()) == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13]
    _accounted(cache.pool)


def test_a_failure_after_the_pool_grew_gives_the_new_slots_back(monkeypatch):
    """10 slots free, 20 wanted: the pool grows by 10, then making the slots' list fails; the new slots
    are marked free, the old ones were never taken."""
    from kvstate.impl import pages as pages_module

    cache = Cache(TINY, page_tokens=1)
    first, second = cache.allocate(), cache.allocate()
    first.extend(list(range(10)), _zeros(10))
    second.extend(list(range(1)), _zeros(1))
    first.close()

    def no_memory(ids):
        raise MemoryError("out of memory")
    monkeypatch.setattr(pages_module, "as_run", no_memory)
    with pytest.raises(MemoryError):
        second.extend(list(range(20)), _zeros(20))
    assert cache.pool._free_slots == 20 and len(second) == 1
    _accounted(cache.pool)
    monkeypatch.undo()
    second.extend(list(range(20)), _zeros(20))
    _accounted(cache.pool)


@pytest.mark.parametrize("page_tokens", [1, 4])
def test_an_extend_failing_after_its_pages_are_made_frees_them(monkeypatch, page_tokens):
    """Memory running out between making an extend's pages and listing them in the context's holding
    (joining the slot lists) leaves no page live and no slot taken: the context is as it was."""
    from kvstate.impl import context as context_module

    cache = Cache(TINY, page_tokens=page_tokens)
    ctx = cache.allocate()
    ctx.extend(list(range(6)), _zeros(6))
    before = (cache.pool.live_count, cache.pool._free_slots, cache.pool._next_ref, ctx._holding)

    def no_memory(head, tail):
        raise MemoryError("out of memory")
    monkeypatch.setattr(context_module, "joined_slots", no_memory)
    with pytest.raises(MemoryError):
        ctx.extend(list(range(20)), _zeros(20))
    live, free, next_ref, holding = before
    assert ctx._holding is holding and len(ctx) == 6 and list(ctx.tokens) == list(range(6))
    assert cache.pool.live_count == live and cache.pool._free_slots == free + (cache.pool._next_ref - next_ref)
    _accounted(cache.pool)
    monkeypatch.undo()
    ctx.extend(list(range(20)), _zeros(20))
    assert len(ctx) == 26
    _accounted(cache.pool)


@pytest.mark.parametrize("page_tokens", [1, 4])
def test_an_extend_whose_write_fails_gives_back_the_pages_it_made(monkeypatch, page_tokens):
    """The store failing mid-write (or an interrupt) after the pages are made: they are released as a
    truncate would, so the context lists exactly the pages its length needs and nothing is held."""
    from kvstate.impl import context as context_module
    from kvstate.spec.invariants import check_page_counts, check_structure

    cache = Cache(TINY, page_tokens=page_tokens)
    ctx = cache.allocate()
    ctx.extend(list(range(6)), _zeros(6))
    live = cache.pool.live_count

    def failing_write(self, start, stop, tokens, encoded):
        raise MemoryError("the store ran out")
    monkeypatch.setattr(context_module.Context, "_write", failing_write)
    with pytest.raises(MemoryError):
        ctx.extend(list(range(20)), _zeros(20))
    monkeypatch.undo()
    assert len(ctx) == 6 and list(ctx.tokens) == list(range(6)) and cache.pool.live_count == live
    check_page_counts(cache.observe(), page_tokens)
    check_structure(cache.observe())
    _accounted(cache.pool)
    ctx.extend(list(range(20)), _zeros(20))
    assert len(ctx) == 26 and list(ctx.tokens) == list(range(6)) + list(range(20))


@pytest.mark.parametrize("how", ["one page", "a holder's pages"])
def test_a_release_of_a_page_whose_slot_another_page_took_leaves_that_pages_count(how):
    cache = Cache(TINY, page_tokens=1)
    ctx = cache.allocate()
    ctx.extend([1], _zeros(1))
    pages, slots = list(ctx._pages), ctx._holding.slots
    ctx.close()
    other = cache.allocate()
    other.extend([2], _zeros(1))                          # takes the freed slot
    assert other._holding.slots == slots
    with pytest.raises(PageAccountingError, match="freed before"):
        if how == "one page":
            cache.pool.release(pages[0])
        else:
            cache.pool.release_slots(pages, slots)
    assert cache.pool.books.counts[slots[0]] == 1 and other._pages[0].refcount == 1
    other.close()
    _accounted(cache.pool)


@pytest.mark.parametrize("how", ["one page", "a holder's pages"])
def test_a_release_of_a_page_nobody_holds_is_refused_and_its_count_stays_zero(how):
    """Its slot free, a release once too many used to take the count to -1 with no error."""
    cache = Cache(TINY, page_tokens=1)
    ctx = cache.allocate()
    ctx.extend(list(range(3)), _zeros(3))
    pages, slots = list(ctx._pages), ctx._holding.slots
    ctx.close()                                          # every page freed, every count 0
    counts = cache.pool.books.counts.copy()
    with pytest.raises(PageAccountingError, match="released twice|freed before"):
        if how == "one page":
            cache.pool.release(pages[1])
        else:
            cache.pool.release_slots(pages, slots)
    assert (cache.pool.books.counts == counts).all() and counts[list(slots)].tolist() == [0, 0, 0]
    _accounted(cache.pool)


# Four mutants of the engine (an audit, s74) passed conform and every targeted test: each lives past a size
# or in a slot layout random runs do not reach. Every test below checks the books with the invariants.

def _books_hold(cache: Cache) -> None:
    from kvstate.spec import invariants

    observed = cache.observe()
    invariants.check_refcounts(observed)
    invariants.check_liveness(observed)


def test_two_forks_of_a_long_context_whose_slots_are_not_one_run_count_two_holders():
    # ``add_holders`` past 96 slots (``np.add.at``) added one holder where two forks were pending.
    cache = Cache(TINY, page_tokens=1)
    long = cache.allocate()
    long.extend(list(range(97)), _zeros(97))
    other = cache.allocate()
    other.extend([1], _zeros(1))            # takes the next slot: ``long``'s next one is not beside the rest
    long.extend([1], _zeros(1))
    forks = [long.fork(), long.fork()]      # two counts pending on one holding of 98 scattered slots
    _books_hold(cache)
    assert all(page.refcount == 3 for page in long._pages), [page.refcount for page in long._pages]
    for ctx in (*forks, other, long):
        ctx.close()
    _accounted(cache.pool)


@pytest.mark.parametrize("live", [256, 512, 1024])
def test_the_books_grow_when_every_slot_is_live(live):
    # The books' arrays doubled with their last slot's count left behind: only where every slot was live.
    cache = Cache(TINY, page_tokens=1)
    full = cache.allocate()
    full.extend(list(range(live)), _zeros(live))
    one_more = cache.allocate()
    one_more.extend([1], _zeros(1))
    _books_hold(cache)
    full.close()
    one_more.close()
    _accounted(cache.pool)


def test_an_extend_past_the_first_window_of_free_slots_takes_each_slot_once():
    # ``_take_slots`` scans 4,096 slots at a time; its second window started over at the first one's width.
    rng = np.random.default_rng(0)

    def values(n):
        return rng.standard_normal(TINY.batch_shape(n)).astype(np.float32)
    cache = Cache(TINY, page_tokens=1)
    first, second = cache.allocate(), cache.allocate()
    first.extend([1], values(1))
    second.extend([2], values(1))
    long = cache.allocate()
    long.extend(list(range(4200)), values(4200))
    long.truncate(4094)                     # the free slots: 4,096 on
    second.close()                          # and slot 1, taken again next: the lowest free is then 2
    cache.allocate().extend([3], values(1))
    new = cache.allocate()
    written = values(50)
    new.extend(list(range(50)), written)
    read, tokens = new.read()
    assert list(tokens) == list(range(50)) and np.array_equal(read, written)
    _books_hold(cache)
    _accounted(cache.pool)


def test_closing_a_context_whose_fork_shares_some_of_its_pages_frees_only_its_own():
    # ``release_slots`` freed the right pages of a run at the wrong slots where the run did not start at 0.
    cache = Cache(TINY, page_tokens=1)
    first = cache.allocate()
    first.extend([1], _zeros(1))            # slot 0: the next context's run starts at 1
    parent = cache.allocate()
    parent.extend([0, 1, 2, 3], _zeros(4))
    child = parent.fork()
    child.overwrite(1, [9], _zeros(1))
    child.overwrite(3, [9], _zeros(1))      # the parent's pages 1 and 3 are its own now, 0 and 2 shared
    parent.close()
    _books_hold(cache)
    _accounted(cache.pool)
    assert child.read()[1].tolist() == [0, 9, 2, 9]
