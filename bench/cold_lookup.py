"""How much of a lookup is the caches the work before it left cold, kvstate's and SGLang's alike.

    python -m kvstate.bench.cold_lookup [--workload divergent] [--page 1 --page 64] [--rounds 3] [--quick]

``versus_sglang`` times kvstate's lookup right after the request before it was extended, retained
and closed, and SGLang's right after its ``insert``: kvstate's ``extend`` (writing the request's K/V
into pages) runs between two of its lookups, and nothing of the kind runs between two of SGLang's.
This bench replays the same requests five ways, rounds interleaved, each request keeping its fastest
round, and times only the lookup (kvstate ``match``; SGLang ``match_prefix`` + ``inc_lock_ref``):

- ``kvstate, after its extend``: as ``versus_sglang`` times it (int64 arrays, ``token`` semantics);
- ``kvstate, at once again``: the same query matched a second time right after the first (that hit
  closed untimed): its lookup with the caches as the first left them;
- ``SGLang, back to back``: as ``versus_sglang`` times it;
- ``SGLang, after its K/V write``: between its lookup and its insert, untimed, the request's new
  positions written into a token-indexed torch pool, as its forward's ``set_kv_buffer`` writes them;
- ``SGLang, after kvstate's extend``: the same, but the untimed work is kvstate's own ``extend`` of
  the request's new tokens into a cache beside it: SGLang's lookup after what kvstate's lookup follows.

So the first row against the fourth is kvstate beside SGLang each after its own K/V write, and the
first against the fifth, each after the same work. Each row prints its tokens matched: equal within
each engine, or the rows are not the same requests, and across engines at page 1 (above it SGLang
matches whole pages only, kvstate's ``token`` semantics any length).
"""

from __future__ import annotations

import argparse
import time
from array import array

import numpy as np

from .args import positive_int
from .one_token_pages import serve_requests
from .traffic_workload import FULL, QUICK, TINY, workload
from .versus_sglang import replay_sglang as versus_sglang_replay, sglang_missing

COMMAND = "python -m kvstate.bench.cold_lookup"
KV_COLD, KV_WARM = "kvstate, after its extend", "kvstate, at once again"
SGL_BACK, SGL_WRITE, SGL_AFTER_OURS = "SGLang, back to back", "SGLang, after its K/V write", "SGLang, after kvstate's extend"


def replay_kvstate(requests: list[np.ndarray], page: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Seconds per request of the first lookup (``one_token_pages.serve_requests``, as ``versus_sglang``
    times it) and of the same lookup again at once (timed the same way, then closed), and the tokens matched."""
    from kvstate.impl import Cache

    cache = Cache(TINY, page_tokens=page, max_entries=len(requests) + 1, match="token")
    again, order, clock = np.zeros(len(requests)), iter(range(len(requests))), time.perf_counter

    def match_again(_new_tokens) -> None:       # ``serve_requests``' untimed hook before each extend
        i = next(order)
        t0 = clock()
        twin, matched = cache.match(requests[i])
        if page > 1 and matched % page and matched < len(requests[i]):
            cache.pool.books.counts         # noqa: B018 - the hold's flush, timed as serve_requests times it
        again[i] = clock() - t0
        twin.close()

    first, _retain_s, matched = serve_requests(cache, requests, before_extend=match_again)
    return first, again, matched


def replay_sglang(requests: list[np.ndarray], page: int, between: str | None) -> tuple[np.ndarray, int]:
    """Seconds per request of SGLang's lookup (``versus_sglang.replay_sglang``), and the tokens matched;
    ``between``: the untimed work between a lookup and its insert (None, ``"write"`` or ``"kvstate"``), so
    before the next lookup."""
    import torch

    from kvstate.impl import Cache

    keys = [array("q", tokens.tolist()) for tokens in requests]     # SGLang's key type, made untimed
    zeros = np.zeros((max(map(len, requests)), *TINY.position_shape), np.float32)
    pool = torch.zeros((sum(map(len, keys)), *TINY.position_shape))
    side = Cache(TINY, page_tokens=page, max_entries=1, match="token")

    def write(i: int, matched: int, value) -> None:      # its forward's K/V write, ``set_kv_buffer``'s
        new = value[matched:]
        pool[new] = torch.from_numpy(zeros[:len(new)])

    def kvstate_extend(i: int, matched: int, value) -> None:
        with side.allocate() as ctx:
            ctx.extend(requests[i][matched:], zeros[:len(requests[i]) - matched])

    hook = {None: None, "write": write, "kvstate": kvstate_extend}[between]
    lookup_s, _insert_s, matched = versus_sglang_replay(keys, page, between=hook)
    return lookup_s, matched


def measure(requests: list[np.ndarray], page: int, rounds: int) -> dict[str, tuple[float, int]]:
    """Mean µs of each contender's lookup (each request's fastest round) and its tokens matched."""
    best: dict[str, np.ndarray] = {}
    hits: dict[str, int] = {}

    def keep(name: str, seconds: np.ndarray, matched: int) -> None:
        best[name] = seconds if name not in best else np.minimum(best[name], seconds)
        hits[name] = matched

    for _ in range(rounds):
        first, again, matched = replay_kvstate(requests, page)
        keep(KV_COLD, first, matched)
        keep(KV_WARM, again, matched)
        for name, between in ((SGL_BACK, None), (SGL_WRITE, "write"), (SGL_AFTER_OURS, "kvstate")):
            keep(name, *replay_sglang(requests, page, between))
    return {name: (1e6 * seconds.mean(), hits[name]) for name, seconds in best.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("divergent", "shared"), default="divergent")
    parser.add_argument("--page", type=positive_int, action="append", help="page size (repeatable; default 1 and 64)")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--quick", action="store_true", help="a small workload: a smoke run, its timings judge nothing")
    args = parser.parse_args(argv)
    missing = sglang_missing()
    if missing:
        print(f"{COMMAND}: {missing}")
        return 2
    requests = workload(args.workload, **(QUICK if args.quick else FULL))
    pages = args.page or [1, 64]
    for page in pages:
        rows = measure(requests, page, args.rounds)
        print(f"{args.workload}, page {page}: lookup us (tokens matched)")
        for name, (us, matched) in rows.items():
            print(f"  {name:>32}: {us:7.2f}  ({matched})")
        cold = rows[KV_COLD][0]
        print(f"  kvstate after its extend vs SGLang back to back {rows[SGL_BACK][0] / cold:.2f}x, each after its "
              f"own K/V write {rows[SGL_WRITE][0] / cold:.2f}x, each after kvstate's extend "
              f"{rows[SGL_AFTER_OURS][0] / cold:.2f}x; kvstate at once again vs SGLang back to back "
              f"{rows[SGL_BACK][0] / rows[KV_WARM][0]:.2f}x")
    print(f"reproduce: {COMMAND} --workload {args.workload}" + "".join(f" --page {page}" for page in pages)
          + f" --rounds {args.rounds}" + (" --quick" if args.quick else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
