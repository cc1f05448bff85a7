"""``versus_sglang`` against the tree SGLang's scheduler builds by default: ``UnifiedRadixCache`` over
its compiled Rust TreeCore.

    python -m kvstate.bench.versus_sglang_default [--workload shared|divergent] [--page 1|16|64] [--rounds N] [--quick]

``versus_sglang`` times SGLang 0.5.23's ``radix_cache.RadixCache``, the pure-Python tree issue 26
named. That release's scheduler no longer builds it: ``mem_cache/registry.py`` builds
``UnifiedRadixCache`` for a model with full attention, and its TreeCore is the Rust extension bundled
in the wheel unless the platform or torch rules it out (``kvstate.engines.sglang_default_loader``
says where that is decided). This benchmark makes that tree the peer every kvstate row is judged
against, with the same requests, inputs, floors, rows and targets as ``versus_sglang`` (whose
docstring says what each is), and keeps the legacy ``RadixCache`` beside it for reference.

What is timed of the default tree, the calls its scheduler makes for a request's lookup and insert:
*lookup* = ``match_prefix`` and ``lock`` of the node it ends on (``inc_lock_ref`` and its receipt);
*insert* = ``insert`` of the whole key with one slot id a token and ``prev_prefix_len`` the hit's
length (the scheduler's ``cache_protected_len``: the part the request already holds from the tree,
whose duplicate slots the tree would otherwise free). Untimed, for both SGLang trees as for kvstate's
``close``: ``unlock``, and what the scheduler does after an insert (reading the path's slots back,
moving the request's lock to the new node). Unlike the legacy tree, this one frees the slots of
what it already held inside ``insert``, into SGLang's own allocator (here ``TokenToKVPoolAllocator``
at page 1, ``PagedTokenToKVPoolAllocator`` past it); with ``prev_prefix_len`` so set it frees none on
these workloads, which each replay checks (a free would mean it no longer replays what the scheduler does).

Loading it imports SGLang the ordinary way, so it needs SGLang's own dependencies beside the release
(``kvstate.engines.sglang_default_loader.INSTALL``); where they are missing the command says which and
exits 1. Importing SGLang patches transformers in the process: this benchmark runs in its own.
"""

from __future__ import annotations

import time
from array import array

import numpy as np

from .traffic_workload import FULL, PAGE_SIZES, QUICK, WORKLOADS, workload
from . import versus_sglang
from .versus_sglang import SGLANG, measure, replay_sglang, run_matrix, sglang_missing, verdict

SGLANG_DEFAULT = "SGLang default tree (Rust)"
COMMAND = "python -m kvstate.bench.versus_sglang_default"


def default_missing() -> str | None:
    """Why SGLang's default tree cannot be loaded here, or None."""
    from kvstate.engines.sglang_default_loader import load_default_tree

    return sglang_missing(load_default_tree)


def replay_default(keys: list, page: int, lookup_key=None) -> tuple[np.ndarray, np.ndarray, int]:
    """``replay_sglang`` on SGLang's default tree: seconds per request in lookup (``match_prefix`` +
    ``lock``) and ``insert`` (``prev_prefix_len`` = the hit), and the tokens matched. ``keys`` as
    ``array('q')`` or as Python lists (converted inside the lookup's timing, as ``replay_sglang`` does);
    ``lookup_key(i)``, where given, makes request ``i``'s key inside the lookup's timing instead."""
    import torch

    from kvstate.engines.sglang_default_loader import build_default_tree, load_default_tree

    sg = load_default_tree()
    total = sum(map(len, keys))
    allocator = (sg.TokenToKVPoolAllocator(total, torch.float32, "cpu", None, False) if page == 1 else
                 sg.PagedTokenToKVPoolAllocator(total + page, page, torch.float32, "cpu", None, False))
    tree = build_default_tree(sg, page, allocator)
    available = allocator.available_size()
    slots = torch.arange(total, dtype=torch.int64)
    match_s, insert_s = np.zeros(len(keys)), np.zeros(len(keys))
    matched_tokens = next_slot = 0
    clock = time.perf_counter
    match_params, insert_params, radix_key = sg.MatchPrefixParams, sg.InsertParams, sg.RadixKey
    for i, key in enumerate(keys):
        t0 = clock()
        if lookup_key is not None:
            key = lookup_key(i)
        elif type(key) is list:
            key = array("q", key)
        hit = tree.match_prefix(match_params(key=radix_key(key)))
        lock = tree.lock(hit.last_device_node)
        t1 = clock()
        matched = hit.device_prefix_len
        value = slots[next_slot:next_slot + len(key)]      # fresh ids: the tree keeps its own where it held the key
        next_slot += len(key)
        t2 = clock()
        tree.insert(insert_params(key=radix_key(key), value=value, prev_prefix_len=matched))
        t3 = clock()
        tree.unlock(lock)
        match_s[i], insert_s[i] = t1 - t0, t3 - t2
        matched_tokens += matched
    freed = allocator.available_size() - available
    if freed:
        raise RuntimeError(f"SGLang's default tree freed {freed} slots in these inserts: the replay no longer "
                           f"does what its scheduler does (prev_prefix_len = the hit frees none here)")
    return match_s, insert_s, matched_tokens


TREES = ((SGLANG_DEFAULT, replay_default), (SGLANG, replay_sglang))     # the peer first
# A lookup missing above its floor against a compiled tree: ``versus_sglang``'s designs were read off
# the legacy tree's runs, so here they are named with what is known and what is not.
_COMPILED = ("none built or measured against a compiled tree: at 1.5x its time, the Python past this floor "
             "(walk, stamp, fork) gets two thirds of the tree's lookup less the floor; versus_sglang's remaining "
             "designs (pages as slabs, one call a lookup) are what would cut kvstate's; whether they cut enough "
             "is unmeasured")
DESIGN = {**versus_sglang.DESIGN, **{("lookup", given, False): _COMPILED
                                     for given in (versus_sglang.ARRAY, versus_sglang.LIST, versus_sglang.TOKEN_IDS)}}


def run(quick: bool = False, rounds: int | None = None, workloads=WORKLOADS, pages=PAGE_SIZES) -> dict:
    size = QUICK if quick else FULL
    rounds = rounds or (1 if quick else 2)
    rows = []
    for kind in workloads:
        rows += measure(kind, workload(kind, **size), pages, rounds, quick, size["system_tokens"], TREES, COMMAND)
    from kvstate.engines._loading import STAND_IN_USES
    from kvstate.engines.sglang_loader import SUPPORTED_VERSION

    if STAND_IN_USES:       # SGLang ran into a stand-in (and maybe swallowed its error): not its released code alone
        raise RuntimeError(f"SGLang used kvstate's stand-ins during the run: {sorted(set(STAND_IN_USES))}")

    return {
        "name": "versus_sglang_default",
        "params": {**size, "requests": size["conversations"] * size["turns"], "rounds": rounds,
                   "peer": f"SGLang {SUPPORTED_VERSION} UnifiedRadixCache over its Rust TreeCore (its scheduler's "
                           f"default), its released code; its legacy RadixCache beside it",
                   "speedup": "kvstate speed / the default tree's = its time / kvstate time, same run"},
        "rows": rows,
        "targets": verdict(rows, timed=not quick, peer_engine=SGLANG_DEFAULT, design=DESIGN),
        "command": COMMAND + " --quick" * quick,
    }


def main(argv: list[str] | None = None) -> int:
    return run_matrix(argv, COMMAND, __doc__, run, default_missing, "SGLang's default tree")


if __name__ == "__main__":
    raise SystemExit(main())
