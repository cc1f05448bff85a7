"""README's table of pinned semantics: one source (stateful/directed/semantics.py), every checked
row able to fail, and every freedom it grants granted."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

from kvstate.impl import cache as cache_module
from kvstate.impl.numpy import factory as numpy_factory
from kvstate.stateful.conform import conform, load_factory
from kvstate.stateful.configs import config_named
from kvstate.stateful.directed.semantics import ROWS, pinned_semantics, readme_table

from foreign import dict_pages

ROOT = Path(__file__).resolve().parent.parent
SMALL = settings(max_examples=25, stateful_step_count=15, derandomize=True, deadline=None, database=None)


def test_readme_shows_exactly_the_rows_the_suite_checks():
    assert readme_table() in (ROOT / "README.md").read_text()


def test_every_checked_row_passes_on_our_engine_in_every_semantics():
    from kvstate.stateful.configs import configs_for

    for config in configs_for(numpy_factory):
        pinned_semantics(numpy_factory, config)


def _row(topic):
    return next(row for row in ROWS if row.topic == topic)


def test_a_miss_that_stamps_an_entry_breaks_the_miss_row(monkeypatch):
    original = cache_module.Cache.match

    def stamping_miss(cache, tokens):
        ctx, matched = original(cache, tokens)
        if matched == 0 and len(cache.tree):
            cache.tree.stamp(next(cache.tree.entries()))      # a miss "touches" the oldest entry
        return ctx, matched
    monkeypatch.setattr(cache_module.Cache, "match", stamping_miss)
    row = _row("a miss")
    with pytest.raises(AssertionError, match="stamps no entry"):
        row.check(numpy_factory, config_named("f32-heap"), row.text)


def test_a_retain_that_keeps_the_older_entry_breaks_the_replace_row(monkeypatch):
    from kvstate.impl import radix

    original = radix.RadixTree.insert

    def keep_older(tree, key, value):
        node, depth = tree._descend(key)
        if depth == len(key) and node.value is not None:
            return value                          # "replaced" the newcomer: the old entry stays
        return original(tree, key, value)
    monkeypatch.setattr(radix.RadixTree, "insert", keep_older)
    row = _row("retain again")
    with pytest.raises(AssertionError, match="newer values win"):
        row.check(numpy_factory, config_named("f32-heap"), row.text)


def test_an_error_that_does_not_apply_breaks_the_several_bad_inputs_row(monkeypatch):
    """Any error that applies is right; one that applies to nothing in the call is not: a position
    error for an overwrite whose position is fine (its values are what is wrong)."""
    from kvstate.impl import context as context_module
    from kvstate.spec.errors import PositionError

    original = context_module.Context.overwrite

    def blames_the_position(ctx, start, tokens, kv):
        if isinstance(kv, np.ndarray) and not np.isfinite(kv).all():
            raise PositionError("blamed the position for a NaN")
        return original(ctx, start, tokens, kv)
    monkeypatch.setattr(context_module.Context, "overwrite", blames_the_position)
    row = _row("several bad inputs")
    with pytest.raises(AssertionError, match="any error that truly applies"):
        row.check(numpy_factory, config_named("f32-heap"), row.text)


def test_checking_values_before_positions_is_a_freedom_not_a_bug(monkeypatch):
    """The order in which a backend validates is its own: NonFiniteError before PositionError passes."""
    from kvstate.impl import context as context_module

    original = context_module.Context.overwrite

    def values_first(ctx, start, tokens, kv):
        ctx._cache.store.encode(kv)               # NonFiniteError before the position is looked at
        return original(ctx, start, tokens, kv)
    monkeypatch.setattr(context_module.Context, "overwrite", values_first)
    row = _row("several bad inputs")
    row.check(numpy_factory, config_named("f32-heap"), row.text)


def test_a_clock_of_its_own_is_a_freedom_not_a_bug():
    """The "eviction order" row: a backend whose clock starts at 1000, resets on clear() and
    advances on a miss keeps the reference's order, so nothing may reject it."""
    listcache = load_factory(str(ROOT / "examples" / "listcache.py"))
    module = __import__(listcache.__module__)

    class OwnClock(module.ListCache):
        def __init__(self, config):
            super().__init__(config)
            self.clock = 1000

        def match(self, tokens):
            ctx, matched = super().match(tokens)
            if matched == 0:
                self.clock += 7                   # a miss advances it
            return ctx, matched

        def clear(self):
            super().clear()
            self.clock = 0                        # and clear() resets it

    def factory(config):
        return OwnClock(config)
    factory.configs = listcache.configs[:1]
    results = conform(factory, settings=SMALL, checks=["lockstep", "seeded", "prefix edges", "pinned semantics"])
    assert len(results) == 1 and results[0].passed, results[0].failure
    assert results[0].outcomes["lockstep"].steps > 100


