"""``impl.batch_write.extend_rows`` equals one ``Context.extend`` per row, in order: the same values,
tokens, lengths, pages (ids, refcounts, slots), holders and counters, pages copied included. One row's
last page is shared with a fork, so copy-on-write runs; a bad input changes nothing."""

import numpy as np
import pytest

from kvstate import Cache, Layout
from kvstate.impl.batch_write import extend_rows
from kvstate.spec.errors import ContextBusyError, ForeignContextError, NonFiniteError, ShapeError, TokenError
from kvstate.spec.invariants import check_structure

LAYOUT = Layout(layers=2, kv_heads=2, head_dim=3)
STORES = [("numpy", "f32"), ("numpy", "q8"), ("torch", "f32"), ("torch", "f16")]


def values(rows: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, n, *LAYOUT.position_shape)).astype(np.float32)


def scene(store: str, precision: str):
    """A cache and four rows: a forked row sharing its partly filled last page (copy-on-write on
    write), its parent, an empty row, and a row whose pages are full; plus an extra fork kept aside."""
    if store == "torch":
        pytest.importorskip("torch")
    cache = Cache(LAYOUT, page_tokens=4, precision=precision, store=store)
    parent = cache.allocate()
    parent.extend([1, 2, 3, 4, 5], values(1, 5, 1)[0])
    child = parent.fork()
    full = cache.allocate()
    full.extend(list(range(10, 18)), values(1, 8, 2)[0])
    kept = full.fork()
    rows = [child, cache.allocate(), parent, full]
    return cache, rows, kept


def state(cache, rows, kept) -> tuple:
    contexts = [*rows, kept]
    read = [ctx.read() for ctx in contexts]
    return (cache.observe(), [len(ctx) for ctx in contexts], [ctx.tokens for ctx in contexts],
            [np.asarray(v).tobytes() for v, _ in read], [t.tolist() for _, t in read])


@pytest.mark.parametrize("store,precision", STORES)
@pytest.mark.parametrize("n", [1, 3])
def test_extend_rows_equals_one_extend_per_row(store, precision, n):
    tokens = np.arange(100, 100 + 4 * n).reshape(4, n)
    kv = values(4, n, 3)
    cache, rows, kept = scene(store, precision)
    extend_rows(rows, tokens, kv)
    twin, twin_rows, twin_kept = scene(store, precision)
    for ctx, ids, part in zip(twin_rows, tokens, kv):
        ctx.extend(ids, part)
    assert cache.store.counters.pages_copied == 1           # the forked row's shared last page, once
    assert state(cache, rows, kept) == state(twin, twin_rows, twin_kept)
    check_structure(cache.observe())


def test_extend_rows_takes_torch_tensors_on_the_torch_store():
    torch = pytest.importorskip("torch")
    tokens, kv = np.array([[7], [8], [9], [10]]), values(4, 1, 4)
    cache, rows, kept = scene("torch", "f32")
    extend_rows(rows, torch.from_numpy(tokens), torch.from_numpy(kv))
    twin, twin_rows, twin_kept = scene("torch", "f32")
    extend_rows(twin_rows, tokens, kv)
    assert state(cache, rows, kept) == state(twin, twin_rows, twin_kept)


def bad_inputs():
    good = np.array([[1], [2], [3], [4]])
    nan = values(4, 1, 5)
    nan[3, 0, 1, 1, 0, 2] = np.nan
    return {
        "a NaN in the last row": (good, nan),
        "a negative token id": (np.array([[1], [2], [-3], [4]]), values(4, 1, 5)),
        "rows of tokens and values disagree": (good, values(3, 1, 5)),
        "too few token rows": (good[:3], values(4, 1, 5)),
        "float64 values": (good, values(4, 1, 5).astype(np.float64)),
        "values of another layout": (good, np.zeros((4, 1, 2, 2, 2, 4), np.float32)),
    }


@pytest.mark.parametrize("store,precision", [("numpy", "f32"), ("torch", "q8")])
@pytest.mark.parametrize("case", sorted(bad_inputs()))
def test_a_bad_input_changes_nothing(store, precision, case):
    tokens, kv = bad_inputs()[case]
    cache, rows, kept = scene(store, precision)
    before = state(cache, rows, kept)
    with pytest.raises((NonFiniteError, TokenError, ShapeError, TypeError, ValueError)):
        extend_rows(rows, tokens, kv)
    assert state(cache, rows, kept) == before


