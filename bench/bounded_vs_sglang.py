"""Both trees bounded, at one-token pages: kvstate's ``retain`` (its evictions inside) beside SGLang's
``evict`` and ``insert``, side by side in one process.

    python -m kvstate.bench.bounded_vs_sglang [--budget TOKENS] [--rounds N] [--quick]

``versus_sglang`` lets both trees keep every request, so nothing is ever evicted or freed. A server's
pool is bounded: SGLang's scheduler calls ``evict`` for the tokens a request needs before allocating
them, and a kvstate cache under ``max_pages`` evicts least recently used entries inside ``retain``.
Here both run ``agent_traffic``'s divergent workload (only the 1,000-token system prompt shared) at
page size 1 (SGLang's default, where per-page work is per token), SGLang bounded to ``--budget``
tokens (default 71,000: the prompt and about a hundred requests' own tokens) and kvstate to as many
requests (below):

- SGLang 0.5.23's own ``RadixCache`` and token allocator (``kvstate.engines.sglang_loader``):
  *lookup* = ``match_prefix`` + ``inc_lock_ref``; *insert* = ``evict`` of what the budget lacks for
  the request's new tokens (``evictable_size`` + ``protected_size`` held) and ``insert`` of the key;
  the ``alloc`` of the new tokens' slots between them, and ``dec_lock_ref``, untimed, as kvstate's
  allocation (in ``extend``) is. At the end every slot is in the tree or back in the allocator (checked).
- kvstate ``token`` semantics, ``max_pages`` derived from the budget (``kvstate_max_pages``):
  *lookup* = ``match``; *insert* = ``retain``, which evicts; ``extend`` and ``close`` untimed
  (``one_token_pages.serve_requests``).

The two bounds are not the same rule: SGLang counts the tokens its tree holds, shared ones once;
kvstate's ``max_pages`` counts each entry's pages as if nothing were shared (``impl/tree_bounds.py``).
The same number for both left kvstate's tree holding well under half SGLang's requests (about 42
against 121 on the mean over the run at the default budget), and SGLang's ``evict`` heapifies every
evictable leaf on each call, so its inserts did more work for its larger tree (review 5 measured
about 15% at this budget). So the
trees are sized to hold as many requests, by this rule: SGLang keeps its ``--budget`` tokens; both
trees are simulated on the workload's request sizes (each keeps its most recent requests: least
recently used, and no request past the prompt is hit again), SGLang's counting the prompt once and
kvstate's in every entry, and kvstate's ``max_pages`` is the smallest whose mean requests held over
the run reaches SGLang's (``kvstate_max_pages``). A fixed budget cannot match at every request:
requests grow over the run, so kvstate holds fewer than SGLang early and more late (at the default
budget 0.63-1.69x SGLang's count once both evict, ending at 91 against 55). ``requests_held_mean``
and ``requests_held_at_end`` (SGLang's leaves, kvstate's entries, counted untimed after each insert)
print what each held, and a target checks the means agree within 10%. Where only the system prompt is shared both keep every hit
on it, so the hit rates agree (checked: within 0.01% of the tokens looked up; the trees differ at
their edges, where a request's first new token happens to match a kept one), and each request
evicts about one request's own tokens on either side (``freed_per_request``: tokens SGLang's
``evict`` returned, pages kvstate freed; ``insert_us_per_freed`` divides an insert's time by them;
``held_at_end``: tokens in SGLang's tree, pages live in kvstate's, whose entries share the prompt's
pages). On ``shared`` traffic the two
rules keep different trees, so it is not run here. Rounds interleaved; each request keeps its
fastest round.
"""

from __future__ import annotations

import argparse
import time
from array import array

import numpy as np

from .args import positive_int
from .one_token_pages import serve_requests
from .traffic_workload import FULL, QUICK, TINY, workload
# TARGET: issue 26's, whose workloads keep every request (this one evicts)
from .versus_sglang import SGLANG, TARGET, print_beside_sglang, rounds_option