def test_evicting_only_entries_that_free_a_page_alone_breaks_the_row(monkeypatch):
    """A pool that evicts only entries freeing a page by themselves, chosen once, leaves an entry
    whose page another entry kept too: the row's scenario rejects it."""
    from kvstate.impl import pool_policy

    def one_pass(policy, needed):
        if needed <= 0 or policy.fits(needed):
            return
        def frees_alone(entry):
            return any(page.refcount == 1 for page in entry._pages)
        victims = [node.value for node in list(policy.tree.entries()) if frees_alone(node.value)]
        for victim in victims:
            if policy.fits(needed):
                return
            node = next(node for node in policy.tree.entries() if node.value is victim)
            policy.tree.remove(node)
            policy.release_entry(victim)
    monkeypatch.setattr(pool_policy.PoolPolicy, "make_room", one_pass)
    row = _row("eviction for room")
    with pytest.raises(AssertionError, match="frees nothing alone"):
        row.check(numpy_factory, config_named("token-f32-arena6-evict"), row.text)


def test_a_wrong_newest_entry_after_eviction_for_room_breaks_the_row(monkeypatch):
    """An audit's mutant (s73) passed the whole suite: after an eviction for room took the newest
    entry below a node (the older ones held), the node re-elected the oldest as its newest, so a hit
    there came from the oldest entry sharing it. The row's keys that differ only in their last token
    reject it."""
    from kvstate.impl import radix

    def re_elect_the_oldest(tree, node, victim):
        while node is not None and node.newest is victim:
            best = node if node.value is not None else None
            for child in node.children.values():
                if child.newest is not None and (best is None or child.newest.tick < best.tick):
                    best = child.newest
            node.newest = best
            node = node.parent
    monkeypatch.setattr(radix.RadixTree, "_forget_newest", re_elect_the_oldest)
    row = _row("eviction for room")
    with pytest.raises(AssertionError, match="invariant 5"):
        row.check(numpy_factory, config_named("token-f32-arena6-evict"), row.text)


def test_an_overwrite_refused_after_writing_its_first_positions_breaks_the_full_pool_row(monkeypatch):
    """An audit's engine (s73) took its pages one at a time and, refused, rolled back its pages and tokens
    but not the values already written into a page of its own: ``ci`` passed it. Here the engine writes
    an overwrite position by position, so a refusal at the second leaves the first written."""
    from kvstate.impl import context as context_module

    whole = context_module.Context.overwrite

    def position_by_position(ctx, start, tokens, kv):
        tokens, kv = list(tokens), np.asarray(kv)
        for i, token in enumerate(tokens):
            whole(ctx, start + i, [token], kv[i:i + 1])
    monkeypatch.setattr(context_module.Context, "overwrite", position_by_position)
    row = _row("full pool")
    with pytest.raises(AssertionError, match="invariant 4"):
        row.check(numpy_factory, config_named("block4-f32-pool12-refuse"), row.text)


def test_len_of_a_closed_context_is_a_freedom():
    """A backend whose len() of a closed context raises passes the closed-contexts row and lockstep."""
    listcache = load_factory(str(ROOT / "examples" / "listcache.py"))
    module = __import__(listcache.__module__)

    class StrictLen(module.ListContext):
        def __len__(self):
            self._open()
            return self.length

    class Cache(module.ListCache):
        context_class = StrictLen

    def factory(config):
        return Cache(config)
    factory.configs = listcache.configs[:1]
    row = _row("closed contexts")
    row.check(factory, factory.configs[0], row.text)
    results = conform(factory, settings=SMALL, checks=["lockstep", "seeded", "pinned semantics"])
    assert results[0].passed, results[0].failure


