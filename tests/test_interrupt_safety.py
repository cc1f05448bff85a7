"""An operation that fails part way, by a store error or by an interrupt (Ctrl-C, a run's deadline
delivered as an asynchronous exception), leaves the books consistent: no page leaked, none freed
while a holder lists it, no position whose token id and values disagree.

An interrupt is injected where CPython can deliver a pending one: at the entry of a Python
function (``sys.settrace``'s "call" event, as CPython checks for a pending signal on entering a
Python function); a store error by replacing one method on the cache's store. Each case then
checks invariants 1-3, reads the context back (the old state or the new, nothing between), closes
everything and checks that no page is left live. Found by review (``Context.writable``,
``Context._keep_first``, ``Context.overwrite``, ``Context.extend`` and ``extend_rows``).
"""

import sys

import numpy as np
import pytest

from kvstate import Cache, Layout
from kvstate.impl import context as context_module
from kvstate.impl import holding as holding_module
from kvstate.impl.batch_write import extend_rows
from kvstate.spec.invariants import check_page_counts, check_structure

LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)


def values(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(LAYOUT.batch_shape(n)).astype(np.float32)


OLD, NEW = values(6, 1), values(6, 2)


def consistent(cache) -> None:
    obs = cache.observe()
    check_structure(obs)
    check_page_counts(obs, cache.page_tokens)


def reads(ctx, tokens, kv) -> bool:
    got, ids = ctx.read()
    return ids.tolist() == list(tokens) and np.asarray(got).tobytes() == np.asarray(kv).tobytes()


def closed_empty(cache) -> None:
    """Close every context, drop every entry: no page may be left live."""
    for ctx in list(cache._contexts.values()):
        ctx.close()
    cache.clear()
    consistent(cache)
    assert cache.pool.live_count == 0, f"{cache.pool.live_count} pages left live"


class _InterruptAtACall:
    """``KeyboardInterrupt`` at the entry of the ``nth`` Python call that ``_counts(frame)`` picks;
    ``.hit`` says whether it was raised."""

    left, hit = 1, False

    def _counts(self, frame) -> bool:
        raise NotImplementedError

    def _trace(self, frame, event, arg):
        if event == "call" and self._counts(frame):
            self.left -= 1
            if self.left == 0:
                sys.settrace(None)
                self.hit = True
                raise KeyboardInterrupt
        return None

    def __enter__(self):
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        return False


class interrupt_at_call(_InterruptAtACall):
    """At the ``nth`` call of ``code`` made from a function named ``caller`` (any function when None)."""

    def __init__(self, code, caller: str | None = None, nth: int = 1):
        self.code, self.caller, self.left = code, caller, nth

    def _counts(self, frame) -> bool:
        return frame.f_code is self.code and (self.caller is None or frame.f_back.f_code.co_name == self.caller)


class interrupt_at_nth_call_from(_InterruptAtACall):
    """At the ``nth`` Python call made from a frame of function ``caller``."""

    def __init__(self, caller, nth: int):
        self.caller, self.left = caller.__code__, nth

    def _counts(self, frame) -> bool:
        return frame.f_back is not None and frame.f_back.f_code is self.caller


def store_fails(cache, method: str, nth: int = 1, error=KeyboardInterrupt):
    """Replace ``cache.store.<method>``: its ``nth`` call raises ``error`` (the calls before go through)."""
    original = getattr(cache.store, method)
    calls = [0]

    def failing(*args):
        calls[0] += 1
        if calls[0] == nth:
            raise error
        return original(*args)
    setattr(cache.store, method, failing)
    return lambda: setattr(cache.store, method, original)


# -- 1. writable: the shared page released before the holding listed the copy -----------------------

@pytest.mark.parametrize("arena", [0, 4])
def test_overwrite_interrupted_in_writable_keeps_the_shared_page_counted(arena):
    cache = Cache(LAYOUT, page_tokens=4, arena_pages=arena)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3], OLD[:3])
    cache.retain(ctx)                   # the entry shares ctx's page: refcount 2
    with interrupt_at_call(holding_module.Holding.replaced.__code__, "writable") as point:
        with pytest.raises(KeyboardInterrupt):
            ctx.overwrite(0, [9], NEW[:1])
    assert point.hit
    consistent(cache)                   # was: page 1 has refcount 1 but 2 holders
    cache.clear()                       # the entry lets go: ctx alone holds the page now
    consistent(cache)                   # was: ctx lists freed page 1; the copy held by nobody
    other = cache.allocate()
    other.extend([5, 6, 7, 8] * 3, values(12, 3))
    assert reads(ctx, [1, 2, 3], OLD[:3])
    closed_empty(cache)