KVSTATE = "kvstate token"
FLOOR = "kvstate, frees skipped (floor)"
BUDGET, QUICK_BUDGET = 71_000, 400
COMMAND = "python -m kvstate.bench.bounded_vs_sglang"
# What a page-1 retain still does per page, and what would pass (``speed_verdict``).
SLABS = ("each page is still its own objects, let go one by one (the Page, its id and slot, and its buffer, which "
         "the store keeps for the next extend); and with none of that (the floor) a retain still steps every "
         "refcount slot its victim holds as vectors (a gather, a subtract, a scatter, a search for zeros; flushing a "
         "fork's pending count is another scatter), at a few µs a NumPy call; design that passes both: pages as slabs "
         "(no object a page, an entry's pages a run of slots freed in one step, as SGLang frees a node's token slots "
         "in one tensor op) whose runs carry one count a holder, so a release is a few integer steps a run, not "
         "vector steps over its slots")


def requests_held(costs, cap: int) -> np.ndarray:
    """After each request, how many requests a tree keeping the most recent ones within ``cap`` holds,
    each costing ``costs[i]``: least recently used eviction on divergent traffic, where no request is hit
    again (only the prompt is), so the most recent ones are kept."""
    held, total, oldest = np.zeros(len(costs), np.int64), 0, 0
    for i, cost in enumerate(costs):
        total += int(cost)
        while total > cap and oldest < i:
            total -= int(costs[oldest])
            oldest += 1
        held[i] = i + 1 - oldest
    return held


def kvstate_max_pages(requests: list[np.ndarray], budget: int, system_tokens: int) -> int:
    """kvstate's ``max_pages`` (page size 1) that holds, on the mean over the run, as many requests as SGLang's
    ``budget`` tokens. SGLang holds the system prompt ``S`` once and each request's own tokens; kvstate's
    budget counts ``S`` in every entry. Both are simulated (``requests_held``) and the smallest page budget
    whose mean held reaches SGLang's is taken. A fixed budget cannot match at every request: requests grow
    over the run and the two rules weigh ``S`` differently, so kvstate holds fewer than SGLang early
    (short requests) and more late (long ones); the run prints both means and both ends."""
    own = np.array([len(tokens) - system_tokens for tokens in requests])
    target = requests_held(own, budget - system_tokens).mean()
    low, high = budget, max(budget, int((own + system_tokens).sum()))
    while low < high:
        middle = (low + high) // 2
        if requests_held(own + system_tokens, middle).mean() >= target:
            high = middle
        else:
            low = middle + 1
    return low


def sglang_leaves(tree) -> int:
    """Leaves of SGLang's tree: one per request it holds (only the system prompt is shared)."""
    count, stack = 0, list(tree.root_node.children.values())
    while stack:
        node = stack.pop()
        children = node.children.values()
        count += not children
        stack.extend(children)
    return count