def test_rows_that_are_not_distinct_contexts_of_one_cache_are_refused():
    cache, rows, kept = scene("numpy", "f32")
    before = state(cache, rows, kept)
    with pytest.raises(ShapeError, match="twice"):
        extend_rows([rows[0], rows[0]], [[1], [2]], values(2, 1, 6))
    other = Cache(LAYOUT, page_tokens=4).allocate()
    with pytest.raises(ForeignContextError, match=r"rows \[1\]"):
        extend_rows([rows[0], other], [[1], [2]], values(2, 1, 6))
    for stranger in (None, "ctx", object()):     # not a context at all: named, not an AttributeError
        with pytest.raises(ForeignContextError, match=r"rows \[1\] are not kvstate contexts"):
            extend_rows([rows[0], stranger], [[1], [2]], values(2, 1, 6))
    with pytest.raises(ForeignContextError, match=r"rows \[0\] are not kvstate contexts"):
        extend_rows([None, rows[0]], [[1], [2]], values(2, 1, 6))
    def refused():
        with pytest.raises(ContextBusyError):
            extend_rows(rows, [[1], [2], [3], [4]], values(4, 1, 6))
    rows[2]._owned(refused)        # another operation is using a row: nothing is written to any
    assert state(cache, rows, kept) == before


def test_a_write_that_fails_part_way_leaves_every_row_at_its_length(monkeypatch):
    cache, rows, kept = scene("numpy", "f32")
    lengths, tokens = [len(ctx) for ctx in rows], [ctx.tokens for ctx in rows]
    write, calls = cache.store.write, []

    def failing(*args):
        calls.append(args)
        if len(calls) == 3:
            raise MemoryError("planted")
        return write(*args)
    monkeypatch.setattr(cache.store, "write", failing)
    with pytest.raises(MemoryError, match="planted"):
        extend_rows(rows, [[1], [2], [3], [4]], values(4, 1, 7))
    assert [len(ctx) for ctx in rows] == lengths and [ctx.tokens for ctx in rows] == tokens
    check_structure(cache.observe())
    assert cache.stats()["live_pages"] == 5       # the pages taken for the step were given back


@pytest.mark.parametrize("others", [0, 1])
def test_rows_sharing_a_last_page_ask_the_pool_for_the_copies_extends_one_by_one_make(others):
    """From a review: k rows sharing one partly filled last page (beams forked from one prompt) asked
    the pool for k copies, where extends one after another make k - 1 (the last writes in place, its
    refcount then 1): a refusing pool refused the batch that the extends fit, and an evicting one
    evicted an entry for nothing. With another holder of the page (``others``), all k copy."""
    def rows(cache):
        a = cache.allocate()
        a.extend([1, 2, 3], values(1, 3, 1)[0])
        kept = [a.fork() for _ in range(others)]
        return [a, a.fork(), a.fork()], kept
    limit = 3 + others      # the shared page and the copies the extends one by one make
    one_by_one = Cache(LAYOUT, page_tokens=4, pool_pages=limit, on_full="refuse")
    sequential, _ = rows(one_by_one)
    for i, ctx in enumerate(sequential):
        ctx.extend([9 + i], values(1, 1, 5 + i)[0])
    batched = Cache(LAYOUT, page_tokens=4, pool_pages=limit, on_full="refuse")
    batch, _ = rows(batched)
    extend_rows(batch, [[9], [10], [11]], np.stack([values(1, 1, 5 + i)[0] for i in range(3)]))
    assert batched.stats() == one_by_one.stats()
    assert [ctx.read()[0].tobytes() for ctx in batch] == [ctx.read()[0].tobytes() for ctx in sequential]
    check_structure(batched.observe())


@pytest.mark.parametrize("others", [0, 1])
def test_rows_sharing_a_last_page_are_refused_where_the_copies_do_not_fit(others):
    """The other side of the test above: a pool one page short of the copies the extends one by one make
    refuses the batch, changing nothing. An audit's mutant (s73) counting one copy fewer per shared page
    whatever its other holders passed the suite: a fork's batch of one row went past a refusing pool."""
    from kvstate.spec.errors import CapacityError

    cache = Cache(LAYOUT, page_tokens=4, pool_pages=1 + others, on_full="refuse")     # the page, not its copies
    a = cache.allocate()
    a.extend([1, 2, 3], values(1, 3, 1)[0])
    kept = [a.fork() for _ in range(others)]
    batch = [a.fork(), a.fork()][:1 + others]      # every row, and one holder past them, share the page
    before = cache.stats()
    with pytest.raises(CapacityError):
        extend_rows(batch, [[9]] * len(batch), np.stack([values(1, 1, 5 + i)[0] for i in range(len(batch))]))
    assert cache.stats() == before and [len(ctx) for ctx in batch + kept] == [3] * (len(batch) + len(kept))
    check_structure(cache.observe())
