"""Where a bounded ``retain``'s time goes at one-token pages, function by function (``cProfile``).

    python -m kvstate.bench.retain_profile [--skip-frees] [--top 12] [--quick]

``bounded_vs_sglang``'s kvstate side (its divergent workload, ``token`` matching, ``max_pages`` its
budget), served as ``one_token_pages.serve_requests`` serves it, with the profiler on around each
``retain`` only. Prints each function's share of the profiled time, its own (``tottime``) and with
what it calls (``cumtime``); ``--skip-frees`` profiles ``bounded_vs_sglang``'s floor row instead
(``skip_frees``: no page freed). Shares, not times: the profiler's cost is per call, so it weighs
per-page loops more than they weigh unprofiled (a retain takes ~3x as long under it).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import numpy as np

from .args import positive_int
from .bounded_vs_sglang import BUDGET, QUICK_BUDGET, skip_frees
from .traffic_workload import FULL, QUICK, TINY, workload


def profile(quick: bool = False, frees: bool = True) -> pstats.Stats:
    """The profile of every ``retain`` of one replay."""
    from kvstate.impl import Cache

    requests = workload("divergent", **(QUICK if quick else FULL))
    budget = QUICK_BUDGET if quick else BUDGET
    cache = Cache(TINY, page_tokens=1, match="token", max_pages=budget, max_entries=len(requests) + 1)
    if not frees:
        skip_frees(cache.pool)
    zeros = np.zeros((max(map(len, requests)), *cache.layout.position_shape), np.float32)
    profiler = cProfile.Profile()
    for tokens in requests:
        ctx, matched = cache.match(tokens)
        ctx.extend(tokens[matched:], zeros[:len(tokens) - matched])
        profiler.enable()
        cache.retain(ctx)
        profiler.disable()
        ctx.close()
    return pstats.Stats(profiler)


def shares(stats: pstats.Stats, top: int) -> list[tuple[float, float, int, str]]:
    """``(own share, cumulative share, calls, function)`` of the ``top`` functions by their own time."""
    rows = stats.stats.items()      # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    total = sum(own for _, (_, _, own, _, _) in rows)
    ranked = sorted(rows, key=lambda row: row[1][2], reverse=True)[:top]
    return [(own / total, cumulative / total, calls, pstats.func_std_string(where))
            for where, (_, calls, own, cumulative, _) in ranked]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvstate.bench.retain_profile", description=__doc__.split("\n")[0])
    parser.add_argument("--skip-frees", action="store_true", help="the floor row: no page freed")
    parser.add_argument("--top", type=positive_int, default=12, help="functions shown, by their own time")
    parser.add_argument("--quick", action="store_true", help="a small workload (a smoke run)")
    args = parser.parse_args(argv)
    print(f"{'own':>6} {'cumul':>6} {'calls':>8}  function (shares of the profiled retains)")
    for own, cumulative, calls, where in shares(profile(args.quick, frees=not args.skip_frees), args.top):
        print(f"{own:6.1%} {cumulative:6.1%} {calls:8d}  {where}")
    options = " --skip-frees" * args.skip_frees + (f" --top {args.top}" if args.top != 12 else "") + " --quick" * args.quick
    print(f"reproduce: python -m kvstate.bench.retain_profile{options}")


if __name__ == "__main__":
    main()