def replay_sglang(keys: list[array], budget: int) -> tuple[np.ndarray, np.ndarray, int, float, int, int, float]:
    """Seconds per request in lookup and in evict + insert, tokens matched, tokens evicted a request,
    the tokens the tree holds at the end, and the requests (leaves) it holds at the end and on the mean
    over the requests."""
    import torch

    from kvstate.engines.sglang_loader import load_allocators, load_radix_cache

    rc = load_radix_cache()
    token_allocator, _paged = load_allocators()
    # Room for what the tree may hold and one request's new tokens: no more than the workload's
    # tokens (an unbounded control would otherwise make a slot array as long as its budget).
    size = min(budget, sum(map(len, keys))) + max(map(len, keys))
    allocator = token_allocator(size, torch.float32, "cpu", None, False)
    tree = rc.RadixCache.create_simulated(mock_allocator=allocator, page_size=1)
    match_s, insert_s = np.zeros(len(keys)), np.zeros(len(keys))
    kept = np.zeros(len(keys), np.int64)
    matched_tokens = evicted = 0
    clock = time.perf_counter
    for i, key in enumerate(keys):
        t0 = clock()
        hit = tree.match_prefix(rc.MatchPrefixParams(key=rc.RadixKey(key)))
        tree.inc_lock_ref(hit.last_device_node)
        t1 = clock()
        matched = hit.device_prefix_len
        held = tree.evictable_size() + tree.protected_size()
        new = len(key) - matched
        if held + new > budget:
            evicted += tree.evict(rc.EvictParams(num_tokens=held + new - budget)).num_tokens_evicted
        t2 = clock()
        # Untimed, as kvstate's page allocation (in ``extend``) is: the slots for the new tokens, in
        # the value of the whole key, whose hit part the tree keeps as its own (any ids stand there).
        value = torch.cat([torch.zeros(matched, dtype=torch.int64), allocator.alloc(new)])
        t3 = clock()
        tree.insert(rc.InsertParams(key=rc.RadixKey(key), value=value))
        t4 = clock()
        tree.dec_lock_ref(hit.last_device_node)
        kept[i] = len(tree.evictable_leaves)        # every leaf, none locked now: one a request held
        match_s[i], insert_s[i] = t1 - t0, (t2 - t1) + (t4 - t3)
        matched_tokens += matched
    held = tree.evictable_size() + tree.protected_size()
    # Every slot the allocator handed out is in the tree or was evicted back: the values were right.
    assert allocator.available_size() + held == size, (allocator.available_size(), held, size)
    assert kept[-1] == sglang_leaves(tree)
    return match_s, insert_s, matched_tokens, evicted / len(keys), held, int(kept[-1]), float(kept.mean())


def replay_kvstate(requests: list[np.ndarray], max_pages: int, frees: bool = True
                   ) -> tuple[np.ndarray, np.ndarray, int, float, int | None, int, float]:
    """Seconds per request in ``match`` and ``retain``, tokens matched, pages freed a request, the
    pages live at the end (None where ``frees`` is False: ``skip_frees``), and the entries held at the
    end and on the mean over the requests."""
    from kvstate.impl import Cache

    cache = Cache(TINY, page_tokens=1, match="token", max_pages=max_pages, max_entries=len(requests) + 1)
    skipped = None if frees else skip_frees(cache.pool)
    kept: list[int] = []
    match_s, retain_s, matched = serve_requests(cache, requests, after_retain=lambda: kept.append(len(cache.tree)))
    held = len(cache.pool.live) if skipped is None else None
    return match_s, retain_s, matched, cache.pool.freed / len(requests), held, kept[-1], float(np.mean(kept))


def skip_frees(pool) -> list:
    """``pool``'s frees made to cost nothing, for the floor row: the pages a release lets go of stay as
    they are (memory, slots, the live list), only counted as freed and kept in the list returned, so
    none is even deallocated. The tree, its evictions and every refcount step run as they do; what
    a retain then costs is what it costs before it frees anything, a floor no cheaper free goes under."""
    kept: list = []

    def free(pages, slots, *release) -> None:
        if release:
            pool._commit(*release, None)     # the counts and the holder let go, as a release does
        kept.append(pages)
        pool.freed += len(pages)

    pool._free = free       # the one path every release frees through (impl/pages.py)
    return kept


