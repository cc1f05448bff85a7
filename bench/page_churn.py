"""What one-token pages cost a lookup and a retain, and how much of it pages as slabs would remove.

    python -m kvstate.bench.page_churn [--rounds N] [--quick]

``versus_sglang``'s divergent workload (only the system prompt shared), served by ``serve_requests``
(``match``, then ``extend``, ``retain``, ``close``) four ways, rounds interleaved, each request
keeping its fastest round:

- ``page 1``: one-token pages, as SGLang runs by default. An ``extend`` makes a ``Page`` per
  token, each with its own small allocations (``per_page_allocations`` counts them), and writes
  its tokens page by page.
- ``page 64``: the same requests at 64-token pages.
- ``page 64 + page-1 extend beside``: page 64, each extend preceded (untimed) by the same tokens'
  extend into a second cache of one-token pages, kept alive: all of a page-1 extend's per-page
  work, its allocations and its page-by-page writes, with no one-token page in the cache looked up.
- ``page 64 + allocations alone``: page 64, each extend preceded by allocations made by hand, as
  many and as large as a page-1 extend of its tokens leaves (``churn``), kept alive as pages are.

A lookup makes the same Python calls at both page sizes (the walk compares packed tokens, a hit's
pages are shared as one run of refcount slots), and so does a retain; what page 1 adds is the
extend before them leaving the caches cold, and the page-1 cache's own state being per page (not
timed apart here: the refcount runs a hit leaves pending cover a thousand slots, not sixteen, when
they are added up; the pool's live set and the holders' page tuples are 64 times longer).
``lookup_share`` and ``retain_share`` are each row's part of page 1's excess:
(row - page 64) / (page 1 - page 64).
The extend beside gives the extend's part, the allocations alone the part that pages made lighter,
but still one per token, could recover; the rest is the per-page state. Pages as slabs remove all
three: one allocation, one write and one refcount slot per ``extend``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import numpy as np

from .args import positive_int
from .one_token_pages import serve_requests
from .traffic_workload import FULL, QUICK, TINY, workload

COMMAND = "python -m kvstate.bench.page_churn"
PAGE_1, PAGE_64 = "page 1", "page 64"
BESIDE, ALLOCATIONS = "page 64 + page-1 extend beside", "page 64 + allocations alone"


class _BufferLike:
    """A slotted object of ``impl.numpy_store.NumpyBuffer``'s size."""

    __slots__ = ("arrays", "slot")

    def __init__(self, arrays: tuple):
        self.arrays, self.slot = arrays, None


class _PageLike:
    """A slotted object of ``impl.pages.Page``'s size."""

    __slots__ = ("page_id", "ref", "books", "table", "buffer")

    def __init__(self, page_id: int, ref: int, buffer):
        self.page_id, self.ref, self.books, self.table, self.buffer = page_id, ref, None, None, buffer


def _counted(make) -> tuple[float, int]:
    """(pymalloc blocks, objects the collector tracks) that ``make()`` leaves allocated."""
    gc.collect()
    gc.disable()          # nothing else freed while counting
    try:
        blocks, tracked = sys.getallocatedblocks(), len(gc.get_objects())
        make()
        return sys.getallocatedblocks() - blocks, len(gc.get_objects()) - tracked
    finally:
        gc.enable()


def per_page_allocations(positions: int = 700) -> tuple[float, float]:
    """(pymalloc blocks, collector-tracked objects) a one-token-page ``extend`` leaves per page, after a
    hit on a 1,000-page prefix as in the workload (NumPy's own buffers are malloc'd: not counted)."""
    from kvstate.impl import Cache

    cache = Cache(TINY, page_tokens=1, max_entries=4)
    prompt = cache.allocate()
    prompt.extend(np.arange(1000), np.zeros((1000, *TINY.position_shape), np.float32))
    cache.retain(prompt)
    warm, _ = cache.match(np.arange(1000))
    warm.extend(np.arange(positions) + 1000, np.zeros((positions, *TINY.position_shape), np.float32))
    ctx, _ = cache.match(np.arange(1000))
    tokens, kv = np.arange(positions) + 5000, np.zeros((positions, *TINY.position_shape), np.float32)
    blocks, tracked = _counted(lambda: ctx.extend(tokens, kv))      # the arguments made outside the count
    return blocks / positions, tracked / positions


