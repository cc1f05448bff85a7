"""Prefix reuse on agent traffic: many conversations re-sending their history, each request a match then a retain.

Workload (the issue's): 200 conversations x 10 turns, every conversation starting
with the same 1,000-token system prompt (tool definitions included), each turn
adding 50-200 tokens, requests of all conversations interleaved at random. A
request matches its full token list, extends the matched context with the
tokens the tree did not have, and retains it. A tiny layout (one value per
position) keeps the K/V copy out of the measurement: this times the tree.
"""

from __future__ import annotations

import time

import numpy as np

from kvstate.impl import Cache
from kvstate.spec.layout import Layout

TINY = Layout(1, 1, 1)


def workload(conversations: int = 200, turns: int = 10, system_tokens: int = 1000, seed: int = 0):
    """The requests in arrival order: each a token array (system prompt + history + this turn)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 50000, system_tokens)
    histories = [system] * conversations
    order = np.repeat(np.arange(conversations), turns)
    rng.shuffle(order)              # each conversation's turns stay in order; conversations interleave
    requests = []
    for c in order:
        histories[c] = np.concatenate([histories[c], rng.integers(0, 50000, rng.integers(50, 201))])
        requests.append(histories[c])
    return requests


def replay(requests) -> dict:
    """Serve ``requests`` on a fresh cache; seconds spent in match and retain, and what was reused."""
    cache = Cache(TINY, page_tokens=64, max_entries=len(requests) + 1)
    with cache.allocate() as system:      # a server retains the shared system prompt once, up front
        system.extend(requests[0][:1000], np.zeros((1000, *TINY.position_shape), np.float32))
        cache.retain(system)
    totals = dict(match_s=0.0, retain_s=0.0, matched=0, tokens=0, hits=0)
    for tokens in requests:
        t0 = time.perf_counter()
        ctx, matched = cache.match(tokens)
        t1 = time.perf_counter()
        fresh = len(tokens) - matched
        ctx.extend(tokens[matched:], np.zeros((fresh, *TINY.position_shape), np.float32))
        t2 = time.perf_counter()
        cache.retain(ctx)
        t3 = time.perf_counter()
        ctx.close()
        totals["match_s"] += t1 - t0
        totals["retain_s"] += t3 - t2
        totals["matched"] += matched
        totals["tokens"] += len(tokens)
        totals["hits"] += matched > 0
    return totals


def run(quick: bool = False, repeat: int = 3) -> dict:
    conversations = 50 if quick else 200
    requests = workload(conversations)
    runs = [replay(requests) for _ in range(repeat)]      # the fastest replay: the least disturbed by other load
    best = min(runs, key=lambda r: r["match_s"] + r["retain_s"])
    n = len(requests)
    return {
        "name": "agent_traffic",
        "params": {"conversations": conversations, "turns": 10, "system_tokens": 1000, "requests": n,
                   "best_of": repeat},
        "rows": [{
            "requests": n,
            "hit_rate": best["hits"] / n,
            "tokens_not_reprefilled": best["matched"],
            "token_reuse": best["matched"] / best["tokens"],
            "match_per_s": n / best["match_s"],
            "retain_per_s": n / best["retain_s"],
            "ns_per_matched_token": 1e9 * best["match_s"] / max(best["matched"], 1),
        }],
        "targets": {"match_per_s": 30000, "retain_per_s": 25000},
    }


if __name__ == "__main__":
    print(run())
