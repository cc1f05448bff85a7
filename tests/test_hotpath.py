"""The hot paths' fast routes agree with the slow ones they replace (issue 15, item 3).

- ``check_tokens`` on a list takes one vectorised route; whatever it refuses is named by
  the element-by-element check, so every bad input gets the error it always got.
- Refcounts live in one array indexed by page id and each context carries its page ids:
  after any sequence of operations the ids are its pages' ids and each refcount is the
  number of holders (the invariants check the latter through ``observe``).
- ``retain`` takes its key from the context's packed key, kept by every write: the key
  must be the tokens the pages hold.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstate.impl import Cache
from kvstate.impl import query
from kvstate.impl.query import packed_query
from kvstate.impl.radix import pack
from kvstate.spec.errors import DTypeError, TokenError
from kvstate.spec.invariants import check_structure
from kvstate.spec.layout import Layout, _name_bad_token, check_tokens

TINY = Layout(1, 1, 1)

BAD_LISTS = [
    [1, True], [np.True_, 2], [1, 2.0], [np.array(5)], [3, np.array([5])], [2**63], [2**64 + 1], [-1],
    [5, -(2**63) - 1], [2**31], [1, np.uint64(2**64 - 1)], [1, None], ["a"], [[1]], [1, 2**70, -3],
    [np.int64(-4)], [np.float32(3)], [b"x"],
]


@pytest.mark.parametrize("items", BAD_LISTS, ids=repr)
def test_a_bad_list_gets_the_error_the_element_check_names(items):
    with pytest.raises((DTypeError, TokenError)) as slow:
        _name_bad_token(list(items))
    with pytest.raises(type(slow.value)) as fast:
        check_tokens(items)
    assert str(fast.value) == str(slow.value)
    with pytest.raises(type(slow.value)):
        check_tokens(tuple(items))


# Bools and big ints whose marshal records balance in length (1 byte each against 11): only the
# tag check tells them from small ints.
BALANCED = [[2**40, 2**40, True, True, True], [5, 2**45, False, 2**33, True, True, False, 9]]


@pytest.mark.parametrize("route", ["marshal", "array"])
@pytest.mark.parametrize("items", BAD_LISTS + BALANCED, ids=repr)
def test_a_lookups_packed_route_refuses_a_bad_list_with_the_named_error(items, route, monkeypatch):
    monkeypatch.setattr(query, "_MARSHAL", route == "marshal")
    assert query._from_marshal(list(items)) is None and query._from_array(list(items)) is None
    with pytest.raises((DTypeError, TokenError)) as slow:
        _name_bad_token(list(items))
    with pytest.raises(type(slow.value)) as fast:
        packed_query(list(items))
    assert str(fast.value) == str(slow.value)


def test_the_marshal_route_reads_this_pythons_format():
    assert query._MARSHAL      # else lists take the two-pass route: correct, slower


@pytest.mark.parametrize("items", [[-1], [2**31], [5, -(2**62)], [2**62], [0, 2**31 + 7]], ids=repr)
def test_a_lookups_packed_route_refuses_a_bad_int64_array_with_the_named_error(items):
    with pytest.raises(TokenError) as slow:
        check_tokens(np.array(items, np.int64))
    with pytest.raises(TokenError) as fast:
        packed_query(np.array(items, np.int64))
    assert str(fast.value) == str(slow.value)


@pytest.mark.parametrize("items", [[0, 2**31 - 1, 5], [], [7], list(range(1000)), [np.int64(4), 2, np.uint8(3)]],
                         ids=repr)
def test_a_lookups_packed_route_packs_a_good_list_as_its_checked_array(items):
    assert packed_query(np.array(items, np.int64))[0] == pack(check_tokens(items))
    if all(type(t) is int for t in items):
        assert query._from_marshal(items) == query._from_array(items) == pack(check_tokens(items))
    packed, checked = packed_query(items)
    assert packed == pack(check_tokens(items))
    assert checked is None or checked.tolist() == [int(t) for t in items]


def test_a_good_list_of_mixed_int_kinds_is_its_int64_array():
    items = [np.int8(5), 3, np.uint32(7), np.uint64(2**31 - 1), 0]
    array = check_tokens(items)
    assert array.dtype == np.int64 and array.tolist() == [5, 3, 7, 2**31 - 1, 0]
    assert check_tokens([]).dtype == np.int64 and check_tokens([]).size == 0


def _check_books(cache: Cache) -> None:
    """Every holder's page ids are its pages' ids, its kept key is its pages' tokens, and the
    refcount array agrees with the holders (invariants 1-2 through ``observe``)."""
    holders = list(cache._contexts.values()) + [node.value for node in cache.tree.entries()]
    for ctx in holders:
        assert list(ctx._slots) == [page.ref for page in ctx._pages]
        assert list(ctx._base_slots) == [page.ref for page in ctx._base]
        assert ctx._packed_key() == pack(ctx._tokens())
    check_structure(cache.observe())


@pytest.mark.parametrize("page_tokens", [1, 3])
def test_ref_slots_and_kept_keys_follow_every_operation(page_tokens):
    rng = np.random.default_rng(page_tokens)
    cache = Cache(TINY, page_tokens=page_tokens, max_entries=4, match="token")
    live = [cache.allocate()]

    def kv(n):
        return rng.standard_normal((n, *TINY.position_shape)).astype(np.float32)

    for _step in range(400):
        ctx = live[rng.integers(len(live))]
        op = rng.integers(7)
        if op == 0:
            n = int(rng.integers(0, 7))
            ctx.extend(rng.integers(0, 5, n).tolist(), kv(n))
        elif op == 1 and len(live) < 8:
            live.append(ctx.fork())
        elif op == 2 and len(ctx):
            start = int(rng.integers(len(ctx)))
            n = int(rng.integers(1, len(ctx) - start + 1))
            ctx.overwrite(start, rng.integers(0, 5, n), kv(n))
        elif op == 3:
            ctx.truncate(int(rng.integers(len(ctx) + 1)))
        elif op == 4 and len(ctx):
            cache.retain(ctx)
        elif op == 5 and len(live) < 8:
            hit, _matched = cache.match(rng.integers(0, 5, int(rng.integers(1, 12))))
            live.append(hit)
        elif op == 6 and len(live) > 1:
            live.remove(ctx)
            ctx.close()
        _check_books(cache)
    cache.clear()
    for ctx in live:
        ctx.close()
    assert cache.stats()["live_pages"] == 0


def test_a_restored_context_retains_under_its_tokens(tmp_path):
    cache = Cache(TINY, page_tokens=2)
    ctx = cache.allocate()
    ctx.extend([4, 5, 6], np.ones((3, *TINY.position_shape), np.float32))
    ctx.snapshot(tmp_path / "s.kv")
    restored = cache.restore(tmp_path / "s.kv")
    cache.retain(restored)
    assert [node.key() for node in cache.tree.entries()] == [(4, 5, 6)]
    _check_books(cache)


def test_a_fork_of_32_pages_bumps_their_refcounts_in_the_array():
    cache = Cache(TINY, page_tokens=2)
    ctx = cache.allocate()
    ctx.extend(list(range(64)), np.zeros((64, *TINY.position_shape), np.float32))
    forks = [ctx.fork() for _ in range(3)]
    slots = [page.ref for page in ctx._pages]
    assert cache.pool.refcounts[slots].tolist() == [4] * 32 and all(p.refcount == 4 for p in ctx._pages)
    for fork in forks:
        fork.close()
    ctx.close()
    assert cache.pool.refcounts[slots].tolist() == [0] * 32 and cache.stats()["live_pages"] == 0


def _holding_agrees(ctx) -> None:
    """A holding's parts agree: the slots are its pages' slots, the base a prefix of the pages (the
    very objects) with its own slots, and the pages exactly the ones the length needs."""
    held = ctx._holding
    assert list(held.slots) == [page.ref for page in held.pages]
    assert held.pages[:len(held.base)] == held.base and all(a is b for a, b in zip(held.base, held.pages))
    assert list(held.base_slots) == [page.ref for page in held.base]
    assert len(held.pages) == -(-held.length // ctx.page_tokens)


def test_a_fork_holds_its_parents_holding_and_every_change_replaces_it_whole():
    """``Context.fork`` copies one reference: the child holds the very same ``Holding``, which
    nothing changes in place but its pending fork count. Whatever either of them does next builds
    a new holding for itself and leaves the other's as it was, each agreeing with itself."""
    cache = Cache(TINY, page_tokens=2, match="token")
    values = np.zeros((8, *TINY.position_shape), np.float32)
    ctx = cache.allocate()
    ctx.extend(list(range(5)), values[:5])                     # 3 pages, the last half full
    fork = ctx.fork()
    assert fork._holding is ctx._holding and ctx._holding.forks == 1
    before = ctx._holding
    parts = (before.pages, before.slots, before.length, before.key)
    ctx.extend([5], values[:1])                                 # a write into the shared last page: copied
    fork.truncate(3)
    ctx.overwrite(0, [9], values[:1])                           # the shared first page: copied
    assert (before.pages, before.slots, before.length, before.key) == parts
    assert fork._holding is not before and ctx._holding is not before
    for context in (ctx, fork):
        _holding_agrees(context)
    assert ctx.tokens == [9, 1, 2, 3, 4, 5] and fork.tokens == [0, 1, 2]
    assert [page.refcount for page in ctx._pages] == [1, 2, 1]
    cache.retain(fork)
    hit, matched = cache.match([0, 1, 2, 3])                    # the entry's whole length: its holding too
    short, short_matched = cache.match([0, 1, 7])               # a prefix of it: a holding of its own
    assert (matched, short_matched) == (3, 2) and hit._holding is fork._holding
    assert short._holding is not fork._holding and short._pages == fork._pages[:1]
    for context in (hit, short, fork):
        _holding_agrees(context)
    for context in (ctx, fork, hit, short):
        context.close()
    cache.clear()
    assert cache.stats()["live_pages"] == 0 and not cache.pool.refcounts.any()


