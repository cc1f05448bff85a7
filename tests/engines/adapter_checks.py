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
