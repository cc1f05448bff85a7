"""A restore interrupted as its context is made leaves no page behind.

Both restore paths made the new context, holding every page, one statement before the ``try``
that closes it on error: an interrupt there (Ctrl-C, a run's deadline, which CPython delivers at a
line of Python code) left a context no caller holds, and its pages, live for good (a review).
"""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest

from kvstate.impl import Cache
from kvstate.impl import snapshot_restore, snapshot_stream
from kvstate.spec import Layout

LAYOUT = Layout(2, 2, 4)


def _interrupt_after_the_context_is_made(code):
    """A trace that raises KeyboardInterrupt at the first line ``code`` runs once ``_new_pages_context`` returned."""
    made = []

    def trace(frame, event, arg):
        if frame.f_code is Cache._new_pages_context.__code__:
            return lambda frame, event, arg: made.append(True) if event == "return" else None
        if frame.f_code is not code:
            return None

        def line(frame, event, arg):
            if event == "line" and made:
                sys.settrace(None)
                raise KeyboardInterrupt
            return line
        return line
    return trace


@pytest.mark.parametrize("adopt, source", [(snapshot_restore._adopt, "stream"), (snapshot_stream._adopt_prepared, "path")])
def test_a_restore_interrupted_as_its_context_is_made_leaves_no_page(tmp_path, adopt, source):
    written = Cache(LAYOUT, page_tokens=4)
    with written.allocate() as ctx:
        ctx.extend(np.arange(11), np.ones((11, *LAYOUT.position_shape), np.float32))
        ctx.snapshot(tmp_path / "s.kvs")
    cache = Cache(LAYOUT, page_tokens=4)
    where = tmp_path / "s.kvs" if source == "path" else io.BytesIO((tmp_path / "s.kvs").read_bytes())
    sys.settrace(_interrupt_after_the_context_is_made(adopt.__code__))
    try:
        with pytest.raises(KeyboardInterrupt):
            cache.restore(where)
    finally:
        sys.settrace(None)
    seen = cache.observe()
    assert seen.holders == {} and not seen.pages and seen.pages_allocated == seen.pages_freed == 3
    with cache.restore(tmp_path / "s.kvs") as back:        # and the cache restores as before
        assert back.tokens == list(range(11))
