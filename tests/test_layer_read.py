"""``impl.layer_read.LayerReader``: its slices always read as the context's own ``read_layer``, and a
change of the page list slices only the pages that changed (kept slices are the very same objects)."""

import numpy as np
import pytest

from kvstate import Cache, Layout
from kvstate.impl.layer_read import LayerReader

LAYOUT = Layout(layers=2, kv_heads=2, head_dim=3)


def values(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *LAYOUT.position_shape)).astype(np.float32)


def assert_reads_as_context(reader: LayerReader) -> None:
    ctx = reader.context
    for layer in range(LAYOUT.layers):
        k, v = ctx.read_layer(layer)
        for kind, expected in enumerate((k, v)):
            parts = reader.parts(layer, kind)
            got = np.concatenate(parts).astype(np.float32) if parts else np.zeros_like(expected)
            if ctx.precision == "q8" and parts:      # codes (components 0, 1) times scales (2, 3)
                got = got * np.concatenate(reader.parts(layer, 2 + kind))[..., None]
            np.testing.assert_array_equal(got, expected)
            for skip in range(len(parts) + 2):        # the pages after the first ``skip``: the rest of the read
                tail = reader.parts(layer, kind, skip)
                assert len(tail) == max(len(parts) - skip, 0)
                assert all(a is b or np.array_equal(a, b) for a, b in zip(tail, parts[skip:]))


@pytest.mark.parametrize("precision", ["f32", "q8"])
def test_slices_follow_extend_copy_on_write_truncate_and_forks(precision):
    cache = Cache(LAYOUT, page_tokens=4, precision=precision)
    ctx = cache.allocate()
    reader = LayerReader(ctx, lambda x: x, tokens_axis=0)
    assert_reads_as_context(reader)
    ctx.extend(list(range(1, 11)), values(10, 1))
    assert_reads_as_context(reader)
    first = reader.parts(0, 1)[0]
    fork = ctx.fork()
    follower = reader.follow(fork)
    ctx.extend([11], values(1, 2))           # copy-on-write of the shared last page
    assert_reads_as_context(reader)
    assert_reads_as_context(follower)
    assert reader.parts(0, 1)[0] is first and follower.parts(0, 1)[0] is first   # full pages not sliced again
    fork.extend([12, 13, 14], values(3, 3))
    assert_reads_as_context(follower)
    assert_reads_as_context(reader)
    ctx.truncate(3)
    assert_reads_as_context(reader)
    ctx.truncate(0)
    assert_reads_as_context(reader)
    ctx.extend([5, 6], values(2, 4))
    assert_reads_as_context(reader)
