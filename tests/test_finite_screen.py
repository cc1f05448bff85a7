"""``all_finite``: f32 arrays above a chunk are screened by their dot product with themselves,
and only a non-finite sum (a NaN, an infinity, or an overflow of large finite values) runs the
exact test. The screen must never accept a NaN or an infinity, and an overflow must never refuse
finite values: checked here on arrays large enough to take the screen, in the function, in the
NumPy store's writes and in streamed restores."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.fuzz.snapshot_fuzz import resign
from kvstate.impl import snapshot_tuning
from kvstate.impl.cache import Cache
from kvstate.spec import layout as layout_module
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.errors import NonFiniteError, SnapshotCorruptError
from kvstate.spec.layout import Layout, all_finite

CHUNK = layout_module._FINITE_CHUNK
SIZE = 3 * CHUNK + 5           # takes the screen, and its exact test crosses chunks unaligned
HUGE = np.float32(3e38)        # its square overflows f32: the screen's sum is infinite
SPECIAL = [np.nan, np.inf, -np.inf, float(HUGE), float(-HUGE), 1e-45, -0.0, 0.0]
LAYOUT = Layout(layers=2, kv_heads=4, head_dim=64)     # 1,024 values a position: 70 positions pass a chunk


def test_arrays_of_a_chunk_and_less_are_not_screened_and_larger_ones_are(monkeypatch):
    """The size rule itself: the dot screen runs only past a chunk, where it pays."""
    assert layout_module._dot_screen_is_sound()        # this BLAS passes; asked once, before counting
    calls = []
    real_dot = np.dot
    monkeypatch.setattr(layout_module.np, "dot", lambda a, b: calls.append(a.size) or real_dot(a, b))
    assert all_finite(np.ones(CHUNK, np.float32)) and calls == []
    assert all_finite(np.ones(CHUNK + 1, np.float32)) and calls == [CHUNK + 1]


@settings(max_examples=60, deadline=None)
@given(scale=st.sampled_from([1.0, 1e10, 1e19, float(HUGE)]),
       specials=st.lists(st.tuples(st.integers(0, SIZE - 1), st.sampled_from(SPECIAL)), max_size=4),
       dtype=st.sampled_from([np.float32, np.float16]))
def test_all_finite_agrees_with_isfinite(scale, specials, dtype):
    values = np.random.default_rng(len(specials)).uniform(-1, 1, SIZE).astype(np.float32) * np.float32(scale)
    with np.errstate(over="ignore"):       # large values overflow f16 to infinity: a case of its own
        values = values.astype(dtype)
        for index, special in specials:
            values[index] = special
    assert all_finite(values) == bool(np.isfinite(values).all())


@pytest.mark.parametrize("where", [0, SIZE // 2, SIZE - 1])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_one_non_finite_value_among_values_whose_squares_overflow_is_found(where, bad):
    values = np.full(SIZE, HUGE, np.float32)
    assert all_finite(values)          # the screen's sum overflows; the exact test accepts
    values[where] = bad
    assert not all_finite(values)


def test_the_store_refuses_a_nan_deep_in_a_large_write_by_index_and_keeps_huge_finite_values():
    cache = Cache(LAYOUT, page_tokens=16)
    n = 3 * CHUNK // LAYOUT.values_per_position + 1
    ctx = cache.allocate()
    huge = np.full(LAYOUT.batch_shape(n), HUGE, np.float32)
    huge[::2] *= -1
    ctx.extend(list(range(n)), huge)
    np.testing.assert_array_equal(ctx.read()[0], huge)
    bad = huge.copy()
    bad[n - 1, 1, 1, 3, 63] = np.nan
    before = cache.stats()
    with pytest.raises(NonFiniteError, match=rf"\({n - 1}, 1, 1, 3, 63\)"):
        ctx.extend(list(range(n)), bad)
    assert len(ctx) == n and cache.stats() == before


@pytest.mark.parametrize("threads", [1, 2])
def test_a_streamed_restore_keeps_huge_values_and_refuses_a_late_infinity_by_position(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(snapshot_tuning, "IO_THREADS", threads)
    cache = Cache(LAYOUT, page_tokens=16)
    n = 4 * CHUNK // LAYOUT.values_per_position
    values = np.full(LAYOUT.batch_shape(n), HUGE, np.float32)
    values[1::3] = -HUGE
    with cache.allocate() as ctx:
        ctx.extend(list(range(n)), values)
        ctx.snapshot(tmp_path / "huge.kvs")
    with cache.restore(tmp_path / "huge.kvs") as back:
        np.testing.assert_array_equal(back.read()[0], values)

    data = (tmp_path / "huge.kvs").read_bytes()
    late = fmt.HEADER_SIZE + 4 * n + values[:n - 2].nbytes + 4 * 700      # position n - 2, value 700
    (tmp_path / "inf.kvs").write_bytes(resign(data[:late] + b"\x00\x00\x80\x7f" + data[late + 4:]))
    before = cache.observe(), cache.stats()
    with pytest.raises(SnapshotCorruptError, match=rf"value inf at \({n - 2}, 1, 0, 2, 60\) .* is not finite"):
        cache.restore(tmp_path / "inf.kvs")
    assert (cache.observe(), cache.stats()) == before


def test_a_blas_that_loses_a_nan_turns_the_screen_off(monkeypatch):
    """The screen trusts NumPy's BLAS only after checking it once: a dot that drops a NaN
    (a broken build) must leave the exact test in charge, never accept the NaN."""
    layout_module._dot_screen_is_sound.cache_clear()
    real_dot = np.dot
    monkeypatch.setattr(layout_module.np, "dot", lambda a, b: np.float32(0) if np.isnan(a).any() else real_dot(a, b))
    try:
        assert layout_module._dot_screen_is_sound() is False
        values = np.ones(SIZE, np.float32)
        values[SIZE // 3] = np.nan
        assert not all_finite(values)
    finally:
        layout_module._dot_screen_is_sound.cache_clear()
    monkeypatch.undo()
    assert layout_module._dot_screen_is_sound() is True
