"""An operation of the cache core that fails part way (a store error, memory running out, or an
interrupt: Ctrl-C, a run's deadline delivered as an asynchronous exception) leaves the books
consistent: no page leaked, no arena slot lost, no entry hidden from eviction (review 3, items 4,
5, 7 and the ``_fork`` remark of 6).

Interrupts are injected with ``sys.settrace`` where CPython delivers a pending one: at the call of
a Python function (its RESUME), or at the line right after a C call returns. Store errors replace
one method of the cache's store or pool. Each test then checks invariants 1-3
(``check_structure``) and that closing every context and clearing the tree empties the cache and
its arena (invariant 6).
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager

import numpy as np
import pytest

from kvstate import Cache, Layout
from kvstate.impl import cache as cache_module
from kvstate.impl import context as context_module
from kvstate.impl import numpy_store, radix, refcounts, tree_bounds
from kvstate.spec.invariants import check_empty, check_structure

from test_radix_newest import _walked_newest

L = Layout(layers=2, kv_heads=2, head_dim=4)


def vals(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(L.batch_shape(n)).astype(np.float32)


def settle(cache: Cache) -> None:
    """Invariants 1-3 now; then every context closed and the tree cleared: nothing live, no slot out."""
    check_structure(cache.observe())
    for ctx in list(cache._contexts.values()):
        ctx.close()
    cache.clear()
    obs = cache.observe()
    check_structure(obs)
    check_empty(obs)
    assert cache.pool.live_count == 0
    assert not obs.arena_out and len(obs.arena_free) == obs.arena_size


@contextmanager
def tracing(tracer):
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


def interrupt_at_call(code, caller=None, skip: int = 0):
    """A tracer raising ``KeyboardInterrupt`` at the call of ``code`` (from a function named in
    ``caller``, if given), after letting ``skip`` such calls pass; once."""
    state = {"skip": skip, "fired": False}

    def tracer(frame, event, arg):
        if (event == "call" and not state["fired"] and frame.f_code is code
                and (caller is None or frame.f_back.f_code.co_name in caller)):
            if state["skip"]:
                state["skip"] -= 1
                return None
            state["fired"] = True
            raise KeyboardInterrupt
        return None

    tracer.state = state
    return tracer


def interrupt_after_line(code, marker: str):
    """A tracer raising ``KeyboardInterrupt`` at the first line event in ``code`` that follows the
    (first) line containing ``marker``: where CPython raises an interrupt that came during that
    line's C call (``np.copyto``, ``fill``, ``Tensor.copy_``), as the call returns."""
    lines, first = inspect.getsourcelines(code)
    target = first + next(i for i, text in enumerate(lines) if marker in text)
    state = {"armed": False, "fired": False}

    def local(frame, event, arg):
        if event == "line" and not state["fired"]:
            if state["armed"]:
                state["fired"] = True
                raise KeyboardInterrupt
            if frame.f_lineno == target:
                state["armed"] = True
        return local

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code is code.__code__ and not state["fired"]:
            return local
        return None

    tracer.state = state
    return tracer


def retained(cache: Cache, count: int, length: int = 5) -> None:
    for i in range(count):
        ctx = cache.allocate()
        ctx.extend(list(range(10 * i, 10 * i + length)), vals(length, i))
        cache.retain(ctx)
        ctx.close()


# -- item 4: Cache.clear ------------------------------------------------------------------------

@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("arena_pages", [0, 8])
def test_clear_with_a_store_error_part_way_releases_every_entry(error, arena_pages):
    cache = Cache(L, page_tokens=4, arena_pages=arena_pages)
    retained(cache, 3)
    store, original, calls = cache.store, cache.store.free_all, []

    def free_all(buffers):
        calls.append(len(buffers))
        original(buffers)            # the store frees them all, then the error (or an interrupt) lands
        if len(calls) == 1:
            raise error("injected")

    store.free_all = free_all
    try:
        with pytest.raises(error):
            cache.clear()
    finally:
        del store.free_all
    assert len(cache.tree) == 0
    assert cache.pool.live_count == 0, "the entries after the failing one were never released"
    settle(cache)