def run(quick: bool = False, rounds: int | None = None, budget: int | None = None) -> dict:
    size = QUICK if quick else FULL
    rounds = rounds or (1 if quick else 2)
    budget = budget or (QUICK_BUDGET if quick else BUDGET)
    requests = workload("divergent", **size)
    max_pages = kvstate_max_pages(requests, budget, size["system_tokens"])     # as many requests as SGLang's
    keys = [array("q", tokens.tolist()) for tokens in requests]     # SGLang's key type, made untimed
    contenders = ((SGLANG, lambda: replay_sglang(keys, budget)), (KVSTATE, lambda: replay_kvstate(requests, max_pages)),
                  (FLOOR, lambda: replay_kvstate(requests, max_pages, frees=False)))
    best: dict[str, list] = {}
    for _ in range(rounds):
        for name, replay in contenders:
            match_s, insert_s, *counts = replay()
            old = best.get(name)
            if old is not None:
                assert counts == old[2:]      # counts do not depend on the round
                match_s, insert_s = np.minimum(match_s, old[0]), np.minimum(insert_s, old[1])
            best[name] = [match_s, insert_s, *counts]
    peer = best[SGLANG]
    query_tokens = sum(map(len, requests))
    rows = [{"engine": name, "hit_rate": matched / query_tokens, "matched": matched, "held_at_end": held,
             "requests_held_mean": kept_mean, "requests_held_at_end": kept, "freed_per_request": freed,
             "lookup_us": 1e6 * match_s.mean(), "insert_us": 1e6 * insert_s.mean(),
             "insert_us_per_freed": 1e6 * insert_s.mean() / freed if freed else None,
             "lookup_speedup": peer[0].sum() / match_s.sum(), "insert_speedup": peer[1].sum() / insert_s.sum()}
            for name, (match_s, insert_s, matched, freed, held, kept, kept_mean) in best.items()]
    targets = {"hit rate = SGLang's, within 0.01%": abs(best[KVSTATE][2] - peer[2]) <= 1e-4 * query_tokens,
               "evictions on both sides": peer[3] > 0 and best[KVSTATE][3] > 0,
               "the floor evicts as kvstate does": best[FLOOR][2:4] == best[KVSTATE][2:4],
               "requests held, mean over the run: kvstate's within 10% of SGLang's": same_requests_held(
                   best[KVSTATE][6], peer[6])}
    if not quick:       # a smoke run's timings judge nothing
        targets[f"min(lookup, insert speedup) >= {TARGET:g}"] = speed_verdict(*rows)
    command = (COMMAND + " --quick" * quick + (f" --budget {budget}" if budget != (QUICK_BUDGET if quick else BUDGET) else "")
               + rounds_option(rounds, quick))
    return {"name": "bounded_vs_sglang",
            "params": {**size, "workload": "divergent", "page_tokens": 1, "budget_tokens": budget,
                       "kvstate_max_pages": max_pages, "rounds": rounds,
                       "speedup": "kvstate speed / SGLang's = SGLang time / kvstate time, same run"},
            "rows": rows, "targets": targets, "command": command}


def same_requests_held(kvstate: int, sglang: int) -> bool:
    """The two trees held about the same requests (within 10% of SGLang's), the condition the ratios need."""
    return abs(kvstate - sglang) <= 0.1 * sglang


def speed_verdict(peer: dict, mine: dict, floor: dict) -> str:
    """The target's verdict on kvstate's row; a missed insert gets what it pays a page freed, its
    floor (the retain with frees skipped) and the design that would pass."""
    worst = min(mine["lookup_speedup"], mine["insert_speedup"])
    verdict = f"{worst:.2f} {'met' if worst >= TARGET else 'MISSED'}"
    if mine["insert_speedup"] < TARGET and mine["insert_us_per_freed"] and peer["insert_us_per_freed"]:
        verdict += (f": a retain here is mostly its evictions' frees, {mine['insert_us_per_freed']:.2f} µs a page "
                    f"freed against SGLang's {peer['insert_us_per_freed']:.2f} µs a token evicted; with every free "
                    f"skipped ({FLOOR}) inserts run at {floor['insert_speedup']:.2f}x: {SLABS}")
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=positive_int,
                        help=f"tokens SGLang's tree may hold (default {BUDGET:,}); kvstate's max_pages holds as many requests")
    parser.add_argument("--rounds", type=positive_int)
    parser.add_argument("--quick", action="store_true", help="a few small conversations (a smoke run)")
    args = parser.parse_args(argv)
    return print_beside_sglang(lambda: run(args.quick, args.rounds, args.budget))


if __name__ == "__main__":
    raise SystemExit(main())
