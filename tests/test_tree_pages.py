"""The tree's page count is a running count (``RadixTree.weight``): after any sequence of
retains (new keys, replaced keys), evictions by ``max_entries``, by ``max_pages`` and by a
full pool, matches and clears, it equals the sum over the entries recounted from scratch."""

import random

import numpy as np
import pytest

from kvstate.impl import Cache
from kvstate.impl.radix import pack
from kvstate.spec.errors import CapacityError
from kvstate.spec.layout import Layout
from kvstate.spec.semantics import entry_pages

LAYOUT = Layout(1, 1, 2)
CONFIGS = {
    "pages": dict(match="token", max_entries=6, max_pages=9),
    "entries": dict(match="entry", max_entries=3),
    "pool-evict": dict(match="token", max_entries=8, arena_pages=12, on_full="evict"),
    "pool-evict-pages": dict(match="block", block_tokens=2, max_entries=8, max_pages=7, pool_pages=14,
                             on_full="evict-then-refuse"),
}


def _zeros(n: int) -> np.ndarray:
    return np.zeros((n, *LAYOUT.position_shape), np.float32)


def _filled(cache: Cache, tokens: list[int]):
    ctx = cache.allocate()
    try:
        ctx.extend(tokens, _zeros(len(tokens)))
    except CapacityError:
        ctx.close()
        raise
    return ctx


def _observed_pages(cache: Cache) -> int:
    """The page budget count the observation reports, and the same count summed from its entries' lengths."""
    obs = cache.observe()
    summed = sum(entry_pages(obs.lengths[entry.holder], cache.page_tokens) for entry in obs.entries)
    assert obs.counters["tree_pages"] == summed
    return summed


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(3))
def test_running_page_count_equals_the_recount_after_random_operations(name, seed):
    rng = random.Random(seed)
    cache = Cache(LAYOUT, page_tokens=3, **CONFIGS[name])
    keys = [[rng.randrange(4) for _ in range(rng.randrange(1, 12))] for _ in range(10)]   # few tokens: keys share and repeat
    held, budget_evictions = [], 0
    for _ in range(120):
        op = rng.random()
        if op < 0.6:
            tokens = rng.choice(keys)
            ctx, matched = cache.match(tokens)
            try:
                ctx.extend(tokens[matched:], _zeros(len(tokens) - matched))
                before = len(cache.tree) + (cache.tree.longest_key(pack(np.array(tokens)))[1] < len(tokens))
                cache.retain(ctx)
                budget_evictions += len(cache.tree) < min(before, cache.max_entries)
            except CapacityError:      # evict-then-refuse: contexts hold too much; nothing changed
                pass
            ctx.close()
        elif op < 0.75:      # contexts held open take pool pages: a full pool evicts entries
            if held and rng.random() < 0.5:
                held.pop(rng.randrange(len(held))).close()
            else:
                try:
                    held.append(_filled(cache, [9] * rng.randrange(1, 10)))
                except CapacityError:
                    pass
        elif op < 0.97:
            ctx, _ = cache.match(rng.choice(keys))
            ctx.close()
        else:
            cache.clear()
        assert cache.tree.weight == cache.bounds.recount(cache.tree) == _observed_pages(cache)
        if cache.bounds.max_pages and len(cache.tree) > 1:
            assert cache.tree.weight <= cache.bounds.max_pages
    # the run reached what it checks: evictions by the page budget, by a full pool
    assert budget_evictions > 0 or not cache.bounds.max_pages
    assert cache.policy.evictions > 0 or cache.config.on_full == "fallback"
    cache.clear()
    assert cache.tree.weight == 0


def test_retain_under_a_page_budget_never_walks_the_entries(monkeypatch):
    """Each retain's bound check is O(1): no pass over every entry (issue 26, item 3)."""
    from kvstate.impl import radix

    walks = []
    entries = radix.RadixTree.entries
    monkeypatch.setattr(radix.RadixTree, "entries", lambda tree: walks.append(len(tree)) or entries(tree))
    cache = Cache(LAYOUT, page_tokens=3, match="token", max_entries=1000, max_pages=20)
    for i in range(40):
        ctx = _filled(cache, [i, 7, i])
        cache.retain(ctx)
        ctx.close()
    assert len(cache.tree) == 20 and walks == []      # the budget evicted, counting no entries
    cache.stats()
    assert walks == []


def test_an_entry_that_alone_passes_the_page_budget_is_kept_alone():
    """spec/semantics.py: retain never evicts the entry it made, so one larger than ``max_pages``
    stays, as the only entry (an audit read "until both hold" as a bound that always holds)."""
    cache = Cache(LAYOUT, page_tokens=2, max_pages=2)
    for tokens in ([1, 2], [3, 4, 5, 6, 7]):     # one page, then three
        ctx = _filled(cache, tokens)
        cache.retain(ctx)
        ctx.close()
    assert [node.key() for node in cache.tree.entries()] == [(3, 4, 5, 6, 7)]
    assert cache.stats()["tree_pages"] == 3


_TREE_SCALE = """
import json
from kvstate.bench import tree_scale
from kvstate.bench.run import format_result
result = tree_scale.run(quick=True)
print(json.dumps({"result": result, "text": format_result(result)}, default=float))
"""


def test_tree_scale_bench_prints_a_row_per_tree_size_relative_to_the_smallest():
    # In a fresh interpreter, as ``kvstate bench`` runs it: its call counting (sys.setprofile) and
    # timing loops ran for minutes inside a pytest worker that earlier tests had left busy.
    import json
    import subprocess
    import sys

    from kvstate.bench import tree_scale

    done = subprocess.run([sys.executable, "-c", _TREE_SCALE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr      # asserts inside: inserts evict nothing, evict-phase retains one each
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    result, text = printed["result"], printed["text"]
    assert [row["entries"] for row in result["rows"]] == list(tree_scale.QUICK_SIZES)
    small, large = result["rows"]
    for phase in ("lookup", "insert", "evict"):
        assert small[f"{phase}_x_smallest"] == 1
        # counts, not timings: no step of match, retain or eviction walks the tree's entries
        assert small[f"{phase}_calls"] == large[f"{phase}_calls"] > 0
    # the lookup's floor on the same scale: 1 at the smallest tree, a ratio beside every larger one
    assert small["lookup_floor_x_smallest"] == 1 and large["lookup_floor_x_smallest"] > 0
    assert "reproduce: python -m kvstate.bench.tree_scale --quick" in text
