"""Checks both engine adapters get in the same words."""

from __future__ import annotations

import numpy as np
import pytest

from kvstate.spec.errors import ForeignContextError


def foreign_retain_is_refused(factory, config) -> None:
    """``retain`` of another cache's context (or of None) is refused by name, and nothing of that
    cache's enters this one's tree: its slot ids or blocks would read as this cache's."""
    mine, theirs = factory(config), factory(config)
    ctx = theirs.allocate()
    ctx.extend(list(range(32)), np.ones(config.layout.batch_shape(32), np.float32))
    for stranger in (ctx, None):
        with pytest.raises(ForeignContextError):
            mine.retain(stranger)
    assert mine.match(list(range(32)))[1] == 0


def evicts_under_pressure(factory, config, evicted: str) -> int:
    """Keys A and B cached (8 positions each), then a context of 12 in a pool of 24: the engine must evict
    4 cached pages its own way, and a run matching both keys passes in lockstep (a shorter hit accepted).
    Returns what the adapter counts as evicted (its attribute ``evicted``)."""
    from kvstate.stateful import ops as O
    from kvstate.stateful.lockstep import Lockstep

    assert config.pool_limit == 24 and config.page_tokens == 1
    keys = [(0,) * 8, (1,) * 8]
    ops = []
    for k, key in enumerate(keys):
        ops += [O.Allocate(), O.Extend(f"c{k + 1}", key, seed=k), O.Retain(f"c{k + 1}"), O.Close(f"c{k + 1}")]
    ops += [O.Allocate(), O.Extend("c3", (2,) * 12, seed=3)] + [O.Match(key) for key in keys]
    run = Lockstep(factory, config)
    run.run(ops)
    count = getattr(run.engine, evicted)
    hits = [len(run.live[handle][0]) for handle in ("c4", "c5")]
    run.finish()
    assert count > 0 and min(hits) < 8, (count, hits)
    return count