def test_keeping_the_older_copy_of_a_prefix_is_granted_only_under_prefix_values(monkeypatch):
    from kvstate.impl import radix

    original = radix.RadixTree.insert

    def keep_older(tree, key, value):
        node, depth = tree._descend(key)
        if depth == len(key) and node.value is not None:
            return value                          # SGLang's insert: the old slots stay, the new are freed
        return original(tree, key, value)
    monkeypatch.setattr(radix.RadixTree, "insert", keep_older)
    row = _row("prefix values")
    row.check(numpy_factory, config_named("f32-heap").with_(values="prefix"), row.text)
    with pytest.raises(AssertionError):
        row.check(numpy_factory, config_named("f32-heap"), row.text)


@pytest.mark.parametrize("max_pages", [0, 6])
def test_the_full_pool_row_catches_a_pool_that_evicts_then_refuses(max_pages):
    """Evicting every entry would free a page, not the two asked for: `evict-then-refuse` refuses
    with the entries still there. A pool that evicted first and then refused passed every check in a
    configuration with a tree bound (an audit's backend); the row's own scenario now shows it."""
    from kvstate.stateful.planted import PLANTED

    config = config_named("block2-f16-pool10-evict-then-refuse").with_(max_pages=max_pages)
    with PLANTED["evicts_before_refusing"]():
        (result,) = conform(numpy_factory, configs=[config], checks=["pinned semantics"])
    assert "was refused (CapacityError) but changed the cache" in result.outcomes["pinned semantics"].detail
    (result,) = conform(numpy_factory, configs=[config], checks=["pinned semantics"])
    assert result.passed, result.failure


@pytest.mark.parametrize("config_name", ["token-f32-arena6-evict", "block2-f16-pool10-evict-then-refuse"])
def test_the_eviction_for_room_row_holds_a_pool_to_the_oldest_entry_that_frees(config_name, monkeypatch):
    """From an audit: the row's scenario evicted every entry, so a pool evicting the newest entry, or one
    whose pages a context holds, passed it. Three entries, the oldest held by a context, and a need of one
    entry's pages now tell them apart; our engine passes."""
    from kvstate.impl import pool_policy
    from kvstate.stateful.planted import PLANTED

    config = config_named(config_name)
    (result,) = conform(numpy_factory, configs=[config], checks=["pinned semantics"])
    assert result.passed, result.failure
    with PLANTED["pool_evicts_newest"]():
        (result,) = conform(numpy_factory, configs=[config], checks=["pinned semantics"])
    detail = result.outcomes["pinned semantics"].detail
    assert "eviction order" in detail and "A pool short of pages evicts least recently used" in detail, detail
    monkeypatch.setattr(pool_policy, "_keeps_a_page", lambda entry, held: True)     # any entry, held or not
    (result,) = conform(numpy_factory, configs=[config], checks=["pinned semantics"])
    detail = result.outcomes["pinned semantics"].detail
    assert "eviction order" in detail and "or its pool evicted for room" in detail, detail


def test_the_prefix_values_row_catches_a_retain_that_frees_the_pages_a_hit_reads(monkeypatch):
    """From an audit: an SGLang-like engine that, retaining a key it held, freed the slots it kept (not the
    new copy's) passed every directed check: the row's scenario held no hit of the first entry, so the
    freed pages had no reader. It now holds one across the second retain and a new context's pages."""
    from kvstate.impl.holding import RELEASED

    def frees_the_replaced_outright(cache, ctx, key):
        entry = cache._fork(ctx, register=False)
        replaced = cache.tree.insert(key, entry)
        if replaced is not None:        # its pages freed whoever else holds them (a hit of it, here)
            held = replaced._holding
            cache.pool.books.flush()
            cache.pool._free(list(held.pages), held.slots)
            replaced._holding = RELEASED
        while cache.bounds.exceeded(cache.tree):
            victim = cache.tree.pop_oldest(spare=entry)
            if victim is None:
                break
            cache._release(victim)
    row = _row("prefix values")
    row.check(numpy_factory, config_named("f32-heap"), row.text)
    monkeypatch.setattr(cache_module.Cache, "_keep", frees_the_replaced_outright)
    with pytest.raises(AssertionError, match="prefix"):
        row.check(numpy_factory, config_named("f32-heap"), row.text)


