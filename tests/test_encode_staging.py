"""The NumPy store's private copy of a large batch (``STAGE_FROM_BYTES`` on) goes into a scratch
block it keeps for the next encode, not into fresh memory: one block, up to ``STAGING_BYTES``,
handed back by ``recycle`` once the pages hold their copies. What is stored never aliases it."""

import copy
import threading

import numpy as np
import pytest

from kvstate.impl import numpy_store
from kvstate.impl.batch_write import extend_rows
from kvstate.impl.cache import Cache
from kvstate.impl.context import Context
from kvstate.spec.errors import NonFiniteError, PrecisionRangeError
from kvstate.spec.layout import Layout

from helpers import StoreWithout

LAYOUT = Layout(layers=2, kv_heads=8, head_dim=64)     # 8 KiB a position at f32: 256 positions fill 2 MiB
STAGED = 256


def values(n, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(LAYOUT.batch_shape(n)) * scale).astype(np.float32)


def kept(cache) -> list[np.ndarray]:
    return cache.store._staging


def test_a_large_extend_leaves_one_block_that_the_next_reuses_and_no_page_aliases_it():
    cache = Cache(LAYOUT, page_tokens=64)
    first, second = cache.allocate(), cache.allocate()
    first.extend(list(range(STAGED)), values(STAGED, seed=1))
    (block,) = kept(cache)
    assert block.nbytes == values(STAGED).nbytes
    second.extend(list(range(STAGED)), values(STAGED, seed=2))     # overwrites the block
    assert kept(cache) == [block] and kept(cache)[0] is block
    np.testing.assert_array_equal(first.read()[0], values(STAGED, seed=1))
    np.testing.assert_array_equal(second.read()[0], values(STAGED, seed=2))
    for ctx in (first, second):
        assert not any(np.shares_memory(array, block) for page in ctx._pages for array in page.buffer.arrays)
        ctx.close()


def test_small_batches_take_no_block_and_a_larger_one_replaces_a_smaller():
    cache = Cache(LAYOUT, page_tokens=64)
    with cache.allocate() as ctx:
        ctx.extend(list(range(STAGED - 1)), values(STAGED - 1))    # under 2 MiB: malloc's
        assert kept(cache) == []
        ctx.extend(list(range(STAGED)), values(STAGED))
        ctx.extend(list(range(2 * STAGED)), values(2 * STAGED, seed=3))
        (block,) = kept(cache)
        assert block.size == values(2 * STAGED).size
        ctx.overwrite(0, list(range(STAGED)), values(STAGED, seed=4))  # fits in the kept block
        assert kept(cache) == [block]
        np.testing.assert_array_equal(ctx.read(0, STAGED)[0], values(STAGED, seed=4))
        third = 2 * STAGED - 1          # where the third extend began
        np.testing.assert_array_equal(ctx.read(third, third + 2 * STAGED)[0], values(2 * STAGED, seed=3))


def test_a_block_past_the_cap_is_not_kept(monkeypatch):
    monkeypatch.setattr(numpy_store, "STAGING_BYTES", values(STAGED).nbytes - 1)
    cache = Cache(LAYOUT, page_tokens=64)
    with cache.allocate() as ctx:
        ctx.extend(list(range(STAGED)), values(STAGED))
        assert kept(cache) == []
        np.testing.assert_array_equal(ctx.read()[0], values(STAGED))


@pytest.mark.parametrize("precision", ["f16", "q8"])
def test_encoding_to_another_precision_gives_the_block_back_at_once(precision):
    cache = Cache(LAYOUT, page_tokens=64, precision=precision)
    store = cache.store
    encoded = store.encode(values(STAGED))
    (block,) = kept(cache)                    # back before the rows are written: they are new arrays
    assert not any(np.shares_memory(part, block) for part in encoded)
    store.recycle(encoded)
    assert kept(cache) == [block]