def test_extend_of_a_fork_interrupted_in_writable_keeps_both_reading():
    cache = Cache(LAYOUT, page_tokens=4)
    parent = cache.allocate()
    parent.extend([1, 2, 3], OLD[:3])
    child = parent.fork()
    with interrupt_at_call(holding_module.Holding.replaced.__code__, "writable") as point:
        with pytest.raises(KeyboardInterrupt):
            child.extend([4], NEW[:1])
    assert point.hit
    consistent(cache)
    parent.close()
    consistent(cache)                   # was: the child lists freed page 1
    assert reads(child, [1, 2, 3], OLD[:3])
    child.extend([4], NEW[:1])
    assert reads(child, [1, 2, 3, 4], np.concatenate([OLD[:3], NEW[:1]]))
    closed_empty(cache)


def test_writable_interrupted_at_any_call_it_makes():
    """Every Python call ``writable`` makes once it starts copying, interrupted in turn: the copy
    happened whole (the context lists the private page) or not at all."""
    nth = 1
    while True:
        cache = Cache(LAYOUT, page_tokens=2)
        ctx = cache.allocate()
        ctx.extend([1, 2, 3, 4, 5, 6], OLD)
        twin = ctx.fork()
        with interrupt_at_nth_call_from(context_module.Context.writable, nth) as point:
            try:
                ctx.writable(1)
            except KeyboardInterrupt:
                pass
        consistent(cache)
        twin.close()
        consistent(cache)
        assert reads(ctx, [1, 2, 3, 4, 5, 6], OLD)
        closed_empty(cache)
        if not point.hit:
            break
        nth += 1
    assert nth > 3      # the copy's calls were reached


# -- 2. _keep_first: pages released before the holding stopped listing them -------------------------

@pytest.mark.parametrize("code", [holding_module.Holding.replaced.__code__, holding_module.Holding.with_length.__code__])
def test_truncate_interrupted_after_building_nothing_changes_nothing(code):
    cache = Cache(LAYOUT, page_tokens=2)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3, 4, 5, 6], OLD)
    with interrupt_at_call(code, "_keep_first") as point:
        with pytest.raises(KeyboardInterrupt):
            ctx.truncate(2)
    assert point.hit
    consistent(cache)                   # was: ctx lists freed pages 2 and 3
    other = cache.allocate()
    other.extend([7] * 8, values(8, 3))
    assert reads(ctx, [1, 2, 3, 4, 5, 6], OLD)
    ctx.truncate(2)
    assert reads(ctx, [1, 2], OLD[:2])
    closed_empty(cache)


def test_truncate_whose_store_fails_freeing_lists_no_freed_page():
    """The store frees the pages and then fails: the context no longer lists them."""
    cache = Cache(LAYOUT, page_tokens=2)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3, 4, 5, 6], OLD)
    original = cache.store.free_all

    def free_then_fail(buffers):
        original(buffers)
        raise KeyboardInterrupt
    cache.store.free_all = free_then_fail
    try:
        with pytest.raises(KeyboardInterrupt):
            ctx.truncate(2)
    finally:
        cache.store.free_all = original
    consistent(cache)
    assert reads(ctx, [1, 2], OLD[:2])
    closed_empty(cache)


# -- 3. overwrite: new token ids over old values after a failure part way -----------------------------

def _overwrite_failing_on_its_second_page(cache, shared: bool):
    """A context of positions 1-6 (``OLD``, retained too where ``shared``) whose overwrite of 1-3 fails
    as it writes its second page: checked to read exactly as before. Returns it and what it reads."""
    ctx = cache.allocate()
    ctx.extend([1, 2, 3, 4, 5, 6], OLD)
    before = np.asarray(ctx.read()[0])      # OLD as the precision stores it
    if shared:
        cache.retain(ctx)
    undo = store_fails(cache, "write", nth=2)       # page 0 (position 1) written, page 1 (2-3) fails
    try:
        with pytest.raises(KeyboardInterrupt):
            ctx.overwrite(1, [7, 8, 9], NEW[:3])
    finally:
        undo()
    consistent(cache)
    assert reads(ctx, [1, 2, 3, 4, 5, 6], before)   # was: tokens [1, 7, 8, 9, 5, 6] over old values at 2-3
    return ctx, before


@pytest.mark.parametrize("store,precision", [("numpy", "f32"), ("numpy", "f16"), ("numpy", "q8"),
                                             ("torch", "f32"), ("torch", "f16"), ("torch", "q8")])
@pytest.mark.parametrize("shared", [False, True])
def test_overwrite_whose_store_fails_on_a_later_page_changes_nothing(store, precision, shared):
    """Restored exactly at every precision, through the store's own stored rows (``stored_spans``)."""
    if store == "torch":
        pytest.importorskip("torch")
    cache = Cache(LAYOUT, page_tokens=2, precision=precision, store=store)
    ctx, before = _overwrite_failing_on_its_second_page(cache, shared)
    cache.retain(ctx)                   # keyed by the ids it reads: they must be the old ones
    hit, n = cache.match([1, 2, 3, 4, 5, 6])
    assert n == 6 and reads(hit, [1, 2, 3, 4, 5, 6], before)
    stale, n = cache.match([1, 7, 8, 9])      # was: a hit of 4 serving old values under the new ids
    assert n <= 1
    ctx.overwrite(1, [7, 8, 9], NEW[:3])
    assert ctx.read()[1].tolist() == [1, 7, 8, 9, 5, 6]
    closed_empty(cache)