def churn(positions: int, kept: list, next_id: list) -> None:
    """Allocations like those a one-token-page ``extend`` of ``positions`` tokens leaves, kept alive:
    per position a ``Page``-sized object, a page id and a refcount slot past the small-int cache,
    and a one-position values array in a tuple in a buffer object (its token ids are a row of the
    pool's table, made in one step)."""
    made = []
    start = next_id[0]
    for i in range(start, start + positions):
        made.append(_PageLike(i + 1000, i + 2000, _BufferLike((np.zeros((1, 2, 1, 1), np.float32),))))
    next_id[0] = start + positions
    kept.append(made)


def serve_four_ways(queries: list[np.ndarray]) -> dict:
    """Each way's replay: name -> a function returning ``serve_requests``' (match s, retain s, matched)."""
    from kvstate.impl import Cache

    def cache(page: int):
        return Cache(TINY, page_tokens=page, max_entries=len(queries) + 1, match="token")

    def beside():
        side, kept = Cache(TINY, page_tokens=1, max_entries=1), []
        zeros = np.zeros((max(map(len, queries)), *TINY.position_shape), np.float32)

        def extend_beside(tokens: np.ndarray) -> None:
            ctx = side.allocate()
            ctx.extend(tokens, zeros[:len(tokens)])
            kept.append(ctx)          # held, as the page-1 cache's entries hold its pages
        served = serve_requests(cache(64), queries, before_extend=extend_beside)
        return (*served, side.pool.allocated)

    def allocations():
        kept: list = []
        next_id = [1 << 20]
        return serve_requests(cache(64), queries, before_extend=lambda tokens: churn(len(tokens), kept, next_id))

    return {PAGE_1: lambda: serve_requests(cache(1), queries), PAGE_64: lambda: serve_requests(cache(64), queries),
            BESIDE: beside, ALLOCATIONS: allocations}


def measure(queries: list[np.ndarray], rounds: int) -> tuple[list[dict], int]:
    """A row per way: mean lookup and retain time over each request's fastest round, and each one's
    share of page 1's excess over page 64; and the pages the extends beside made."""
    best: dict[str, list] = {}
    side_pages = 0
    for _ in range(rounds):
        for name, replay in serve_four_ways(queries).items():
            match_s, retain_s, matched, *side = replay()
            if side:
                side_pages = side[0]
            old = best.get(name)
            if old is not None:
                assert matched == old[2]        # counts do not depend on the round
                match_s, retain_s = np.minimum(match_s, old[0]), np.minimum(retain_s, old[1])
            best[name] = [match_s, retain_s, matched]
            gc.collect()      # the last way's pages go before the next way starts
    (m1, r1, _), (m64, r64, _) = best[PAGE_1], best[PAGE_64]
    rows = [{"way": name, "matched": matched, "lookup_us": 1e6 * m.mean(), "retain_us": 1e6 * r.mean(),
             "lookup_share": (m.mean() - m64.mean()) / (m1.mean() - m64.mean()),
             "retain_share": (r.mean() - r64.mean()) / (r1.mean() - r64.mean())}
            for name, (m, r, matched) in best.items()]
    return rows, side_pages


def run(rounds: int = 3, quick: bool = False) -> dict:
    sizes = QUICK if quick else FULL
    queries = workload("divergent", **sizes)
    started = time.perf_counter()
    rows, side_pages = measure(queries, rounds)
    blocks, tracked = per_page_allocations()
    params = {**sizes, "requests": len(queries), "rounds": rounds, "blocks_per_page": round(blocks, 2),
              "tracked_objects_per_page": round(tracked, 2)}
    return {"name": "page_churn", "wall_s": time.perf_counter() - started, "params": params, "rows": rows,
            "pages_made_beside": side_pages,
            "command": COMMAND + (f" --rounds {rounds}" if rounds != 3 else "") + (" --quick" if quick else "")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="the small workload: a smoke run, too small to show the effect")
    args = parser.parse_args(argv)
    from .run import format_result, timed

    print(format_result(timed(lambda: run(args.rounds, args.quick))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
