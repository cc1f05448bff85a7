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