def test_forks_closed_before_any_count_is_read_touch_no_refcount_and_reads_are_exact(monkeypatch):
    """A fork is one pending count on the holding it shares (``refcounts.Refcounts``); closing a fork of
    it takes that count back; anything reading a count gets every pending share added first."""
    from kvstate.impl.refcounts import Refcounts

    cache = Cache(TINY, page_tokens=2)
    ctx = cache.allocate()
    ctx.extend(list(range(64)), np.zeros((64, *TINY.position_shape), np.float32))
    flushes = []
    monkeypatch.setattr(Refcounts, "flush", lambda self, real=Refcounts.flush: (flushes.append(1), real(self)))
    for _ in range(3):
        for fork in [ctx.fork() for _ in range(8)]:
            fork.close()
    assert flushes == []
    forks = [ctx.fork() for _ in range(5)]
    hit = ctx.fork()
    assert [p.refcount for p in ctx._pages] == [7] * 32 and len(flushes) == 1      # one flush for the holding
    for fork in forks + [hit]:
        fork.close()
    ctx.close()
    assert cache.stats()["live_pages"] == 0


def test_the_refcount_array_is_as_long_as_the_most_pages_ever_live_not_as_pages_ever_made():
    """Page ids only grow (they are identities); refcount slots are recycled, so a serving loop
    that allocates and frees pages for ever keeps a bounded array."""
    cache = Cache(TINY, page_tokens=2)
    for _ in range(2000):
        ctx = cache.allocate()
        ctx.extend(list(range(8)), np.zeros((8, *TINY.position_shape), np.float32))   # 4 pages
        ctx.close()
    assert cache.stats()["pages_allocated"] == 8000
    assert len(cache.pool.refcounts) <= 256          # its first size: 4 pages were ever live at once
    ctx = cache.allocate()
    ctx.extend(list(range(8)), np.zeros((8, *TINY.position_shape), np.float32))
    assert [page.ref for page in ctx._pages] == [0, 1, 2, 3]     # the run the close freed, taken back whole


