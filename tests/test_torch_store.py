"""The torch page store: bit-identical to the NumPy store, refuses bad input before writing, counts copies."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings, strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from kvstate import Cache, Layout  # noqa: E402
from kvstate.impl.numpy_store import NumpyStore  # noqa: E402
from kvstate.impl.torch_store import TorchStore  # noqa: E402
from kvstate.spec.errors import ConfigError, NonFiniteError, PrecisionRangeError  # noqa: E402

LAYOUT = Layout(layers=2, kv_heads=3, head_dim=8)
PRECISIONS = ("f32", "f16", "q8")


def devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def tricky_batch(seed: int, n: int = 6) -> np.ndarray:
    """Random values at mixed magnitudes, with zero vectors, subnormals and f16 round-off cases."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(LAYOUT.batch_shape(n)).astype(np.float32)
    x *= np.float32([1e-40, 1e-8, 1e-3, 1.0, 300.0, 6e4][seed % 6])
    vectors = x.reshape(-1, LAYOUT.head_dim)
    vectors[rng.random(len(vectors)) < 0.2] = 0.0                       # all-zero: q8 scale 0
    vectors[rng.random(len(vectors)) < 0.1, 0] = np.float32(1e-45)      # a lone subnormal
    vectors[rng.random(len(vectors)) < 0.1, 1] = np.float32(2049.0)     # an f16 tie, rounds to even
    halves = rng.integers(-127, 128, size=vectors.shape).astype(np.float32) + np.float32(0.5)
    tie_rows = rng.random(len(vectors)) < 0.1                            # q8 ratios near x.5
    vectors[tie_rows] = halves[tie_rows] * np.float32(0.01)
    return np.clip(x, -65000, 65000)


def roundtrip(store, x: np.ndarray) -> np.ndarray:
    """Write ``x`` into one page of ``store`` and read it back as NumPy float32."""
    buffer = store.allocate(1)
    store.write(buffer, 0, store.encode(x), 0, len(x))
    values = store.read(buffer, 0, len(x))
    return values if isinstance(values, np.ndarray) else values.cpu().numpy()


