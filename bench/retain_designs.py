"""A bounded ``retain`` at one-token pages under designs short of pages as slabs, in one process.

    python -m kvstate.bench.retain_designs [--rounds 3] [--quick]

``bounded_vs_sglang``'s kvstate side (its divergent workload, ``token`` matching, ``max_pages`` its
budget), timed per request in ``retain`` alone, the rounds interleaved, each request's fastest round:

- ``kept spares``: the cache as it is (the NumPy store keeps freed buffers for the next extend);
- ``buffers let go``: the store frees nothing into its spares, so each freed page's buffer is
  deallocated inside the retain (the pool's ``_free_buffers`` a no-op);
- ``page arena``: the same cache on a page arena past the budget, whose slots go back one page at a time;
- ``frees skipped``: ``bounded_vs_sglang``'s floor (``skip_frees``), no page freed at all;
- ``pages kept``: every free as it is, but the freed ``Page`` objects kept alive (their deallocation
  out of the retain): beside ``kept spares``, what letting a page's objects go costs;
- ``buffers kept``: the freed buffers neither handed to the store nor deallocated (the store's
  ``free_all`` out of the retain): beside ``kept spares``, what the store's free loop costs;
- ``one free run``: an extend takes the first run of free slots long enough for it, found in the
  pool's free mask, else the lowest free slots as now: an evicted entry's slots are then one
  stretch more often, for the slice paths of a release (they are 2-8 stretches in most frees).
"""

from __future__ import annotations

import argparse

import numpy as np

from .args import positive_int
from .bounded_vs_sglang import BUDGET, QUICK_BUDGET, skip_frees
from .one_token_pages import serve_requests
from .traffic_workload import FULL, QUICK, TINY, workload


def _let_buffers_go(pool) -> None:
    pool._free_buffers = lambda buffers: None


def _keep_freed_pages(pool) -> None:
    kept, free = [], pool._free

    def free_keeping_pages(pages, slots, *release) -> None:
        kept.append(list(pages))
        free(pages, slots, *release)

    pool._free = free_keeping_pages


def _keep_freed_buffers(pool) -> None:
    pool._free_buffers = [].append      # each release's buffers kept in a list nobody reads


def _take_one_free_run(pool) -> None:
    lowest = pool._take_slots

    def take(count: int):
        if 1 < count <= pool._free_slots:
            start = pool._lowest_free
            free = np.flatnonzero(pool._free_mask[start:pool._next_ref])
            if len(free) >= count:
                breaks = np.flatnonzero(np.diff(free) != 1) + 1
                starts, ends = np.r_[0, breaks], np.r_[breaks, len(free)]
                fits = np.flatnonzero(ends - starts >= count)
                if len(fits):
                    first = start + int(free[starts[fits[0]]])
                    pool._free_mask[first:first + count] = False
                    pool._free_slots -= count
                    if first == pool._lowest_free:      # still no free slot below it
                        pool._lowest_free = first + count
                    return range(first, first + count)
        return lowest(count)
    pool._take_slots = take


DESIGNS = {"kept spares": (0, None), "buffers let go": (0, _let_buffers_go), "page arena": (1, None),
           "frees skipped": (0, skip_frees), "pages kept": (0, _keep_freed_pages),
           "buffers kept": (0, _keep_freed_buffers),
           "one free run": (0, _take_one_free_run)}      # name -> (arena past the budget?, what is done to the pool)


def cache_for(design: str, requests: list[np.ndarray], budget: int):
    """The cache ``design`` names, bounded to ``budget`` pages, for ``requests``."""
    from kvstate.impl import Cache

    arena, change = DESIGNS[design]
    cache = Cache(TINY, page_tokens=1, match="token", max_pages=budget, max_entries=len(requests) + 1,
                  arena_pages=budget + 4000 if arena else 0)
    if change is not None:
        change(cache.pool)
    return cache


def run(rounds: int = 3, quick: bool = False) -> dict[str, float]:
    """Mean µs of a retain per design, each request's fastest round."""
    requests = workload("divergent", **(QUICK if quick else FULL))
    budget = QUICK_BUDGET if quick else BUDGET
    best: dict[str, np.ndarray] = {}
    for _ in range(rounds):
        for name in DESIGNS:
            seconds = serve_requests(cache_for(name, requests, budget), requests)[1]
            best[name] = seconds if name not in best else np.minimum(best[name], seconds)
    return {name: 1e6 * seconds.mean() for name, seconds in best.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvstate.bench.retain_designs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--quick", action="store_true", help="a few small conversations (a smoke run)")
    args = parser.parse_args(argv)
    for name, micros in run(args.rounds, args.quick).items():
        print(f"{name:>15}: retain {micros:7.1f} us")
    print(f"reproduce: python -m kvstate.bench.retain_designs --rounds {args.rounds}" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