def test_a_whole_fork_or_hit_shares_its_source_page_tuple_and_a_write_replaces_only_its_own():
    """The page list is a tuple never changed in place: a fork or hit holding every page of its
    source shares the tuple itself (no k references copied); a write through it rebinds its own."""
    cache = Cache(TINY, page_tokens=1, max_entries=4)
    ctx = cache.allocate()
    ctx.extend(list(range(8)), np.zeros((8, *TINY.position_shape), np.float32))
    fork = ctx.fork()
    cache.retain(ctx)
    hit, matched = cache.match(list(range(8)) + [99])
    entry = next(cache.tree.entries()).value
    assert matched == 8 and fork._pages is ctx._pages and hit._pages is entry._pages is ctx._pages
    before = ctx._pages
    fork.overwrite(3, [42], np.ones((1, *TINY.position_shape), np.float32))
    assert ctx._pages is before and fork._pages is not before
    assert [p.page_id for p in fork._pages] != [p.page_id for p in before]
    assert ctx.tokens == list(range(8)) and fork.tokens[3] == 42
    for c in (fork, hit, ctx):
        c.close()
    _check_books(cache)


def _retained_prompt():
    """A token-matching cache at one-token pages holding one entry: a 4-token prompt and a turn."""
    cache = Cache(TINY, page_tokens=1, max_entries=8, match="token")
    zeros = np.zeros((12, *TINY.position_shape), np.float32)
    prompt = list(range(4))
    first = cache.allocate()
    first.extend(prompt + [10, 11], zeros[:6])
    cache.retain(first)
    return cache, zeros, prompt, first


