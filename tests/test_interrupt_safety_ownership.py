"""An interrupt anywhere in an operation leaves the books whole and every context closable.

Here an interrupt is injected at the entry of each Python call an operation makes, in turn (where
CPython delivers one, as ``test_interrupt_safety.py`` injects them); then invariants 1-3 must hold,
every context must close, and nothing may be left live. Found this way:

- Every operation holds its context by a busy flag (``Context._owned``), which a context manager's
  ``__exit__`` cleared: interrupted at that ``__exit__``'s entry, the flag stayed set for good, so
  the context could never be closed and its pages were never freed.
- A release (a close, a truncate, an eviction) let the holder go in a ``finally``: interrupted before
  its counts went down, the pages stayed counted for nobody; after, but before they were freed,
  they were live at count 0 (``PagePool.release_slots`` now commits counts, holder and books in one
  step).
- ``PagePool.new_run`` raised the id count before its pages went live.
"""

import io
import os

import numpy as np
import pytest

from kvstate import Cache, Layout
from kvstate.impl.batch_write import extend_rows
from kvstate.impl.pages import PagePool
from kvstate.spec.errors import ContextBusyError

from test_interrupt_safety import _InterruptAtACall, closed_empty, consistent, values
from test_interrupt_safety_cache import interrupt_after_line, tracing

LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)
COUNTED = (os.path.dirname(os.path.dirname(os.path.abspath(__import__("kvstate").__file__))),
           os.path.dirname(np.__file__))


class interrupt_at_nth_call(_InterruptAtACall):
    """``KeyboardInterrupt`` at the entry of the ``nth`` Python call of kvstate's or NumPy's (the
    test's own lambdas included); ``.hit`` says whether there were that many. Not the tracer's own
    way out, nor a callback the collector runs (Hypothesis registers one) wherever it happens to run."""

    def __init__(self, nth: int):
        self.left, self.hit = nth, False

    def _counts(self, frame) -> bool:
        return frame.f_code is not _EXIT and frame.f_code.co_filename.startswith(COUNTED)


_EXIT = _InterruptAtACall.__exit__.__code__


def keyless(ctx):
    """``ctx`` keeping no packed key, so ``retain`` reads its tokens while holding it."""
    ctx._holding = ctx._holding.with_key(None)
    return ctx


OPERATIONS = {
    "tokens": lambda ctx, other: ctx.tokens,
    "read": lambda ctx, other: ctx.read(1, 5),
    "read_layer": lambda ctx, other: ctx.read_layer(1, 0, 5),
    "read_layer_pages": lambda ctx, other: ctx.read_layer_pages(0),
    "extend": lambda ctx, other: ctx.extend([7, 8, 9], values(3, 4)),
    "overwrite": lambda ctx, other: ctx.overwrite(2, [7, 8], values(2, 4)),
    "truncate": lambda ctx, other: ctx.truncate(2),
    "snapshot": lambda ctx, other: ctx.snapshot(io.BytesIO()),
    "retain reading the key": lambda ctx, other: ctx.cache.retain(keyless(ctx)),     # and evicting
    "retain": lambda ctx, other: ctx.cache.retain(ctx),                                 # and evicting
    "close": lambda ctx, other: ctx.close(),
    "close of a fork": lambda ctx, other: ctx.fork().close(),
    "truncate to 0": lambda ctx, other: ctx.truncate(0),
    "clear": lambda ctx, other: ctx.cache.clear(),
    "match": lambda ctx, other: ctx.cache.match([9, 9, 1, 2])[0].close(),
    "extend_rows": lambda ctx, other: extend_rows([ctx, other], [[7], [8]], values(2, 4).reshape(2, 1, 2, 2, 2, 4)),
}


@pytest.mark.parametrize("operation", OPERATIONS)
def test_an_interrupt_at_any_call_of_an_operation_leaves_the_context_closable(operation):
    interrupted = 0
    for nth in range(1, 2000):
        cache = Cache(LAYOUT, page_tokens=4, max_entries=1)
        ctx, other, kept = cache.allocate(), cache.allocate(), cache.allocate()
        ctx.extend([1, 2, 3, 4, 5, 6], values(6, 1))
        other.extend([1, 2], values(2, 2))
        kept.extend([9, 9, 9, 9, 9], values(5, 3))
        cache.retain(kept)          # an entry alone holding its pages: a retain of another evicts it
        kept.close()
        with interrupt_at_nth_call(nth) as point:
            try:
                OPERATIONS[operation](ctx, other)
            except KeyboardInterrupt:
                interrupted += 1
        if not point.hit:
            break
        consistent(cache)
        for held in (ctx, other):
            try:
                if not held.closed:
                    held.close()        # was: ContextBusyError, for good, where it landed in ``__exit__``
            except ContextBusyError as error:
                pytest.fail(f"an interrupt at call {nth} of {operation} left the context busy: {error}")
        closed_empty(cache)
    else:
        pytest.fail(f"{operation} made more calls than the test counts to")
    assert interrupted > 3      # the sweep did reach inside the operation


def test_a_use_refused_as_busy_leaves_the_holders_flag_set():
    """A second use from the thread that holds the context (a signal handler's, say) is refused,
    and its refusal does not clear the flag of the operation still running."""
    cache = Cache(LAYOUT, page_tokens=4)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3], values(3, 1))
    seen = []

    def inner():
        with pytest.raises(ContextBusyError):
            ctx.read()
        seen.append(ctx._use)
        return np.zeros(0)
    ctx._owned(inner)
    assert seen and seen[0] != 0        # still held while the outer operation ran
    assert ctx._use == 0                # and let go after it
    ctx.close()
    closed_empty(cache)


def test_a_release_interrupted_between_stretches_of_its_slots_still_frees_them_all():
    """A final review (s66): the live list is let go a stretch of slots at a time, a loop; a real signal
    between stretches left pages live at count 0 for good (21 of 60 SIGALRM trials)."""
    cache = Cache(LAYOUT, page_tokens=1)
    a, b = cache.allocate(), cache.allocate()
    for i in range(3):              # the two contexts' slots interleave: a release of a frees 3 stretches
        a.extend([i], values(1, i))
        b.extend([i], values(1, 10 + i))
    point = interrupt_after_line(PagePool._commit, "by_slot[first:stop] = nones")   # as the loop jumps back
    with tracing(point):
        with pytest.raises(KeyboardInterrupt):
            a.close()
    assert point.state["fired"]
    consistent(cache)               # was: invariant 2, a live page at count 0
    b.close()
    closed_empty(cache)


def test_extend_rows_interrupted_between_the_rows_it_lets_go_leaves_none_busy():
    """A final review (s66): ``extend_rows`` lets its rows go one by one, a loop; a real signal between
    them left the rest busy for good (close refused them)."""
    cache = Cache(LAYOUT, page_tokens=4)
    rows = [cache.allocate() for _ in range(3)]
    point = interrupt_after_line(extend_rows, "if ctx._use == me !=")       # before the first row is let go
    with tracing(point):
        with pytest.raises(KeyboardInterrupt):
            extend_rows(rows, [[1], [2], [3]], values(3, 4).reshape(3, 1, 2, 2, 2, 4))
    assert point.state["fired"]
    for ctx in rows:
        ctx.close()                 # was: ContextBusyError for the rows after the interrupt
    closed_empty(cache)
