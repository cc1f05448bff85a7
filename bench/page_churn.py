"""What pages as slabs would buy at one-token pages, measured before building them.

    python -m kvstate.bench.page_churn [--rounds N] [--quick]

``versus_sglang``'s divergent workload (only the system prompt shared) served by ``serve_requests``
(``match``, then ``extend``, ``retain``, ``close``), three ways, rounds interleaved, each request
keeping its fastest round:

- ``page 1``: one-token pages, as SGLang runs by default. An ``extend`` makes one ``Page`` per
  token, each with its own small allocations (``per_page_allocations`` counts them).
- ``page 64``: the same requests at 64-token pages, 64 times fewer of them.
- ``page 64 + churn``: page 64, with every request followed by allocations made by hand, as
  many and as large as a one-token-page ``extend`` of its new tokens makes (``churn``), and kept
  alive as pages are.

A lookup does nearly the same work at both page sizes (the tree walk compares packed tokens,
and a hit's pages are shared as one run of refcount slots), so if ``page 64 + churn`` is as slow as
``page 1``, what one-token pages cost a lookup is those allocations leaving the caches cold,
and pages as slabs (one allocation per ``extend``, not several per token) would bring it to
``page 64``'s time. ``lookup vs page 1`` is page 1's time over the row's.
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


class _PageLike:
    """A slotted object of ``impl.pages.Page``'s size."""

    __slots__ = ("page_id", "ref", "books", "buffer", "token_bytes", "filled")

    def __init__(self, page_id: int, ref: int, buffer, token_bytes: bytearray):
        self.page_id, self.ref, self.books, self.buffer, self.token_bytes, self.filled = \
            page_id, ref, None, buffer, token_bytes, 1


def per_page_allocations(positions: int = 700) -> float:
    """Memory blocks a one-token-page ``extend`` allocates per page, counted (``sys.getallocatedblocks``)."""
    from kvstate.impl import Cache

    cache = Cache(TINY, page_tokens=1, max_entries=4)
    kv = np.zeros((positions, *TINY.position_shape), np.float32)
    warm = cache.allocate()
    warm.extend(np.arange(positions), kv)      # the pool's arrays grown once, outside the count
    ctx = cache.allocate()
    gc.collect()
    gc.disable()          # nothing else freed while counting
    try:
        before = sys.getallocatedblocks()
        ctx.extend(np.arange(positions) + positions, kv)
        return (sys.getallocatedblocks() - before) / positions
    finally:
        gc.enable()


def churn(positions: int, kept: list, next_id: list) -> None:
    """Allocations like a one-token-page ``extend`` of ``positions`` tokens makes, kept alive: per
    position a ``Page``-sized object, a page id and a refcount slot past the small-int cache, its
    token bytes and a one-position values array in a tuple in a holder (as many blocks as
    ``per_page_allocations`` counts for a page, give or take one)."""
    made = []
    start = next_id[0]
    for i in range(start, start + positions):
        made.append(_PageLike(i + 1000, i + 2000, [(np.zeros((1, 2, 1, 1), np.float32),)], bytearray(8)))
    next_id[0] = start + positions
    kept.append(made)


def measure(queries: list[np.ndarray], rounds: int) -> list[dict]:
    """A row per way of serving ``queries``: mean lookup and retain time over their fastest rounds."""
    from kvstate.impl import Cache

    def cache(page: int):
        return Cache(TINY, page_tokens=page, max_entries=len(queries) + 1, match="token")

    ways = {"page 1": lambda: serve_requests(cache(1), queries),
            "page 64": lambda: serve_requests(cache(64), queries),
            "page 64 + churn": lambda: serve_with_churn(cache(64), queries)}
    best: dict[str, list] = {}
    for _ in range(rounds):
        for name, replay in ways.items():
            match_s, retain_s, matched = replay()
            old = best.get(name)
            if old is not None:
                assert matched == old[2]        # counts do not depend on the round
                match_s, retain_s = np.minimum(match_s, old[0]), np.minimum(retain_s, old[1])
            best[name] = [match_s, retain_s, matched]
    base = best["page 1"][0].mean()
    return [{"way": name, "matched": matched, "lookup_us": 1e6 * m.mean(), "retain_us": 1e6 * r.mean(),
             "lookup_vs_page_1": base / m.mean()} for name, (m, r, matched) in best.items()]


def serve_with_churn(cache, queries: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, int]:
    """``serve_requests`` on ``cache``, each ``extend`` followed by ``churn`` of the positions it added
    (where a one-token-page extend makes them)."""
    kept: list = []
    next_id = [1 << 20]
    return serve_requests(cache, queries, after_extend=lambda added: churn(added, kept, next_id))


def run(rounds: int = 2, quick: bool = False) -> dict:
    sizes = QUICK if quick else FULL
    queries = workload("divergent", **sizes)
    started = time.perf_counter()
    rows = measure(queries, rounds)
    params = {**sizes, "requests": len(queries), "rounds": rounds,
              "per_page_allocations": round(per_page_allocations(), 2)}
    return {"name": "page_churn", "wall_s": time.perf_counter() - started, "params": params, "rows": rows,
            "command": COMMAND + (" --quick" if quick else "")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument("--quick", action="store_true", help="the small workload (seconds)")
    args = parser.parse_args(argv)
    from .run import format_result

    print(format_result(run(args.rounds, args.quick)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