def test_hits_at_a_shared_prefix_share_one_prefix_tuple_and_a_write_below_it_drops_it():
    """A hit at the system prompt's length from an entry that extended that very hit takes the
    entry's kept prefix tuple (``Context._base``), not a slice; a write or a truncate below the
    prefix's end makes a later fork slice the context's own pages again."""
    cache, zeros, prompt, first = _retained_prompt()
    hits = []
    for turn in range(3):
        hit, matched = cache.match(prompt + [20 + turn])
        assert matched == 4
        hit.extend([30 + turn, 31 + turn], zeros[:2])
        cache.retain(hit)
        hits.append(hit)
    assert hits[1]._pages[:4] == hits[2]._pages[:4] and hits[1]._base is hits[2]._base
    assert [p.page_id for p in hits[2]._pages[:4]] == [p.page_id for p in first._pages[:4]]
    hits[2].overwrite(1, [99], zeros[:1])          # a private copy of page 1, below the prefix's end
    fork = cache._fork(hits[2], length=4)
    assert [p.page_id for p in fork._pages] == [p.page_id for p in hits[2]._pages[:4]]
    assert fork._pages[1] is not first._pages[1] and fork.tokens == [0, 99, 2, 3]
    hits[1].truncate(2)
    fork2 = cache._fork(hits[1], length=2)
    assert fork2._pages == first._pages[:2] and len(hits[1]._base) <= 2
    for ctx in (first, *hits, fork, fork2):
        ctx.close()
    _check_books(cache)


def test_hits_at_a_shared_prefix_share_its_slots_as_one_range():
    """The prefix's refcount slots are kept beside it (``Context._base_slots``): a hit that takes
    the kept prefix tuple shares a range, so the count it leaves pending is one slice add, where
    a view of the entry's joined slot array made it a scatter over every page."""
    cache, zeros, prompt, first = _retained_prompt()
    blocker = cache.allocate()
    blocker.extend([7], zeros[:1])          # takes the next slot: an extend of a hit starts a new run
    for turn in range(3):
        hit, matched = cache.match(prompt + [20 + turn])
        assert matched == 4 and hit._slots == range(first._pages[0].ref, first._pages[0].ref + 4)
        hit.extend([30 + turn, 31 + turn], zeros[:2])
        assert type(hit._slots) is not range      # the prompt's run and the turn's, joined
        cache.retain(hit)
        hit.close()
    for ctx in (first, blocker):
        ctx.close()
    _check_books(cache)