def test_a_refused_batch_changes_nothing_and_its_block_is_kept():
    cache = Cache(LAYOUT, page_tokens=64)
    with cache.allocate() as ctx:
        ctx.extend([1, 2], values(2))
        bad = values(STAGED)
        bad[STAGED // 2, 1, 0, 3, 5] = np.nan
        with pytest.raises(NonFiniteError, match="nan"):
            ctx.extend(list(range(STAGED)), bad)
        assert len(ctx) == 2 and len(kept(cache)) == 1
        np.testing.assert_array_equal(ctx.read()[0], values(2))
    f16 = Cache(LAYOUT, page_tokens=64, precision="f16")
    with f16.allocate() as ctx:
        with pytest.raises(PrecisionRangeError):
            ctx.extend(list(range(STAGED)), values(STAGED, scale=1e6))
        assert len(ctx) == 0 and len(kept(f16)) == 1


def test_the_callers_array_changed_after_extend_changes_nothing_stored():
    cache = Cache(LAYOUT, page_tokens=64)
    given = values(STAGED, seed=5)
    with cache.allocate() as ctx:
        ctx.extend(list(range(STAGED)), given)
        given[:] = 7
        np.testing.assert_array_equal(ctx.read()[0], values(STAGED, seed=5))


def test_concurrent_large_extends_each_store_their_own_values():
    cache = Cache(LAYOUT, page_tokens=64)
    contexts = [cache.allocate() for _ in range(4)]
    start = threading.Barrier(len(contexts))

    def grow(i, ctx):
        start.wait()
        for turn in range(3):
            ctx.extend(list(range(STAGED)), values(STAGED, seed=10 * i + turn))

    threads = [threading.Thread(target=grow, args=(i, ctx)) for i, ctx in enumerate(contexts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, ctx in enumerate(contexts):
        want = np.concatenate([values(STAGED, seed=10 * i + turn) for turn in range(3)])
        np.testing.assert_array_equal(ctx.read()[0], want)
        ctx.close()
    assert len(kept(cache)) == 1          # hand-backs at once still leave one block


def test_a_copied_store_starts_without_scratch():
    cache = Cache(LAYOUT, page_tokens=64)
    with cache.allocate() as ctx:
        ctx.extend(list(range(STAGED)), values(STAGED))
    assert len(kept(cache)) == 1
    assert copy.deepcopy(cache.store)._staging == []


def test_a_block_serves_one_encode_at_a_time_until_recycled():
    store = Cache(LAYOUT, page_tokens=64).store
    first = store.encode(values(STAGED, seed=6))
    second = store.encode(values(STAGED, seed=7))      # the first still holds its block: a new one
    assert not np.shares_memory(first[0], second[0])
    np.testing.assert_array_equal(np.moveaxis(first[0], 2, 0), values(STAGED, seed=6))
    store.recycle(first)
    third = store.encode(values(STAGED, seed=8))      # takes the first's block; the second's is untouched
    assert np.shares_memory(third[0], first[0])
    np.testing.assert_array_equal(np.moveaxis(second[0], 2, 0), values(STAGED, seed=7))


@pytest.mark.parametrize("call", ["extend", "overwrite", "extend_rows"])
def test_no_write_reads_a_block_another_encode_has_taken(monkeypatch, call):
    """Each write of a row first runs another encode of other values: were the block handed back
    before the rows are written, that encode would take it and overwrite what is being stored."""
    cache = Cache(LAYOUT, page_tokens=64)
    contexts = [cache.allocate(), cache.allocate()]
    for ctx in contexts:
        ctx.extend(list(range(STAGED)), values(STAGED, seed=20))
    original = Context._write

    def write_after_another_encode(self, start, stop, tokens, encoded):
        cache.store.recycle(cache.store.encode(values(STAGED, seed=21)))   # fits any block here
        return original(self, start, stop, tokens, encoded)

    monkeypatch.setattr(Context, "_write", write_after_another_encode)
    if call == "extend":
        contexts[0].extend(list(range(STAGED)), values(STAGED, seed=22))
        want = [np.concatenate([values(STAGED, seed=20), values(STAGED, seed=22)]), values(STAGED, seed=20)]
    elif call == "overwrite":
        contexts[0].overwrite(0, list(range(STAGED)), values(STAGED, seed=22))
        want = [values(STAGED, seed=22), values(STAGED, seed=20)]
    else:
        batch = values(2 * STAGED, seed=22).reshape(2, STAGED, *LAYOUT.position_shape)
        extend_rows(contexts, np.arange(2 * STAGED).reshape(2, STAGED), batch)
        want = [np.concatenate([values(STAGED, seed=20), row]) for row in batch]
    for ctx, expected in zip(contexts, want):
        np.testing.assert_array_equal(ctx.read()[0], expected)
        ctx.close()


def test_a_page_store_without_recycle_still_extends_and_overwrites():
    inner = numpy_store.NumpyStore(LAYOUT, 64, "f32")
    cache = Cache(LAYOUT, page_tokens=64, store=StoreWithout(inner, "recycle"))
    assert not hasattr(cache.store, "recycle")
    with cache.allocate() as ctx:
        ctx.extend(list(range(STAGED)), values(STAGED, seed=30))
        ctx.overwrite(0, [1, 2], values(2, seed=31))
        np.testing.assert_array_equal(ctx.read()[0][2:], values(STAGED, seed=30)[2:])
        np.testing.assert_array_equal(ctx.read()[0][:2], values(2, seed=31))
        assert len(ctx) == STAGED


def test_two_hand_backs_keep_one_block_the_newer():
    store = Cache(LAYOUT, page_tokens=64).store
    first, second = store.encode(values(STAGED)), store.encode(values(STAGED, seed=1))
    store.recycle(first)
    store.recycle(second)
    (block,) = store._staging
    assert np.shares_memory(block, second[0])