# -- from an audit (tests/foreign/audit_repro/FINDINGS.md, B2 and B3) --------------------------------

def _audit_config(name):
    from foreign import audit_minimal

    return next(config for config in audit_minimal.factory.configs if config.name == name)


@pytest.mark.parametrize("name", ["block4-f32-pool10-evict", "block3-f16-pool8-evict-pages5"])
def test_the_eviction_for_room_row_counts_the_copy_of_a_shared_partly_filled_page(name):
    """B2: an extend whose need leaves out the copy of its shared, partly filled last page evicts one entry
    too few at the pool's edge; ci passed it in both evicting configurations. The row now builds that edge."""
    from foreign import audit_bugs, audit_minimal

    config, row = _audit_config(name), _row("eviction for room")
    row.check(audit_minimal.factory, config, row.text)
    with pytest.raises(AssertionError, match="the copy of a partly filled page an entry shares"):
        row.check(audit_bugs.need_omits_tail_copy, config, row.text)


def test_the_copy_scenario_evicts_for_the_copy_in_every_evicting_configuration_we_have(monkeypatch):
    """Not vacuous: in each evicting configuration of our engine, block_pool's and the audit's, the reference
    evicts the oldest entry for the copy (the tied holder of the copied page stays), and the engine agrees."""
    from foreign import audit_minimal, block_pool
    from kvstate.spec.semantics import evicts_for_room
    from kvstate.stateful.configs import configs_for
    from kvstate.stateful.directed.semantics import _evicts_for_the_copy_of_a_shared_page
    from kvstate.stateful.lockstep import Lockstep

    kept_at_the_end = []
    original = Lockstep.finish

    def noting(run):
        kept_at_the_end.append([key for key, _ in run.reference.eviction_order()])
        return original(run)
    monkeypatch.setattr(Lockstep, "finish", noting)
    seen = []
    for factory in (numpy_factory, block_pool.factory, audit_minimal.factory):
        for config in configs_for(factory):
            if evicts_for_room(config.on_full):
                kept_at_the_end.clear()
                _evicts_for_the_copy_of_a_shared_page(factory, config, "the row")
                (kept,) = kept_at_the_end
                page = config.page_tokens
                assert kept == [tuple(70 + i % 3 for i in range(page - 1))], (config.name, kept)    # F only
                seen.append(config.name)
    assert {"token-f32-arena6-evict", "block2-f16-pool10-evict-then-refuse", "block4-f32-pool10-evict",
            "block3-f16-pool8-evict-pages5"} <= set(seen), seen


@pytest.mark.parametrize("name", ["block4-q8-pool12-refuse-pages6", "block3-f16-pool8-evict-pages5"])
def test_the_ties_scenarios_build_a_tie_under_a_tight_max_pages(name):
    """B3: two keys of the shared prefix and a block more do not fit max_pages 6 at page 2 (5 at page 3): the
    second retain evicted the first and no tie was tested, so ties resolved to the first entry cached passed
    both checks. The keys now end inside a block (and the prefix is one block where needed)."""
    from foreign import audit_bugs, audit_minimal
    from kvstate.stateful.directed.prefix import TIES, prefix_edges

    config, row = _audit_config(name), _row("block ties")
    prefix_edges(audit_minimal.factory, config)
    row.check(audit_minimal.factory, config, row.text)
    with pytest.raises(AssertionError, match=TIES.split(",")[0]):
        prefix_edges(audit_bugs.tie_first_retained, config)
    with pytest.raises(AssertionError, match="the most recently used gives the hit"):
        row.check(audit_bugs.tie_first_retained, config, row.text)