def test_clear_interrupted_as_the_first_release_begins():
    cache = Cache(L, page_tokens=2)
    retained(cache, 3)
    with tracing(interrupt_at_call(cache_module.Cache._release.__code__, caller=("clear",))):
        with pytest.raises(KeyboardInterrupt):
            cache.clear()
    assert cache.pool.live_count == 0
    settle(cache)


# -- item 5: RadixTree.insert and Cache._keep -----------------------------------------------------

def _stamp_from_the_tree():
    # the stamp of an insert (``insert`` before the fix, ``put`` after), not ``match``'s
    return interrupt_at_call(radix.RadixTree.stamp.__code__, caller=("insert", "put"))


@pytest.mark.parametrize("match", ["entry", "token"])
def test_retain_interrupted_at_the_stamp_leaves_no_hidden_entry(match):
    cache = Cache(L, page_tokens=2, match=match)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3], vals(3))
    with tracing(_stamp_from_the_tree()):
        with pytest.raises(KeyboardInterrupt):
            cache.retain(ctx)
    # the entry is either in, counted and evictable, or not at all
    nodes = list(cache.tree.entries())
    assert len(cache.tree) == len(nodes) == len(cache.observe().entries)
    assert cache.tree.weight == cache.bounds.recount(cache.tree)
    if nodes:
        hit, matched = cache.match([1, 2, 3, 4])
        assert matched == 3
        for got, want in zip(hit.read(), ctx.read()):     # values, tokens
            np.testing.assert_array_equal(got, want)
        hit.close()
    ctx.close()
    settle(cache)


def _one_retained_and_one_more_under_its_key():
    """A cache with one entry, (1, 2, 3), and an open context of the same tokens, to retain over it."""
    cache = Cache(L, page_tokens=2)
    first, second = cache.allocate(), cache.allocate()
    first.extend([1, 2, 3], vals(3, 1))
    second.extend([1, 2, 3], vals(3, 2))
    cache.retain(first)
    first.close()
    return cache, second


def test_retain_replacing_an_entry_interrupted_at_the_stamp_releases_the_replaced_one():
    cache, second = _one_retained_and_one_more_under_its_key()
    with tracing(_stamp_from_the_tree()):
        with pytest.raises(KeyboardInterrupt):
            cache.retain(second)
    second.close()
    assert len(cache.tree) == 1
    check_structure(cache.observe())
    assert cache.pool.live_count == 2, "the replaced entry's pages must be freed"
    settle(cache)


def test_retain_interrupted_as_the_replaced_entrys_release_begins():
    cache, second = _one_retained_and_one_more_under_its_key()
    with tracing(interrupt_at_call(cache_module.Cache._release.__code__, caller=("_keep",))):
        with pytest.raises(KeyboardInterrupt):
            cache.retain(second)
    second.close()
    assert len(cache.tree) == 1
    assert cache.pool.live_count == 2, "the replaced entry's pages must be freed"
    settle(cache)


def test_retain_interrupted_between_the_fork_and_the_insert():
    """The entry is counted (``_fork``) and the tree call that would store it is interrupted as it begins."""
    cache = Cache(L, page_tokens=2)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3], vals(3))
    state = {"forked": False, "fired": False}

    def tracer(frame, event, arg):
        if event != "call" or state["fired"]:
            return None
        if frame.f_code is cache_module.Cache._fork.__code__:
            return lambda frame, event, arg: state.update(forked=True) if event == "return" else None
        if state["forked"] and frame.f_back.f_code is cache_module.Cache._keep.__code__:
            state["fired"] = True
            raise KeyboardInterrupt
        return None

    with tracing(tracer):
        with pytest.raises(KeyboardInterrupt):
            cache.retain(ctx)
    assert state["fired"]
    ctx.close()
    assert len(cache.tree) == 0
    assert cache.pool.live_count == 0, "the uninserted entry's count kept its pages"
    settle(cache)


