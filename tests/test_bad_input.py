"""Bad input gets a named error and changes nothing."""

import numpy as np
import pytest

from helpers import LAYOUT, filled, kv, make_cache, make_reference

from kvstate import Cache, Layout
from kvstate.spec import errors


@pytest.fixture
def cache():
    return make_cache(page_tokens=4, precision="f16", arena_pages=3, max_entries=2)


def snapshot_state(cache, ctx):
    obs = cache.observe()
    return (obs.pages, obs.holders, obs.lengths, obs.arena_out, obs.arena_free, obs.entries,
            cache.stats(), ctx.read()[0].tobytes(), ctx.read()[1].tobytes())


def refused(cache, ctx, error, action):
    before = snapshot_state(cache, ctx)
    with pytest.raises(error) as caught:
        action()
    assert str(caught.value), "a refusal must say what was wrong"
    assert snapshot_state(cache, ctx) == before
    return caught.value


BAD_WRITES = [
    ("shape", errors.ShapeError, lambda: ([1, 2], np.zeros((2, 2, 2, 4), np.float32))),
    ("count", errors.ShapeError, lambda: ([1, 2, 3], kv(2))),
    ("dtype f64", errors.DTypeError, lambda: ([1, 2], kv(2).astype(np.float64))),
    ("dtype int", errors.DTypeError, lambda: ([1, 2], np.zeros(LAYOUT.batch_shape(2), np.int32))),
    ("list kv", errors.DTypeError, lambda: ([1, 2], kv(2).tolist())),
    ("nan", errors.NonFiniteError, lambda: ([1, 2], np.where(np.arange(64).reshape(kv(2).shape) == 40,
                                                                np.float32("nan"), kv(2)).astype(np.float32))),
    ("inf", errors.NonFiniteError, lambda: ([1], np.full(LAYOUT.batch_shape(1), np.inf, np.float32))),
    ("f16 overflow", errors.PrecisionRangeError, lambda: ([1], np.full(LAYOUT.batch_shape(1), 1e6, np.float32))),
    ("negative token", errors.TokenError, lambda: ([1, -1], kv(2))),
    ("huge token", errors.TokenError, lambda: ([1, 2**31], kv(2))),
    ("float token", errors.DTypeError, lambda: ([1, 2.0], kv(2))),
    ("bool token", errors.DTypeError, lambda: ([True, 2], kv(2))),
    ("float token array", errors.DTypeError, lambda: (np.array([1.0, 2.0]), kv(2))),
    ("2-d tokens", errors.ShapeError, lambda: (np.array([[1, 2]]), kv(2))),
]


@pytest.mark.parametrize("name,error,make", BAD_WRITES, ids=[b[0] for b in BAD_WRITES])
def test_bad_extend_and_overwrite_are_refused_and_change_nothing(cache, name, error, make):
    ctx = filled(cache, 5)
    shared = ctx.fork()           # a refused write must not even copy the shared page
    tokens, values = make()
    refused(cache, ctx, error, lambda: ctx.extend(tokens, values))
    refused(cache, ctx, error, lambda: ctx.overwrite(0, tokens, values))
    shared.close()


@pytest.mark.parametrize("start,n", [(-1, 1), (4, 2), (6, 0), (5, 1), ("0", 1), (None, 1), (1.0, 1), (True, 1)])
def test_overwrite_outside_the_context_is_refused(cache, start, n):
    ctx = filled(cache, 5)
    refused(cache, ctx, errors.PositionError, lambda: ctx.overwrite(start, [1] * n, kv(n)))


@pytest.mark.parametrize("start,stop", [(-1, 2), (2, 1), (0, 6), (6, 6), (0, 2.0), (False, 2)])
def test_read_outside_the_context_is_refused(cache, start, stop):
    ctx = filled(cache, 5)
    refused(cache, ctx, errors.PositionError, lambda: ctx.read(start, stop))


@pytest.mark.parametrize("n", [-1, 6, 2.0, None, True])
def test_truncate_beyond_length_is_refused(cache, n):
    ctx = filled(cache, 5)
    refused(cache, ctx, errors.PositionError, lambda: ctx.truncate(n))