def assert_bit_identical(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    differs = a.view(np.uint32) != b.view(np.uint32)
    assert not differs.any(), f"{differs.sum()} values differ, first at {np.argwhere(differs)[0]}"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("seed", range(12))
def test_reads_are_bit_identical_to_the_numpy_store(device, precision, seed):
    x = tricky_batch(seed)
    numpy_store = NumpyStore(LAYOUT, 6, precision)
    torch_store = TorchStore(LAYOUT, 6, precision, device=device)
    assert_bit_identical(roundtrip(torch_store, x), roundtrip(numpy_store, x))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("page_tokens", [1, 3])
def test_a_read_across_pages_is_bit_identical_to_the_numpy_store(device, precision, page_tokens):
    """A read of many pages joins their rows and decodes them once (``read_spans``): the same bits as
    the NumPy store's, for whole contexts and for ranges that start and end inside a page."""
    x = tricky_batch(7, n=20)
    reads = {}
    for store in ("numpy", "torch"):
        cache = Cache(LAYOUT, page_tokens=page_tokens, precision=precision, store=store,
                      **({"device": device} if store == "torch" else {}))
        ctx = cache.allocate()
        ctx.extend(list(range(20)), x)
        reads[store] = [ctx.read(start, stop)[0] for start, stop in [(0, 20), (1, 19), (4, 5), (2, 14)]]
    for ours, theirs in zip(reads["torch"], reads["numpy"]):
        assert_bit_identical(ours.cpu().numpy(), theirs)


@pytest.mark.parametrize("store", ["numpy", "torch"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_read_is_a_copy_not_a_view_of_the_page(store, precision):
    """Even where the page's slice is already contiguous (one layer, one position per page)."""
    layout = Layout(layers=1, kv_heads=2, head_dim=4)
    ctx = Cache(layout, page_tokens=1, precision=precision, store=store).allocate()
    ctx.extend([1], np.ones(layout.batch_shape(1), np.float32))
    values, _ = ctx.read()
    values[0, 0, 0, 0, 0] = 42
    assert float(ctx.read()[0][0, 0, 0, 0, 0]) == 1.0


@settings(max_examples=60, deadline=None, database=None)
@given(precision=st.sampled_from(PRECISIONS),
       x=hnp.arrays(np.float32, LAYOUT.batch_shape(2),
                    elements=st.floats(-6e4, 6e4, width=32, allow_nan=False, allow_subnormal=True)))
def test_any_finite_batch_reads_identically(precision, x):
    assert_bit_identical(roundtrip(TorchStore(LAYOUT, 2, precision), x), roundtrip(NumpyStore(LAYOUT, 2, precision), x))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("precision,poison,error", [
    ("f32", np.nan, NonFiniteError),
    ("q8", -np.inf, NonFiniteError),
    ("f16", np.inf, NonFiniteError),
    ("f16", 1e5, PrecisionRangeError),
])
def test_bad_values_are_refused_before_anything_is_written(device, precision, poison, error):
    cache = Cache(LAYOUT, page_tokens=4, precision=precision, store="torch", device=device, arena_pages=2)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3], tricky_batch(3, 3))
    before_values, before_tokens = ctx.read()
    before = cache.stats()
    bad = tricky_batch(4, 3)
    bad[2, 1, 0, 2, 5] = poison
    for kv in (bad, torch.from_numpy(bad).to(device)):
        with pytest.raises(error, match=r"index \(2, 1, 0, 2, 5\)"):
            ctx.extend([4, 5, 6], kv)
        with pytest.raises(error):
            ctx.overwrite(0, [7, 8, 9], kv)
    assert cache.stats() == before
    values, tokens = ctx.read()
    assert torch.equal(values, before_values) and tokens.tolist() == before_tokens.tolist() == [1, 2, 3]


def test_non_finite_wins_over_f16_overflow_as_in_numpy():
    x = tricky_batch(1, 1)
    x[0, 0, 0, 0, 0], x[0, 1, 1, 1, 1] = 1e6, np.nan
    for store in (NumpyStore(LAYOUT, 1, "f16"), TorchStore(LAYOUT, 1, "f16")):
        with pytest.raises(NonFiniteError):
            store.encode(x)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("arena", [0, 8])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_fork_allocates_nothing_and_one_write_copies_one_page(device, arena, precision):
    cache = Cache(LAYOUT, page_tokens=4, precision=precision, store="torch", device=device, arena_pages=arena)
    ctx = cache.allocate()
    ctx.extend(list(range(10)), tricky_batch(2, 10))            # 3 pages, the last one partly filled
    before = cache.stats()
    branch = ctx.fork()
    assert cache.stats()["pages_allocated"] == before["pages_allocated"]
    assert cache.stats()["pages_copied"] == 0
    branch.overwrite(5, [99], tricky_batch(5, 1))                # page 1 is shared: one copy
    after = cache.stats()
    assert after["pages_allocated"] == before["pages_allocated"] + 1
    assert after["pages_copied"] == 1
    assert after["bytes_copied"] == cache.store.page_bytes
    parent_values, parent_tokens = ctx.read()
    assert parent_tokens.tolist() == list(range(10))
    assert torch.equal(parent_values.cpu(), torch.from_numpy(
        roundtrip(NumpyStore(LAYOUT, 10, precision), tricky_batch(2, 10))))
    branch.extend([42], tricky_batch(6, 1))                      # into the shared, partly filled last page
    assert cache.stats()["pages_copied"] == 2
    for c in (ctx, branch):
        c.close()
    obs = cache.observe()
    assert not obs.pages and not obs.arena_out and len(obs.arena_free) == arena


@pytest.mark.parametrize("device", devices())
def test_reads_stay_on_the_device(device):
    cache = Cache(LAYOUT, page_tokens=4, store="torch", device=device)
    ctx = cache.allocate()
    assert ctx.read()[0].device.type == device                  # empty read too
    ctx.extend([1, 2, 3, 4, 5], torch.from_numpy(tricky_batch(0, 5)).to(device))
    values, _ = ctx.read(1, 5)
    assert values.device.type == device and values.dtype == torch.float32
    assert tuple(values.shape) == LAYOUT.batch_shape(4)


def test_arena_slots_are_zeroed_on_reissue():
    store = TorchStore(LAYOUT, 4, "q8", arena_pages=1)
    first = store.allocate(1)
    store.write(first, 0, store.encode(tricky_batch(1, 4) + 1), 0, 4)
    store.free(first)
    again = store.allocate(2)
    assert again.slot == first.slot == 0
    assert store.is_zero_from(again, 0)
    heap = store.allocate(3)                                     # arena full: ordinary storage
    assert heap.slot is None and store.counters.heap_fallbacks == 1


def test_bad_device_is_a_config_error():
    with pytest.raises(ConfigError):
        TorchStore(LAYOUT, 4, "f32", device="no-such-device")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA"):
            Cache(LAYOUT, store="torch", device="cuda")


class _HookedTensor(torch.Tensor):
    """A K/V tensor subclass whose ``__torch_function__`` raises on indexing while armed."""

    armed = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if cls.armed and func is torch.Tensor.__getitem__:
            raise RuntimeError("a user's hook")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("precision", ["f32", "q8"])
def test_a_tensor_subclass_hook_never_runs_inside_a_write(precision):
    """The store writes a plain copy: a subclass's hook cannot interrupt a write half done."""
    cache = Cache(LAYOUT, page_tokens=2, store="torch", precision=precision)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3, 4], torch.zeros(LAYOUT.batch_shape(4)))
    _HookedTensor.armed = True
    try:
        ctx.overwrite(1, [7, 8], torch.ones(LAYOUT.batch_shape(2)).as_subclass(_HookedTensor))
        ctx.extend([5, 6, 7], torch.ones(LAYOUT.batch_shape(3)).as_subclass(_HookedTensor))
    finally:
        _HookedTensor.armed = False
    values, tokens = ctx.read()
    assert list(tokens) == [1, 7, 8, 4, 5, 6, 7] and len(ctx._pages) == 4
    assert torch.equal(torch.as_tensor(values)[:, 0, 0, 0, 0], torch.tensor([0., 1, 1, 0, 1, 1, 1]))