def test_eviction_interrupted_inside_remove_leaves_no_hidden_entry():
    """``remove`` weighed the victim after it left the recency order: interrupted there, the entry
    stayed at its node (``match`` found it) but nothing counted, evicted or cleared it."""
    cache = Cache(L, page_tokens=2, max_entries=1)
    retained(cache, 1, length=3)
    ctx = cache.allocate()
    ctx.extend([7, 8, 9], vals(3, 7))
    tracer = interrupt_at_call(tree_bounds.TreeBounds.entry_pages.__code__, caller=("remove",))
    with tracing(tracer):
        with pytest.raises(KeyboardInterrupt):
            cache.retain(ctx)
    assert tracer.state["fired"]
    ctx.close()
    found = sum(cache.tree.longest_key(radix.pack(np.array(key)))[0] is not None
                for key in ([0, 1, 2], [7, 8, 9]))
    assert found == len(cache.tree), "an entry match finds that the tree does not count"
    settle(cache)


def test_pool_eviction_interrupted_as_the_victims_release_begins():
    """``on_full="evict"``: the victim left the tree (``pop_oldest``) and the release was interrupted as it began."""
    cache = Cache(L, page_tokens=2, pool_pages=4, on_full="evict")
    retained(cache, 1, length=4)
    ctx = cache.allocate()
    tracer = interrupt_at_call(cache_module.Cache._release.__code__, caller=("evict_oldest",))
    with tracing(tracer):
        with pytest.raises(KeyboardInterrupt):
            ctx.extend(list(range(50, 56)), vals(6, 5))
    assert tracer.state["fired"]
    check_structure(cache.observe())
    assert len(cache.tree) == 0 and cache.pool.live_count == 0, "the evicted entry's pages must be freed"
    settle(cache)



def _tree_is_whole(tree: radix.RadixTree) -> None:
    """Every node's ``newest`` is its subtree's most recently stamped entry; no node without an
    entry is a leaf or splits nothing; the recency order holds exactly the nodes with an entry."""
    nodes, pending = [], [tree.root]
    while pending:
        node = pending.pop()
        nodes.append(node)
        pending.extend(node.children.values())
    for node in nodes:
        best = _walked_newest(node)
        if node is not tree.root:
            assert node.newest is best, f"node {node.key()} names {node.newest and node.newest.key()}"
            assert node.value is not None or len(node.children) > 1, f"node {node.key()} splits nothing"
    assert set(tree.recency) == {node for node in nodes if node.value is not None}


@pytest.mark.parametrize("point", ["_forget_newest", "_collapse"])
def test_remove_interrupted_in_its_pruning_leaves_the_tree_whole(point):
    """The victim is out (``remove`` raised after its entry left); the tree's newest marks and
    splits are finished before the interrupt propagates: a mark naming the removed node made a
    later ``token`` hit fork an entry-less node."""
    tree = radix.RadixTree()
    for key in ((0, 1, 2), (0, 1, 3, 4), (0, 1, 3, 5), (0, 1, 3, 5, 6), (7,)):
        tree.insert(radix.pack(np.array(key)), key)
    victim = tree.longest_key(radix.pack(np.array((0, 1, 3, 5, 6))))[0] if point == "_forget_newest" else \
        tree.longest_key(radix.pack(np.array((0, 1, 2))))[0]
    tracer = interrupt_at_call(getattr(radix.RadixTree, point).__code__, caller=("remove", "_collapse_if_no_split"))
    with tracing(tracer):
        with pytest.raises(KeyboardInterrupt):
            tree.remove(victim)
    assert tracer.state["fired"]
    assert victim.value is None and len(tree) == 4
    _tree_is_whole(tree)