@pytest.mark.parametrize("make_reference_call", [
    lambda ctx: ctx.overwrite("0", [1], kv(1)), lambda ctx: ctx.overwrite(True, [1], kv(1)),
    lambda ctx: ctx.truncate(2.0), lambda ctx: ctx.truncate(True), lambda ctx: ctx.read(0, 2.0),
])
def test_the_reference_refuses_the_same_positions(make_reference_call):
    from helpers import make_reference

    ref = make_reference().allocate()
    ref.extend([1, 2, 3], kv(3))
    with pytest.raises(errors.PositionError):
        make_reference_call(ref)
    assert ref.tokens == [1, 2, 3]


def test_an_extend_that_runs_out_of_memory_keeps_no_page(cache, monkeypatch):
    ctx = filled(cache, 3)
    calls = {"n": 0}
    allocate = cache.store.allocate

    def failing_allocate(page_id):
        calls["n"] += 1
        if calls["n"] == 2:
            raise MemoryError("out of device memory")
        return allocate(page_id)

    monkeypatch.setattr(cache.store, "allocate", failing_allocate)
    # 3 + 6 positions need pages 2 and 3 at page_tokens=4: the second allocation fails
    before = cache.observe()
    with pytest.raises(MemoryError):
        ctx.extend(list(range(6)), kv(6))
    after = cache.observe()
    assert calls["n"] == 2
    assert (after.pages.keys(), after.holders, after.lengths, after.arena_out) == \
        (before.pages.keys(), before.holders, before.lengths, before.arena_out)
    assert after.pages_allocated - after.pages_freed == before.pages_allocated - before.pages_freed
    monkeypatch.undo()
    ctx.extend(list(range(6)), kv(6))
    assert len(ctx) == 9 and cache.stats()["live_pages"] == 3


@pytest.mark.parametrize("fails", ["store", "pool"])
def test_an_extend_on_the_heap_that_runs_out_of_memory_keeps_no_page(monkeypatch, fails):
    """With no arena slot free, the store makes an extend's pages in one call (``allocate_all``) and
    the pool registers them in one loop: memory running out on the second page, in the store or in
    the pool (a ``Page``, once the slots are taken), leaves no page, no buffer, no count and no slot behind."""
    from kvstate.impl import pages as pages_module

    cache = make_cache(page_tokens=4, precision="f16")
    ctx = filled(cache, 3)
    before, heap_pages = cache.observe(), cache.store.counters.heap_pages
    calls = {"n": 0}

    def second_fails(make):
        def failing(*args):
            calls["n"] += 1
            if calls["n"] == 2:
                raise MemoryError("out of memory")
            return make(*args)
        return failing
    assert cache.store._spares == []
    if fails == "store":        # where the store makes a page's memory, none kept
        monkeypatch.setattr(cache.store, "_fresh_buffer", second_fails(cache.store._fresh_buffer))
    else:
        monkeypatch.setattr(pages_module, "Page", second_fails(pages_module.Page))     # after its slots are taken
    with pytest.raises(MemoryError):
        ctx.extend(list(range(6)), kv(6))
    assert calls["n"] == 2
    after = cache.observe()
    assert (after.pages, after.holders, after.lengths) == (before.pages, before.holders, before.lengths)
    assert after.pages_allocated - after.pages_freed == before.pages_allocated - before.pages_freed
    assert cache.pool._next_ref - cache.pool._free_slots == len(after.pages)     # no refcount slot taken
    assert cache.store.counters.heap_pages - heap_pages == (2 if fails == "pool" else 1)    # the pages made
    # Every buffer made before the failure is freed (and kept as a spare): the store's one, or the pool's two.
    assert len(cache.store._spares) == (2 if fails == "pool" else 1)
    monkeypatch.undo()
    ctx.extend(list(range(6)), kv(6))
    assert len(ctx) == 9 and cache.stats()["live_pages"] == 3


def test_retain_of_an_empty_context_is_refused(cache):
    ctx = cache.allocate()
    refused(cache, ctx, errors.EmptyContextError, lambda: cache.retain(ctx))