@pytest.mark.parametrize("arena_pages", [0, 4])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_pages_made_under_inference_mode_are_written_outside_it(precision, arena_pages, tmp_path):
    """A cache made, filled and restored into under ``torch.inference_mode`` is written in place
    afterwards (a page's free rows, a fork's copy-on-write): its pages are never inference tensors."""
    x = tricky_batch(3, 9)
    with torch.inference_mode():
        cache = Cache(LAYOUT, page_tokens=4, precision=precision, store="torch", arena_pages=arena_pages)
        ctx = cache.allocate()
        ctx.extend(list(range(5)), torch.from_numpy(x[:5]))          # its second page holds 1 of 4 rows
        ctx.snapshot(tmp_path / "five.kvs")
        restored = cache.restore(tmp_path / "five.kvs")
    ctx.extend([5, 6], torch.from_numpy(x[5:7]))                     # into that page's free rows
    restored.extend([5, 6], torch.from_numpy(x[5:7]))
    branch = ctx.fork()
    branch.overwrite(1, [9], torch.from_numpy(x[7:8]))               # copy-on-write of the first page
    assert torch.equal(ctx.read()[0], restored.read()[0])
    assert not torch.equal(branch.read()[0], ctx.read()[0])
    assert ctx.tokens == restored.tokens == list(range(7))
