"""``Context.read`` of every range equals the reference's, bit for bit, at small page sizes: the
read gathers many pages at once (``NumpyStore.read_spans``) and only the first and last page of a
range are covered in part."""

from __future__ import annotations

import pytest

from kvstate.impl.numpy import factory
from kvstate.reference import RefCache
from kvstate.stateful.configs import machine_configs
from kvstate.stateful.ops import values_for


@pytest.mark.parametrize("config", [c for c in machine_configs() if not c.arena_pages], ids=lambda c: c.name)
@pytest.mark.parametrize("page_tokens", [1, 3, 4])
def test_every_range_reads_what_the_reference_reads(config, page_tokens):
    config = config.with_(page_tokens=page_tokens)
    sides = []
    for cache in (factory(config), RefCache(config)):
        ctx = cache.allocate()
        ctx.extend(list(range(11)), values_for(config.layout, 11, 5))
        fork = ctx.fork()
        fork.overwrite(2, [7, 8], values_for(config.layout, 2, 9))    # a copied page among shared ones
        fork.truncate(10)
        sides.append((ctx, fork))
    for mine, theirs in zip(*sides):
        for start in range(len(theirs) + 1):
            for stop in range(start, len(theirs) + 1):
                (values, tokens), (want, want_tokens) = mine.read(start, stop), theirs.read(start, stop)
                assert values.dtype == want.dtype and values.shape == want.shape
                assert values.tobytes() == want.tobytes(), (start, stop)
                assert tokens.dtype == want_tokens.dtype and tokens.tolist() == want_tokens.tolist(), (start, stop)