def test_retain_of_another_caches_context_is_refused(cache):
    other = make_cache()
    foreign = filled(other, 3)
    ctx = filled(cache, 2)
    refused(cache, ctx, errors.ForeignContextError, lambda: cache.retain(foreign))


def test_match_with_bad_tokens_is_refused(cache):
    ctx = filled(cache, 3)
    cache.retain(ctx)
    refused(cache, ctx, errors.TokenError, lambda: cache.match([0, -5]))


def test_use_after_close_is_refused_by_name(cache):
    """The engine and the reference refuse every use of a closed context alike."""
    reference = make_reference(4, "f16", 3, 2)
    for owner in (cache, reference):
        ctx = owner.allocate()
        ctx.extend(list(range(5)), kv(5))
        ctx.close()
        for action in (lambda: ctx.read(), lambda: ctx.fork(), lambda: ctx.extend([1], kv(1)),
                       lambda: ctx.overwrite(0, [1], kv(1)), lambda: ctx.truncate(0), lambda: ctx.tokens,
                       lambda: ctx.close(), lambda: owner.retain(ctx)):
            with pytest.raises(errors.ContextClosedError):
                action()


def test_context_manager_closes_once():
    cache = make_cache()
    with filled(cache, 3) as ctx:
        assert len(ctx) == 3
    assert ctx.closed and cache.stats()["live_pages"] == 0


@pytest.mark.parametrize("kwargs,error", [
    (dict(page_tokens=0), errors.ConfigError),
    (dict(page_tokens=2.5), errors.ConfigError),
    (dict(precision="bf16"), errors.ConfigError),
    (dict(arena_pages=-1), errors.ConfigError),
    (dict(max_entries=0), errors.ConfigError),
    (dict(store="gpu"), errors.ConfigError),
    (dict(device="cuda"), errors.ConfigError),
])
def test_impossible_configurations_are_refused(kwargs, error):
    with pytest.raises(error):
        Cache(LAYOUT, **kwargs)


@pytest.mark.parametrize("config", [None, {"layout": LAYOUT}, LAYOUT])
def test_from_config_of_anything_but_a_config_is_refused_by_name(config):
    """From an audit: anything else raised a bare AttributeError on its ``layout``."""
    with pytest.raises(errors.ConfigError, match="Config"):
        Cache.from_config(config)


@pytest.mark.parametrize("mismatch", [dict(page_tokens=8), dict(precision="q8"), dict(layout=Layout(1, 1, 2))])
def test_a_page_store_built_for_another_cache_is_refused_by_name(mismatch):
    """From an audit: a store of another page size or layout was accepted and the first extend raised a
    bare ValueError; one of another precision made an f32 cache keep q8 values."""
    from kvstate.impl.numpy_store import NumpyStore
    built = dict(layout=LAYOUT, page_tokens=4, precision="f32") | mismatch
    store = NumpyStore(built["layout"], built["page_tokens"], built["precision"], 0)
    with pytest.raises(errors.ConfigError, match=next(iter(mismatch))):
        Cache(LAYOUT, page_tokens=4, precision="f32", store=store)
    assert Cache(LAYOUT, page_tokens=4, store=NumpyStore(LAYOUT, 4, "f32", 0)).allocate().tokens == []


@pytest.mark.parametrize("device", ["meta", "xpu", "hpu", "privateuseone"])
def test_a_torch_device_that_keeps_no_values_is_refused_when_the_cache_is_built(device):
    """From an audit: ``meta`` was accepted and the first extend raised a bare RuntimeError; ``xpu``
    and ``hpu`` on a torch built without them raised AssertionError or ModuleNotFoundError."""
    torch = pytest.importorskip("torch")
    backend = getattr(torch, device, None)
    if device != "meta" and backend is not None and getattr(backend, "is_available", lambda: False)():
        pytest.skip(f"this torch has a usable {device} device")
    with pytest.raises(errors.ConfigError, match=device):
        Cache(LAYOUT, store="torch", device=device)


