"""Many contexts extended by one call: the commit of a batched decode step.

A transformers decode step adds one position to every row of a batch, each row its
own context. ``Context.extend`` per row pays, per row, what does not depend on the
row: validating and encoding the values (a device sync on the torch store), taking
the cache lock, asking the pool policy for room. ``extend_rows`` pays each of these
once for the batch, then does the page work of each context (copy-on-write of a
shared last page through ``writable``, the one place that copies; new pages) in one
critical section, and writes every row's bytes outside the lock, as ``extend`` does.

The result equals ``contexts[i].extend(tokens[i], kv[i])`` for each i in order: the
same values, tokens, lengths, refcounts, pages copied and pages allocated. One
difference: the pool policy is told the whole batch's page count at once, so where
it must evict, it evicts for the batch before any row takes a page.
"""

from __future__ import annotations

from threading import get_ident

from kvstate.spec.errors import ForeignContextError, ShapeError
from kvstate.spec.arithmetic import pages_touched
from kvstate.spec.layout import check_tokens, check_values

from .context import FREE, Context
from .store import recycle


def extend_rows(contexts: list[Context], tokens, kv) -> None:
    """Append ``tokens[i]`` (``(rows, n)`` ints) with ``kv[i]`` (``(rows, n, layers, 2, kv_heads,
    head_dim)`` float32) to ``contexts[i]``, for every row.

    All or nothing for bad input: every row is validated (ids, shape, dtype, finite and
    representable values; distinct open contexts of one cache, none in use) before any
    context, page or counter changes. A failure after that (memory ran out, a store error, an
    interrupt) truncates every row back to its length before the error propagates.
    """
    contexts = list(contexts)
    if not contexts:
        return
    not_contexts = [i for i, ctx in enumerate(contexts) if not isinstance(ctx, Context)]
    if not_contexts:
        raise ForeignContextError(f"rows {not_contexts} are not kvstate contexts "
                                  f"(row {not_contexts[0]} is {type(contexts[not_contexts[0]]).__name__})")
    cache = contexts[0]._cache
    foreign = [i for i, ctx in enumerate(contexts) if ctx._cache is not cache]
    if foreign:
        raise ForeignContextError(f"rows {foreign} belong to another cache than row 0's")
    if len({id(ctx) for ctx in contexts}) != len(contexts):
        raise ShapeError("a context appears twice among the rows: each row is its own context")
    rows = len(contexts)
    ids = [check_tokens(row) for row in _rows(tokens, rows, "token ids")]
    n = len(ids[0]) if ids else 0
    if any(len(row) != n for row in ids):
        raise ShapeError(f"every row must add the same number of positions, got {[len(row) for row in ids]}")
    shape = tuple(getattr(kv, "shape", ()))
    if shape[:2] != (rows, n):
        raise ShapeError(f"K/V values must have shape ({rows}, {n}, ...) for {rows} rows of {n} positions, "
                         f"got {shape}")
    flat = check_values(cache.layout, kv.reshape(rows * n, *shape[2:]), rows * n)
    # Each row held as ``Context._owned`` holds one context, let go in the same ``finally``. That
    # lets go row by row, a loop, where CPython may deliver an interrupt as it jumps back: done again
    # in a ``finally`` of its own where it did not finish (clearing a flag twice is harmless), so no
    # row is left busy for good.
    me, rows = get_ident(), [(ctx, ctx._use) for ctx in contexts]
    try:
        for ctx in contexts:
            ctx._take(me)
        if n:
            _extend_held(cache, contexts, ids, flat, n)
    finally:
        done = False
        try:
            for ctx, held in rows:
                if ctx._use == me != held:
                    ctx._use = FREE
            done = True
        finally:
            if not done:
                for ctx, held in rows:
                    if ctx._use == me != held:
                        ctx._use = FREE


def _extend_held(cache, contexts: list[Context], ids: list, flat, n: int) -> None:
    """``extend_rows``' work, every row held and checked."""
    encoded = cache.store.encode(flat)      # one validation and encoding for every row
    starts = [ctx._length for ctx in contexts]
    try:
        # As in ``Context.extend``: from the first page taken to the last row's new length, one
        # protected region. A failure anywhere in it (the pool refused, the store failed, an
        # interrupt, even one while the lengths are set) truncates every row back to its start:
        # no row is left listing pages past its length (invariant 2), none half written.
        try:
            with cache.lock:
                _make_pages(cache, contexts, starts, n)
            _write_rows(contexts, starts, ids, encoded, n)
            with cache.lock:
                for ctx, start in zip(contexts, starts):
                    ctx._holding = ctx._holding.with_length(start + n)
        except BaseException:
            with cache.lock:
                for ctx, start in zip(contexts, starts):
                    ctx._keep_first(start)
            raise
    finally:
        recycle(cache.store, encoded)


def _write_rows(contexts: list[Context], starts: list[int], ids: list, encoded, n: int) -> None:
    """Each row's bytes into its pages, outside the lock (the caller truncates every row back on a failure)."""
    for row, ctx in enumerate(contexts):
        part = tuple(p[:, :, row * n:(row + 1) * n] for p in encoded)
        ctx._write(starts[row], starts[row] + n, ids[row], part)


def _rows(values, rows: int, what: str) -> list:
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    if not hasattr(values, "__len__") or len(values) != rows:
        raise ShapeError(f"{what} must have one row per context ({rows}), got {values!r:.80}")
    return list(values)


def _make_pages(cache, contexts: list[Context], starts: list[int], n: int) -> None:
    """Each context's pages for ``[start, start + n)``, private: ``extend``'s critical section, once
    for the batch (the pool policy asked once for every row's pages)."""
    cache.pool.make_room(_pages_needed(contexts, starts, n))
    for ctx, start in zip(contexts, starts):      # a failure part way: the caller truncates every row back
        ctx._grow(start, start + n)


def _pages_needed(contexts: list[Context], starts: list[int], n: int) -> int:
    """The pages the rows' extends take from the pool, one after another: each row's new pages, and
    a copy of its partly filled last page where that page is shared. A page shared by k of the rows
    and nobody else is copied for k - 1 of them: the last writes it in place, as its refcount is then
    1 (``writable``); counted as k copies, a batch was refused where the extends one by one fit."""
    fresh, shared = 0, {}
    for ctx, start in zip(contexts, starts):
        first, end = pages_touched(start, start + n, ctx.page_tokens)
        pages = ctx._pages
        fresh += end - len(pages)
        if first < len(pages) and pages[first].refcount > 1:
            page = pages[first]
            shared[page.page_id] = (page, shared.get(page.page_id, (page, 0))[1] + 1)
    return fresh + sum(k - (k == page.refcount) for page, k in shared.values())