def test_stamp_interrupted_part_way_up_the_path_finishes_it():
    tree = radix.RadixTree()
    for key in ((0,), (0, 1), (0, 1, 2), (0, 1, 2, 3), (9,)):
        tree.insert(radix.pack(np.array(key)), key)
    deepest = tree.longest_key(radix.pack(np.array((0, 1, 2, 3))))[0]
    tree.stamp(tree.longest_key(radix.pack(np.array((0,))))[0])    # the top of the path names (0,) now
    lines, first = inspect.getsourcelines(radix.RadixTree.stamp)
    body = first + next(i for i, text in enumerate(lines) if "node.newest = stamped" in text)
    seen = {"count": 0}

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == body:
            seen["count"] += 1
            if seen["count"] == 3:          # two nodes of the path marked, an interrupt at the loop's jump
                raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        return local if event == "call" and frame.f_code is radix.RadixTree.stamp.__code__ else None

    with tracing(tracer):
        with pytest.raises(KeyboardInterrupt):
            tree.stamp(deepest)
    _tree_is_whole(tree)
    tree.remove(tree.longest_key(radix.pack(np.array((0, 1, 2, 3))))[0])
    _tree_is_whole(tree)


@pytest.mark.parametrize("by", ["max_entries", "pool"])
def test_eviction_interrupted_after_the_victim_left_the_tree_releases_it(by):
    """``pop_oldest``'s ``remove`` raised after the entry left (an interrupt in its pruning): the
    caller got no victim to release, so its pages stayed live for good."""
    if by == "max_entries":
        cache = Cache(L, page_tokens=2, max_entries=1)
    else:
        cache = Cache(L, page_tokens=2, pool_pages=4, on_full="evict")
    retained(cache, 1, length=4)
    ctx = cache.allocate()
    tracer = interrupt_at_call(radix.RadixTree._forget_newest.__code__, caller=("remove",))
    with tracing(tracer):
        with pytest.raises(KeyboardInterrupt):
            ctx.extend(list(range(50, 56)), vals(6, 5))
            cache.retain(ctx)
    assert tracer.state["fired"]
    check_structure(cache.observe())
    assert len(cache.tree) == (1 if by == "max_entries" else 0)
    assert cache.pool.live_count == len(ctx._pages), "the evicted entry's pages must be freed"
    settle(cache)

# -- item 6 (remark): Cache._fork records the count before the child exists ---------------------------

@pytest.mark.parametrize("length", [None, 2])       # a whole fork (``share_holding``), a shorter hit (``share``)
@pytest.mark.parametrize("point", ["child", "count"])
def test_fork_interrupted_before_the_child_exists_counts_nothing(length, point):
    cache = Cache(L, page_tokens=2)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3], vals(3))
    if point == "child":
        tracer = interrupt_at_call(context_module.Context.__init__.__code__, caller=("_fork",))
    else:
        code = refcounts.Refcounts.share_holding if length is None else refcounts.Refcounts.share
        tracer = interrupt_at_call(code.__code__, caller=("_fork",))
    with cache.lock:
        with tracing(tracer):
            with pytest.raises(KeyboardInterrupt):
                cache._fork(ctx, length=length)
    assert tracer.state["fired"]
    assert len(cache._contexts) == 1
    check_structure(cache.observe())
    ctx.close()
    assert cache.pool.live_count == 0, "a count no holder withdraws kept the pages"
    settle(cache)


def test_match_interrupted_before_the_hit_exists():
    cache = Cache(L, page_tokens=2, match="token")
    retained(cache, 1, length=5)
    tracer = interrupt_at_call(context_module.Context.__init__.__code__, caller=("_fork",))
    with tracing(tracer):
        with pytest.raises(KeyboardInterrupt):
            cache.match([0, 1, 2, 99])
    assert tracer.state["fired"]
    settle(cache)


# -- item 7: arena slots issued before the page's memory is made, and PagePool.clone ----------------

def _stores():
    yield "numpy"
    try:
        import torch  # noqa: F401
    except ImportError:
        yield pytest.param("torch", marks=pytest.mark.skip(reason="torch is not installed"))
    else:
        yield "torch"


def _store_class(store: str):
    if store == "numpy":
        return numpy_store.NumpyStore, "np.copyto(dst, src)", "array.fill(0)"
    from kvstate.impl import torch_store
    return torch_store.TorchStore, "dst.copy_(src)", "tensor.zero_()"