def test_where_no_tie_fits_the_ties_scenarios_say_not_applicable():
    """A budget that cannot hold two entries of a block and a token: n/a, not a vacuous pass; prefix edges runs
    its other scenarios first."""
    from kvstate.stateful.directed.common import NotApplicable
    from kvstate.stateful.directed.prefix import prefix_edges

    config, row = config_named("f32-heap").with_(max_pages=1), _row("block ties")
    with pytest.raises(NotApplicable, match="max_pages 1 cannot hold two entries.*every other scenario passed"):
        prefix_edges(numpy_factory, config)
    with pytest.raises(NotApplicable, match="block ties.*no tie can be built"):
        row.check(numpy_factory, config, row.text)


@pytest.mark.parametrize("bug, config_name", [("stamp_all_candidates", "block4-f32-pool10-evict"),
                                               ("partial_hit_no_stamp", "block4-f32-pool10-evict"),
                                               ("partial_hit_no_stamp", "block4-q8-pool12-refuse-pages6")])
def test_a_wrong_stamp_of_a_black_box_engine_breaks_the_hits_stamp_their_entry_row(bug, config_name):
    """From the audit: both planted bugs passed every per-step check, since each probe of a black-box
    engine's entries stamps them all back into the reference's order; the row evicts with no probe
    between the hit and the eviction. Where the page budget holds fewer entries than ``max_entries``
    (6 pages: two of the row's keys, not four), the row fills the tree to the budget: it was skipped."""
    from foreign import audit_bugs, audit_minimal

    row = next(row for row in ROWS if row.topic == "hits stamp their entry")
    config = next(c for c in audit_minimal.factory.configs if c.name == config_name)
    row.check(audit_minimal.factory, config, row.text)
    with pytest.raises(AssertionError, match="hits stamp their entry|A hit stamps the entry"):
        row.check(getattr(audit_bugs, bug), config, row.text)


@pytest.mark.parametrize("name", ["block4-q8-pool12-refuse-pages6", "block3-f16-pool8-evict-pages5",
                                  "block2-f32-pool9-refuse"])
def test_prefix_edges_splices_two_keys_blocks(name):
    """An audit (s66): a block hashed with its index but not its parent passed every check at block size 16
    and most at 4. A key of two blocks, one of another block, then a query splicing them: one block."""
    from foreign import audit_bugs, audit_minimal
    from kvstate.stateful.directed.prefix import ELSEWHERE, prefix_edges

    config = _audit_config(name)
    prefix_edges(audit_minimal.factory, config)
    with pytest.raises(AssertionError, match=ELSEWHERE.split(":")[0]):
        prefix_edges(audit_bugs.unchained_hash, config)


@pytest.mark.parametrize("first_stamp", [1, 0])
@pytest.mark.parametrize("wrap", [2**8, 2**16])
def test_a_clock_that_wraps_breaks_the_long_histories_row(wrap, first_stamp):
    """An outside audit (s70): ticks kept modulo 256 passed every check, no run making 256 stamps; past the
    wrap the newest entry looked oldest and a retain evicted it. A 16-bit clock, too, and (the review of s70)
    one whose first stamp is 0, as a clock stamping before it counts gives: its oldest entry at tick 0 was
    below every wrapped tick. The true one passes."""
    listcache = load_factory(str(ROOT / "examples" / "listcache.py"))
    module = __import__(listcache.__module__)

    class Wrapping(module.ListCache):
        def __init__(self, config):
            super().__init__(config)
            self.clock = first_stamp - 1        # listcache counts, then stamps

        def __setattr__(self, name, value):     # the clock kept in ``wrap`` values, as a narrow field keeps it
            super().__setattr__(name, value % wrap if name == "clock" else value)

    from kvstate.stateful.configs import PROFILES
    from kvstate.stateful.directed import common

    row = next(row for row in ROWS if row.topic == "long histories")
    config = listcache.configs[0]
    common.current.settings = PROFILES["ci"] if wrap < 2**12 else None     # ci's 4,096 stamps where they reach
    try:
        row.check(listcache, config, row.text)
        with pytest.raises(AssertionError, match="however long the history"):
            row.check(Wrapping, config, row.text)
    finally:
        common.current.settings = None