@pytest.mark.parametrize("store", ["numpy", "torch"])
def test_f16_refuses_from_where_it_rounds_to_infinity_and_says_so(store):
    """65504 is f16's largest value, but 65519 rounds to it and is stored: the refusal starts at 65520,
    which its message named as "|x| > 65504" (an audit)."""
    if store == "torch":
        pytest.importorskip("torch")
    cache = Cache(LAYOUT, precision="f16", store=store)
    ctx = cache.allocate()
    ctx.extend([1], np.full(LAYOUT.batch_shape(1), -65519.0, np.float32))
    assert float(ctx.read()[0].min()) == -65504.0
    with pytest.raises(errors.PrecisionRangeError, match=r"\|x\| >= 65520"):
        ctx.extend([2], np.full(LAYOUT.batch_shape(1), 65520.0, np.float32))
    assert len(ctx) == 1


def test_numpy_integer_layout_sizes_are_stored_as_int_and_their_products_do_not_wrap():
    """An audit: Layout kept np.uint8 sizes, so layers x 2 x kv_heads x head_dim wrapped to 0 and a
    cache's page bytes (its memory checks, its stats) with it."""
    layout = Layout(np.uint8(128), np.int32(2), np.uint8(128))
    assert layout == Layout(128, 2, 128) and all(type(size) is int for size in layout.position_shape)
    assert layout.values_per_position == 128 * 2 * 2 * 128
    assert Cache(layout, page_tokens=2).store.page_bytes == Cache(Layout(128, 2, 128), page_tokens=2).store.page_bytes


@pytest.mark.parametrize("dims", [(0, 1, 1), (1, -2, 1), (1, 1, True), (1.5, 1, 1)])
def test_impossible_layouts_are_refused(dims):
    with pytest.raises(errors.ConfigError):
        Layout(*dims)


@pytest.mark.parametrize("n", [-1, "a", 1.0, True, None])
def test_a_batch_shape_of_no_count_is_refused(n):
    # (-1, 1, 2, 1, 2) and ('a', ...) were returned, for NumPy to refuse later, unnamed
    with pytest.raises(errors.ShapeError, match="number of positions"):
        LAYOUT.batch_shape(n)
    assert LAYOUT.batch_shape(np.int64(3)) == LAYOUT.batch_shape(3) and type(LAYOUT.batch_shape(np.int64(3))[0]) is int


def test_numpy_integer_positions_are_accepted_and_stored_as_int(cache):
    ctx = filled(cache, 5)
    ctx.truncate(np.int64(3))
    ctx.overwrite(np.int32(1), [7], kv(1))
    assert ctx.tokens == [0, 7, 2]
    assert type(cache.observe().lengths[f"ctx:{ctx.context_id}"]) is int


@pytest.mark.parametrize("call, position", [
    (lambda ctx: ctx.truncate(2.0), "2.0 (float)"),
    (lambda ctx: ctx.overwrite(True, [1], kv(1)), "True (bool)"),
    (lambda ctx: ctx.read(np.float32(0.5), 2), "float32"),
])
def test_a_position_that_is_no_integer_is_named_as_such_not_as_out_of_range(cache, call, position):
    """``truncate(2.0)`` said "truncate to 2.0 is outside context 1 of length 8": its type is what is wrong."""
    ctx = filled(cache, 8)
    with pytest.raises(errors.PositionError, match="integer positions") as refused_with:
        call(ctx)
    assert position in str(refused_with.value) and "outside" not in str(refused_with.value)
    assert len(ctx) == 8


def test_a_shallow_copy_of_a_context_or_a_cache_is_refused(cache):
    """From an audit: ``copy.copy(ctx)`` held the pages uncounted under the same id, and closing it freed
    pages the original still read; ``copy.copy(cache)`` shared the pool but counted ids on its own."""
    import copy

    ctx = filled(cache, 6)
    before = cache.stats()
    with pytest.raises(TypeError, match="fork"):
        copy.copy(ctx)
    with pytest.raises(TypeError, match="not copied"):
        copy.copy(cache)
    assert cache.stats() == before and len(ctx) == 6
    ctx.close()
    assert cache.stats()["live_pages"] == 0


