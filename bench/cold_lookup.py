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
from .traffic_workload import FULL, QUICK, TINY, workload

COMMAND = "python -m kvstate.bench.cold_lookup"
KV_COLD, KV_WARM = "kvstate, after its extend", "kvstate, at once again"
SGL_BACK, SGL_WRITE, SGL_AFTER_OURS = "SGLang, back to back", "SGLang, after its K/V write", "SGLang, after kvstate's extend"


def replay_kvstate(requests: list[np.ndarray], page: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Seconds per request of the first and of the second lookup, and the tokens matched."""
    from kvstate.impl import Cache

    cache = Cache(TINY, page_tokens=page, max_entries=len(requests) + 1, match="token")
    zeros = np.zeros((max(map(len, requests)), *cache.layout.position_shape), np.float32)
    first, again = np.zeros(len(requests)), np.zeros(len(requests))
    matched_tokens, clock = 0, time.perf_counter
    for i, tokens in enumerate(requests):
        t0 = clock()
        ctx, matched = cache.match(tokens)
        t1 = clock()
        twin, _ = cache.match(tokens)
        t2 = clock()
        twin.close()
        ctx.extend(tokens[matched:], zeros[:len(tokens) - matched])
        cache.retain(ctx)
        ctx.close()
        first[i], again[i] = t1 - t0, t2 - t1
        matched_tokens += matched
    return first, again, matched_tokens


def replay_sglang(requests: list[np.ndarray], page: int, between: str | None) -> tuple[np.ndarray, int]:
    """Seconds per request of SGLang's lookup, and the tokens matched; ``between``: the untimed work
    between a lookup and its insert (None, ``"write"`` or ``"kvstate"``), so before the next lookup."""
    import torch

    from kvstate.engines.sglang_loader import load_radix_cache
    from kvstate.impl import Cache

    rc = load_radix_cache()
    tree = rc.RadixCache.create_simulated(page_size=page)
    keys = [array("q", tokens.tolist()) for tokens in requests]     # SGLang's key type, made untimed
    total = sum(map(len, keys))
    slots = torch.arange(total, dtype=torch.int64)
    pool = torch.zeros((total, *TINY.position_shape))
    side = Cache(TINY, page_tokens=page, max_entries=1, match="token") if between == "kvstate" else None
    zeros = np.zeros((max(map(len, requests)), *TINY.position_shape), np.float32)
    lookup_s, matched_tokens, next_slot, clock = np.zeros(len(keys)), 0, 0, time.perf_counter
    for i, key in enumerate(keys):
        t0 = clock()
        hit = tree.match_prefix(rc.MatchPrefixParams(key=rc.RadixKey(key)))
        tree.inc_lock_ref(hit.last_device_node)
        lookup_s[i] = clock() - t0
        matched = hit.device_prefix_len
        value = slots[next_slot:next_slot + len(key)]
        next_slot += len(key)
        if between == "write":
            new = value[matched:]
            pool[new] = torch.from_numpy(zeros[:len(new)])
        elif between == "kvstate":
            ctx = side.allocate()
            ctx.extend(requests[i][matched:], zeros[:len(key) - matched])
            ctx.close()
        tree.insert(rc.InsertParams(key=rc.RadixKey(key), value=value))
        tree.dec_lock_ref(hit.last_device_node)
        matched_tokens += matched
    return lookup_s, matched_tokens


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
    from .versus_sglang import sglang_missing

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