def test_the_long_histories_row_is_sized_by_the_profile_conform_runs():
    """Under ci and hunt the row stamps 4,096 times (the full 65,536 cost 26 s of CPU across the default tests),
    under nightly and outside conform 65,536; conform's ci run of it fails a 12-bit clock."""
    from kvstate.stateful.configs import PROFILES
    from kvstate.stateful.directed import common, semantics

    for profile, stamps in (("ci", semantics.SHORT_HISTORY), ("hunt", semantics.SHORT_HISTORY),
                            ("nightly", semantics.LONG_HISTORY)):
        common.current.settings = PROFILES[profile]
        try:
            assert semantics._history_length() == stamps
        finally:
            common.current.settings = None
    assert semantics._history_length() == semantics.LONG_HISTORY
    listcache = load_factory(str(ROOT / "examples" / "listcache.py"))
    module = __import__(listcache.__module__)

    class TwelveBits(module.ListCache):
        def __setattr__(self, name, value):
            super().__setattr__(name, value % 2**12 if name == "clock" else value)

    def factory(config):
        return TwelveBits(config)
    factory.configs = listcache.configs[:1]
    (result,) = conform(factory, checks=["pinned semantics"])
    assert getattr(common.current, "settings", None) is None       # set for the check, then let go
    assert not result.passed and "4094 x (match(tokens=" in str(result.outcomes["pinned semantics"].detail)


def test_an_overwrite_need_leaving_out_the_shared_page_it_ends_inside_breaks_the_full_pool_row():
    """An outside audit (s70): a pool counting the pages an overwrite touches with an exclusive end left out the
    copy of a shared page the write ends inside, so a full ``refuse`` pool accepted it; only ``seeded`` caught it.
    The full pool row now overwrites a fork in a full pool, ending inside a shared page."""
    token_pool = load_factory(str(ROOT / "examples" / "token_pool_backend.py"))
    module = __import__(token_pool.__module__)

    class ShortNeed(module.PoolContext):
        def overwrite(self, start, tokens, kv):
            tokens, values = self._encode(tokens, kv, start)
            if len(tokens):
                size = self.cache.page_tokens
                touched = self.pages[start // size:(start + len(tokens)) // size]      # the end left out
                self.cache.make_room(sum(page.refcount > 1 for page in touched))
            self._store(start, tokens, values)

    class ShortNeedCache(module.TokenPoolCache):
        context_class = ShortNeed

    row = next(row for row in ROWS if row.topic == "full pool")
    config = next(config for config in token_pool.configs if config.on_full == "refuse")
    row.check(token_pool, config, row.text)
    with pytest.raises(AssertionError, match="engine accepted, reference CapacityError"):
        row.check(ShortNeedCache, config, row.text)


class _StampsTheNodeAbove(dict_pages.DictCache):
    """A hit's stamp goes to the node above its entry: lost where that is a split node holding no entry."""

    def match(self, tokens):
        entry = self.tree.longest(tuple(int(t) for t in tokens))
        if entry is None:
            return self.allocate(), 0
        above = entry.node.parent
        stamped = above.entry if above is not None and above is not self.tree.root else entry
        tick = self._tick()
        if stamped is not None:
            stamped.tick = tick
        return self.adopt(list(entry.pages), len(entry.key)), len(entry.key)


class _StampsAChild(dict_pages.DictCache):
    """A hit of an entry whose node has children stamps the first child's entry instead."""

    def match(self, tokens):
        entry = self.tree.longest(tuple(int(t) for t in tokens))
        if entry is None:
            return self.allocate(), 0
        children = [entry.node.children[k] for k in sorted(entry.node.children)]
        (children[0].entry if children and children[0].entry is not None else entry).tick = self._tick()
        return self.adopt(list(entry.pages), len(entry.key)), len(entry.key)


@pytest.mark.parametrize("plant", [_StampsTheNodeAbove, _StampsAChild])
def test_hits_stamp_their_entry_under_a_split_node_and_above_a_child(plant):
    """From an audit of the tree's eviction (s72): both trees passed the row, which had no two keys sharing a
    block but its tie's (README: the row "catches such a step"); the correct tree passes the new cases."""
    row = _row("hits stamp their entry")
    row.check(dict_pages.factory, config_named("f32-heap"), row.text)
    with pytest.raises(AssertionError, match="A hit stamps the entry it is taken from"):
        row.check(plant, config_named("f32-heap"), row.text)
