"""Directed tests: the edges random runs reach only by luck, and the design document's bugs."""

import numpy as np
import pytest

from kvstate.spec import invariants
from helpers import assert_empty_after_closing, filled, kv, make_cache, make_reference

PAGE = 4


def read_values(ctx):
    return ctx.read()[0]


@pytest.mark.parametrize("precision", ["f32", "f16", "q8"])
@pytest.mark.parametrize("length", [PAGE * 3 - 1, PAGE * 3, PAGE * 3 + 1])
def test_fork_at_page_boundary_is_isolated(length, precision):
    """Fork at a page boundary and one position either side; each side writes; neither sees the other."""
    cache, ref = make_cache(PAGE, precision), make_reference(PAGE, precision)
    parent, ref_parent = filled(cache, length, seed=1), ref.allocate()
    ref_parent.extend(list(range(length)), kv(length, 1))
    child, ref_child = parent.fork(), ref_parent.fork()
    for ctx, twin in ((child, ref_child), (parent, ref_parent)):
        seed = 7 if ctx is child else 8
        ctx.extend([5, 6], kv(2, seed))
        twin.extend([5, 6], kv(2, seed))
        ctx.overwrite(length - 1, [9], kv(1, seed + 10))
        twin.overwrite(length - 1, [9], kv(1, seed + 10))
    for ctx, twin in ((parent, ref_parent), (child, ref_child)):
        values, tokens = ctx.read()
        want_values, want_tokens = twin.read()
        assert np.array_equal(tokens, want_tokens)
        assert np.array_equal(values.view(np.uint32), want_values.view(np.uint32))
    invariants.check_structure(cache.observe())
    assert_empty_after_closing(cache, [parent, child])


def test_twelve_deep_fork_chain_of_written_branches():
    """Each level forks the previous branch, writes into it, and forks a sibling that writes too."""
    cache, ref = make_cache(PAGE), make_reference(PAGE)
    ctx, twin = filled(cache, 10, seed=2), ref.allocate()
    twin.extend(list(range(10)), kv(10, 2))
    pairs = [(ctx, twin)]
    for depth in range(12):
        base, base_twin = pairs[-1]
        branch, branch_twin = base.fork(), base_twin.fork()
        sibling, sibling_twin = branch.fork(), branch_twin.fork()
        for c, t, seed in ((branch, branch_twin, 100 + depth), (sibling, sibling_twin, 200 + depth)):
            position = (depth * 3) % len(c)
            c.overwrite(position, [depth], kv(1, seed))
            t.overwrite(position, [depth], kv(1, seed))
            c.extend([depth, depth + 1], kv(2, seed + 1))
            t.extend([depth, depth + 1], kv(2, seed + 1))
        pairs += [(sibling, sibling_twin), (branch, branch_twin)]
    for c, t in pairs:
        assert np.array_equal(c.read()[1], t.read()[1])
        assert np.array_equal(c.read()[0], t.read()[0])
    invariants.check_structure(cache.observe())
    assert_empty_after_closing(cache, [c for c, _ in pairs])


def test_every_truncation_point_of_a_shared_context():
    length = PAGE * 3 + 2
    for n in range(length + 1):
        cache = make_cache(PAGE)
        parent = filled(cache, length, seed=3)
        before = parent.read()
        child = parent.fork()
        child.truncate(n)
        assert len(child) == n
        assert np.array_equal(child.read()[0], before[0][:n])
        child.extend([7] * 3, kv(3, 30 + n))          # the regrown tail must not reach the parent
        after = parent.read()
        assert np.array_equal(after[0], before[0]) and np.array_equal(after[1], before[1])
        invariants.check_structure(cache.observe())
        assert_empty_after_closing(cache, [parent, child])


