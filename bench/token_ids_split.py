"""``TokenIds + turn``'s lookup split into the growth of the ids and the ``match``, and the growth into its parts.

    python -m kvstate.bench.token_ids_split [--page 64] [--rounds 3] [--quick]

``versus_sglang``'s divergent workload (only the system prompt shared), replayed as its
``TokenIds + turn`` row replays it: each request grows its conversation's ids by the turn (a list,
built before the replay, so its ints are as cold as the bench leaves them), then ``match``, then the
untimed ``extend``, ``retain`` and ``close``. Growth and match are timed apart. The growth is timed
again with the list's packing (``query._from_marshal``) replaced by stand-ins doing less: no pass at
all, ``marshal`` alone, ``marshal`` and the payload gather; each step's difference is what that part
costs inside the replay, cold. Rounds are interleaved, every request keeps its fastest round.
"""

from __future__ import annotations

import argparse
import marshal
import time
from contextlib import contextmanager

import numpy as np

from kvstate.impl import query

from .args import positive_int
from .traffic_workload import FULL, QUICK, TINY, workload
from .versus_sglang import conversation_bases, grown_keys

_I4 = np.dtype("<i4")


def _no_pass(items: list) -> bytes:
    return bytes(4 * len(items))


def _marshal_only(items: list) -> bytes:
    marshal.dumps(items, 2)
    return bytes(4 * len(items))


def _marshal_and_gather(items: list) -> bytes:
    out = marshal.dumps(items, 2)
    return np.ndarray((len(items),), _I4, out, 6, (5,)).tobytes()


# stand-in -> what it leaves out of ``_from_marshal``; the real one last
PACKERS = {"no pass": _no_pass, "marshal": _marshal_only, "marshal + gather": _marshal_and_gather,
           "marshal + gather + checks": None}


@contextmanager
def _packing_by(packer):
    real = query._from_marshal
    query._from_marshal = packer or real
    try:
        yield
    finally:
        query._from_marshal = real


def replay(requests, bases, turns, system_tokens: int, page: int) -> tuple[np.ndarray, np.ndarray]:
    """Seconds per request in the growth and in the ``match``."""
    from kvstate.impl import Cache, TokenIds

    cache = Cache(TINY, page_tokens=page, max_entries=len(requests) + 1, match="token")
    grown = grown_keys(TokenIds(requests[0][:system_tokens].tolist()), bases, turns)
    zeros = np.zeros((max(map(len, requests)), *cache.layout.position_shape), np.float32)
    growth_s, match_s = np.zeros(len(requests)), np.zeros(len(requests))
    clock = time.perf_counter
    for i, tokens in enumerate(requests):
        t0 = clock()
        ids = grown(i)
        t1 = clock()
        ctx, matched = cache.match(ids)
        t2 = clock()
        ctx.extend(tokens[matched:], zeros[:len(tokens) - matched])
        cache.retain(ctx)
        ctx.close()
        growth_s[i], match_s[i] = t1 - t0, t2 - t1
    return growth_s, match_s


def run(page: int = 64, rounds: int = 3, quick: bool = False) -> dict[str, tuple[float, float]]:
    """Mean µs of (growth, match) per packer, each request's fastest round."""
    sizes = QUICK if quick else FULL
    requests = workload("divergent", **sizes)
    system_tokens = sizes["system_tokens"]
    bases = conversation_bases(requests, system_tokens)
    lists = [tokens.tolist() for tokens in requests]
    turns = [lists[i][len(requests[b]) if b >= 0 else system_tokens:] for i, b in enumerate(bases)]
    best: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for _ in range(rounds):
        for name, packer in PACKERS.items():
            with _packing_by(packer):
                growth, match = replay(requests, bases, turns, system_tokens, page)
            if name in best:
                growth, match = np.minimum(best[name][0], growth), np.minimum(best[name][1], match)
            best[name] = growth, match
    return {name: (1e6 * growth.mean(), 1e6 * match.mean()) for name, (growth, match) in best.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvstate.bench.token_ids_split", description=__doc__)
    parser.add_argument("--page", type=positive_int, default=64)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    results = run(args.page, args.rounds, args.quick)
    previous = 0.0
    for name, (growth, match) in results.items():
        print(f"{name:>26}: growth {growth:6.2f} us (+{growth - previous:5.2f})   match {match:5.2f} us")
        previous = growth
    print(f"reproduce: python -m kvstate.bench.token_ids_split --page {args.page} --rounds {args.rounds}"
          + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