@pytest.mark.parametrize("tokens", [{1, 2, 3}, {1: 0, 2: 0, 3: 0}])
def test_token_ids_in_an_unordered_container_are_refused(cache, tokens):
    ctx = cache.allocate()
    with pytest.raises(errors.DTypeError, match="ordered sequence"):
        ctx.extend(tokens, kv(3))
    with pytest.raises(errors.DTypeError, match="ordered sequence"):
        make_reference().allocate().extend(tokens, kv(3))
    assert len(ctx) == 0 and cache.stats()["live_pages"] == 0


def test_token_ids_as_a_torch_tensor_are_read_as_an_arrays_are(cache):
    torch = pytest.importorskip("torch")
    ctx = cache.allocate()
    ctx.extend(torch.tensor([5, 6, 7]), kv(3))
    assert ctx.tokens == [5, 6, 7] and cache.match(torch.tensor([5, 6, 7, 8]))[1] == 0
    for bad, error in ((torch.tensor([1.5]), errors.DTypeError), (torch.tensor([-1]), errors.TokenError),
                       (torch.tensor([1], dtype=torch.bfloat16), errors.DTypeError)):
        with pytest.raises(error):
            ctx.extend(bad, kv(1))
    assert len(ctx) == 3


def test_a_cache_of_huge_pages_is_built_without_reserving_their_ids():
    """256 rows of 10**8-token ids were asked for in the constructor: 191 GiB, a raw MemoryError; and
    then one row of 10**12 ids, 8 TB (an audit). README: such a cache is built, its first extend may fail."""
    big = Cache(Layout(1, 1, 2), page_tokens=10**8)
    assert big.pool.table.ids.shape == (0, 10**8)            # no row until a page takes one
    assert Cache(Layout(1, 1, 2), page_tokens=10**12).pool.table.ids.shape == (0, 10**12)
    assert Cache(Layout(1, 1, 2), page_tokens=64).pool.table.ids.shape == (256, 64)


def test_a_page_table_that_starts_empty_grows_for_the_first_page():
    cache = Cache(Layout(1, 1, 2), page_tokens=2**21)        # past 2**20 positions a page: no row at first
    ctx = cache.allocate()
    ctx.extend([1, 2, 3], np.ones((3, 1, 2, 1, 2), np.float32))
    cache.retain(ctx)
    hit, matched = cache.match([1, 2, 3, 4])
    assert matched == 3 and hit.tokens == [1, 2, 3] and cache.pool.table.ids.shape[0] >= 1
    for done in (hit, ctx):
        done.close()
    cache.clear()
    assert cache.stats()["live_pages"] == 0


@pytest.mark.parametrize("name", ["page_tokens", "arena_pages", "max_entries", "max_pages", "pool_pages"])
def test_every_count_of_a_cache_takes_ints_of_any_width_as_python_ints(name):
    # From an audit: page_tokens took a NumPy int, the other counts refused one (the engine's rule for
    # positions, spec/positions.py: ints of every width, never a bool).
    layout = Layout(layers=1, kv_heads=1, head_dim=2)
    cache = Cache(layout, **{name: np.int64(4)})
    assert type(getattr(cache.config, name)) is int and getattr(cache.config, name) == 4
    for bad in (True, 4.0, np.float64(4)):
        with pytest.raises(errors.ConfigError, match=name):
            Cache(layout, **{name: bad})


def test_a_cache_refusing_prefix_reuse_refuses_retain_and_match_by_name_and_changes_nothing(cache):
    """``kvstate.hf`` marks the cache of a model whose rotary embedding follows the sequence's length;
    a caller reaching the kvstate cache directly is refused as one going through ``KVStateCache``."""
    ctx = filled(cache, 6)
    cache.retain(ctx)
    for why in ("", None, 3):
        refused(cache, ctx, errors.ConfigError, lambda w=why: cache.refuse_prefix_reuse(w))
    cache.refuse_prefix_reuse("these K/V follow their sequence's length")
    refused(cache, ctx, errors.UnsupportedModelError, lambda: cache.retain(ctx))
    error = refused(cache, ctx, errors.UnsupportedModelError, lambda: cache.match(ctx.tokens))
    assert str(error) == "match: these K/V follow their sequence's length"
    ctx.extend([7], kv(1))        # the context itself goes on: one conversation is unaffected
    fork = ctx.fork()
    assert len(fork) == 7
    for c in (fork, ctx):
        c.close()