@pytest.mark.parametrize("arena_pages", [0, 5])
def test_closing_everything_and_clearing_returns_to_empty(arena_pages):
    cache = make_cache(PAGE, arena_pages=arena_pages, max_entries=3)
    contexts = [filled(cache, 9, seed=s, first_token=s) for s in range(4)]
    contexts += [c.fork() for c in contexts]
    for c in contexts[:5]:
        cache.retain(c)
    contexts.append(cache.match(contexts[4].tokens + [1, 2])[0])
    assert cache.observe().pages
    assert_empty_after_closing(cache, contexts)


# -- the design document's four bugs, as regressions -----------------------------------

def test_forty_retains_against_four_entries_leave_arena_slots_equal_to_live_pages():
    """The tree leaked arena slots: 40 retains against a 4-entry bound left 80 slots out for 8 live pages."""
    cache = make_cache(PAGE, arena_pages=200, max_entries=4)
    for i in range(40):
        with filled(cache, PAGE * 2, seed=i, first_token=i * 10) as ctx:
            cache.retain(ctx)
    obs = cache.observe()
    assert len(obs.entries) == 4
    assert len(obs.arena_out) == len(obs.pages) == 8
    invariants.check_arena(obs)


def test_recycled_arena_slot_reads_as_zeros_and_arena_matches_heap_bytes():
    """Recycled slots were handed out dirty; an arena run must produce the heap run's bytes."""
    def run(arena_pages):
        cache = make_cache(PAGE, arena_pages=arena_pages)
        with filled(cache, PAGE * 2, seed=5):
            pass                                     # fill two slots, then free them
        ctx = filled(cache, 1, seed=6)               # reuses a freed slot, one position written
        page = ctx._pages[0]
        raw = tuple(np.array(a) for a in page.buffer.arrays)
        assert cache.store.is_zero_from(page.buffer, 1), "unwritten positions of a recycled slot are not zero"
        ctx.close()
        return raw, cache.stats()
    arena_bytes, arena_stats = run(arena_pages=2)
    heap_bytes, heap_stats = run(arena_pages=0)
    assert arena_stats["arena_issued"] == 3 and heap_stats["arena_issued"] == 0
    for a, h in zip(arena_bytes, heap_bytes):
        assert a.tobytes() == h.tobytes()


def test_five_hundred_distinct_retains_leave_no_more_nodes_than_the_bound_allows():
    """Eviction left the node standing: 500 twelve-token inserts against 4 entries left 501 nodes."""
    cache = make_cache(PAGE, max_entries=4)
    rng = np.random.default_rng(0)
    for i in range(500):
        tokens = [int(t) for t in rng.integers(0, 50, 12)]
        ctx = cache.allocate()
        ctx.extend(tokens, kv(12, i))
        cache.retain(ctx)
        ctx.close()
    tree = cache.observe().tree

    def count(node):
        return 1 + sum(count(child) for child in node.children)
    # 4 entries: at most 4 leaves and 3 split nodes below the root, plus the root.
    assert count(tree) - 1 <= 2 * 4 - 1
    invariants.check_tree(cache.observe(), [(e.key, e.tick) for e in cache.observe().entries])


def test_match_returns_longest_retained_prefix_and_marks_it_used():
    cache = make_cache(PAGE, max_entries=2)
    a = filled(cache, 6, seed=1)                 # tokens 0..5
    b = a.fork()
    b.truncate(3)                                # tokens 0..2
    cache.retain(a)
    cache.retain(b)
    hit, matched = cache.match([0, 1, 2, 3, 4, 5, 99])
    assert matched == 6 and hit.tokens == [0, 1, 2, 3, 4, 5]
    c = filled(cache, 2, first_token=500)
    cache.retain(c)                              # evicts the least recently used: b, not the matched a
    assert [e.key for e in cache.observe().entries] == [tuple(range(6)), (500, 501)]
    miss, matched = cache.match([7, 7])
    assert matched == 0 and len(miss) == 0
    assert_empty_after_closing(cache, [a, b, c, hit, miss])