@pytest.mark.parametrize("precision", ["f32", "q8"])
@pytest.mark.parametrize("method,nth", [("write", 1), ("write", 2), ("write_whole", 1)])
def test_overwrite_failing_at_each_store_call_changes_nothing(precision, method, nth):
    """Positions 1-8 at two a page: the first page in part (``write`` 1), the last in part
    (``write`` 2), the three between whole (``write_whole``, after both)."""
    cache = Cache(LAYOUT, page_tokens=2, precision=precision)
    ctx = cache.allocate()
    old, new = values(12, 5), values(8, 6)
    ctx.extend(list(range(1, 13)), old)
    before = np.asarray(ctx.read()[0])
    undo = store_fails(cache, method, nth=nth)
    try:
        with pytest.raises(KeyboardInterrupt):
            ctx.overwrite(1, list(range(101, 109)), new)
    finally:
        undo()
    consistent(cache)
    assert reads(ctx, list(range(1, 13)), before)
    ctx.overwrite(1, list(range(101, 109)), new)
    assert ctx.read()[1].tolist() == [1, *range(101, 109), 10, 11, 12]
    closed_empty(cache)


# -- 6. extend, extend_rows: pages listed past the length after a failure past the write -------------

def test_extend_interrupted_in_recycle_lists_no_page_past_its_length():
    cache = Cache(LAYOUT, page_tokens=4)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3], OLD[:3])
    undo = store_fails(cache, "recycle")
    try:
        with pytest.raises(KeyboardInterrupt):
            ctx.extend([10, 11, 12], NEW[:3])
    finally:
        undo()
    consistent(cache)                   # was: 3 positions listing 2 pages
    assert len(ctx) in (3, 6)
    ctx.extend([7], NEW[3:4])
    consistent(cache)
    closed_empty(cache)


@pytest.mark.parametrize("code", [holding_module.Holding.with_length.__code__])
def test_extend_interrupted_setting_its_length_is_undone(code):
    cache = Cache(LAYOUT, page_tokens=2)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3], OLD[:3])
    with interrupt_at_call(code, "_extend") as point:
        with pytest.raises(KeyboardInterrupt):
            ctx.extend([4, 5, 6], NEW[:3])
    assert point.hit
    consistent(cache)                   # was: 3 positions listing 3 pages
    assert reads(ctx, [1, 2, 3], OLD[:3])
    closed_empty(cache)


def test_extend_rows_interrupted_in_recycle_lists_no_page_past_a_length():
    cache = Cache(LAYOUT, page_tokens=4)
    a, b = cache.allocate(), cache.allocate()
    a.extend([1], OLD[:1])
    b.extend([2], OLD[1:2])
    undo = store_fails(cache, "recycle")
    try:
        with pytest.raises(KeyboardInterrupt):
            extend_rows([a, b], np.array([[5] * 6, [6] * 6]), np.stack([values(6, 4), values(6, 5)]))
    finally:
        undo()
    consistent(cache)                   # was: each row 1 position listing 2 pages
    closed_empty(cache)


@pytest.mark.parametrize("nth", [1, 2])
def test_extend_rows_interrupted_setting_a_length_undoes_every_row(nth):
    cache = Cache(LAYOUT, page_tokens=2)
    parent = cache.allocate()
    parent.extend([1, 2, 3], OLD[:3])
    child = parent.fork()
    with interrupt_at_call(holding_module.Holding.with_length.__code__, "_extend_held", nth) as point:
        with pytest.raises(KeyboardInterrupt):
            extend_rows([parent, child], np.array([[4, 5], [6, 7]]), np.stack([NEW[:2], NEW[2:4]]))
    assert point.hit
    consistent(cache)
    assert reads(parent, [1, 2, 3], OLD[:3]) and reads(child, [1, 2, 3], OLD[:3])
    closed_empty(cache)


@pytest.mark.parametrize("precision", ["f32", "f16", "q8"])
def test_overwrite_undone_through_a_store_without_stored_spans(monkeypatch, precision):
    """A store written to the protocol before ``stored_spans`` (a backend's own): the undo keeps the
    decoded values at f32 and f16 (they encode back to the very bytes) and ``read_encoded`` at q8."""
    from kvstate.impl.numpy_store import NumpyStore

    monkeypatch.delattr(NumpyStore, "stored_spans")
    cache = Cache(LAYOUT, page_tokens=2, precision=precision)
    _overwrite_failing_on_its_second_page(cache, shared=False)
    closed_empty(cache)