@pytest.mark.parametrize("store", list(_stores()))
def test_copy_interrupted_gives_the_arena_slot_back(store):
    cls, copy_line, _fill_line = _store_class(store)
    cache = Cache(L, page_tokens=4, arena_pages=4, store=store)
    a = cache.allocate()
    a.extend([1, 2, 3], vals(3))
    b = a.fork()
    tracer = interrupt_after_line(cls.copy, copy_line)
    with tracing(tracer):
        with pytest.raises(KeyboardInterrupt):
            b.extend([4], vals(1, 1))      # copy-on-write of the shared last page: store.copy
    assert tracer.state["fired"]
    check_structure(cache.observe())
    a.close()
    b.close()
    settle(cache)


@pytest.mark.parametrize("store", list(_stores()))
def test_allocation_interrupted_after_zeroing_gives_the_arena_slot_back(store):
    cls, _copy_line, fill_line = _store_class(store)
    cache = Cache(L, page_tokens=2, arena_pages=4, store=store)
    old = cache.allocate()
    old.extend([1, 2, 3, 4], vals(4))
    old.close()                     # two slots back, holding old bytes: the next pages are zeroed on issue
    ctx = cache.allocate()
    tracer = interrupt_after_line(getattr(cls._take, "__wrapped__", cls._take), fill_line)
    with tracing(tracer):
        with pytest.raises(KeyboardInterrupt):
            ctx.extend([5, 6, 7], vals(3, 1))
    assert tracer.state["fired"]
    check_structure(cache.observe())
    settle(cache)


@pytest.mark.parametrize("arena_pages", [0, 4])
def test_clone_frees_the_copy_when_registering_it_fails(arena_pages):
    cache = Cache(L, page_tokens=4, arena_pages=arena_pages)
    a = cache.allocate()
    a.extend([1, 2, 3], vals(3))
    b = a.fork()
    pool = cache.pool

    def take_slots(count):
        raise MemoryError("growing the refcount array")

    pool._take_slots = take_slots       # only the clone's ``_register`` takes a slot in this extend
    try:
        with pytest.raises(MemoryError):
            b.extend([4], vals(1, 1))
    finally:
        del pool._take_slots
    obs = cache.observe()
    check_structure(obs)
    assert not obs.arena_out or set(obs.arena_out.values()) <= set(obs.pages), "a slot out for no live page"
    assert cache.store.counters.arena_issued - cache.store.counters.arena_returned == len(obs.arena_out)
    a.close()
    b.close()
    settle(cache)



def test_flush_interrupted_part_way_keeps_the_rest_pending():
    """``Refcounts.flush`` emptied its books first, then added the counts: interrupted after the
    first, the others were lost (refcounts short: pages freed while held)."""
    cache = Cache(L, page_tokens=1, match="token")
    retained(cache, 1, length=6)
    hits = [cache.match(list(range(n)) + [99])[0] for n in (2, 3, 4)]      # three runs, counts pending
    assert len(cache.pool.books.pending) == 3
    tracer = interrupt_at_call(refcounts.add_holders.__code__, caller=("flush",), skip=1)
    with tracing(tracer):
        with pytest.raises(KeyboardInterrupt):
            cache.pool.books.flush()
    assert tracer.state["fired"]
    check_structure(cache.observe())
    for hit in hits:
        hit.close()
    settle(cache)


@pytest.mark.parametrize("forks_before", [0, 1])
def test_context_fork_interrupted_as_the_child_is_made_counts_nothing(monkeypatch, forks_before):
    """``Context.fork`` counted its child (``share_holding``, or one more on the holding) before making
    it: an interrupt as the child's object was made (delivered as that C call returns; stood in for
    here by the maker raising) left a count no holder would ever withdraw, and the pages live for good."""
    cache = Cache(L, page_tokens=2)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3], vals(3))
    kept = [ctx.fork() for _ in range(forks_before)]      # a count already pending: the spelled-out path

    def interrupted(cls):
        raise KeyboardInterrupt
    monkeypatch.setattr(context_module, "_new_context", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ctx.fork()
    monkeypatch.undo()
    assert len(cache._contexts) == 1 + forks_before
    check_structure(cache.observe())
    for held in (ctx, *kept):
        held.close()
    assert cache.pool.live_count == 0, "a count no holder withdraws kept the pages"
    settle(cache)
