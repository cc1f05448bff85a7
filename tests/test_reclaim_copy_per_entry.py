"""``on_full="reclaim"`` with an engine keeping one copy of the pages per entry and reclaiming the longest
entry first (``tests/foreign/copy_per_entry.py``, an audit's engine written from README alone): two
ways it differs from the reference that README allows, each a false rejection before its fix.

- Having reclaimed an entry, it holds fewer entries and so evicts fewer for ``max_entries``: an entry the
  reference evicted for the bound may still give a hit (``RefCache.bounded_out``).
- A hit as long as the reference's may come from another entry (the reference's was reclaimed), whose
  pages other contexts may share or not: refusals allow either count (``RefCache.hit_may_come_from_another``).
"""

from __future__ import annotations

from kvstate.spec import InvariantViolation
from kvstate.stateful import ops as O
from kvstate.stateful.lockstep import Lockstep

from foreign import copy_per_entry as engine


def run(config, ops) -> Lockstep:
    lockstep = Lockstep(engine.factory, config)
    lockstep.run(ops)
    lockstep.finish()
    return lockstep


def kept(key, handle, close=True):
    ops = [O.Allocate(), O.Extend(handle, key, seed=0), O.Retain(handle)]
    return ops + [O.Close(handle)] if close else ops


def test_an_entry_the_reference_evicted_for_the_bound_may_still_hit():
    # four entries (max_entries 4); c5's 4 pages press the pool of 8, the engine reclaims the longest
    # entry, so retaining c5 evicts nothing there, where the reference evicts (210,) for the bound
    ops = kept((210,), "c1", close=False) + kept((0,), "c2", close=False) + kept((230, 231, 232, 230), "c3")
    ops += kept((240,), "c4", close=False) + kept((0,) * 10, "c5", close=False) + [O.Match((210,))]
    lockstep = run(engine.F16_PAGE3, ops)
    assert lockstep.reference.pressed and "refused" not in " ".join(lockstep.history)


def test_an_equal_hit_from_another_entry_may_share_a_context_page():
    # A (7 positions) and B = (1,) cached; the hit of (1,) comes from A (most recently used); c5's write
    # presses the pool and the engine reclaims A; the next hit of (1,) comes from B, whose page c3 holds,
    # so the engine's contexts hold 3 pages where the reference's hit of A's page counts 4
    ops = [O.Allocate(), O.Extend("c1", (1, 0, 0, 0, 2, 2, 1), seed=0), O.Fork("c1"), O.Allocate(), O.Close("c1"),
           O.Retain("c2"), O.Extend("c3", (1,), seed=0), O.Allocate(), O.Close("c2"), O.Retain("c3"),
           O.Match((1,)), O.Extend("c5", (0, 0), seed=0), O.Match((1,)), O.Extend("c4", (0,) * 5, seed=0)]
    lockstep = run(engine.Q8_PAGE2, ops)
    assert "refused" not in lockstep.history[len(ops) - 1]


def test_an_equal_hit_from_another_entry_may_hold_a_page_of_its_own():
    # the other way round (a sweep's seed, shrunk): the reference's hit of (1, 1) takes the page c4 holds
    # (its entry's, retained before c4 was cut), the engine's, that entry reclaimed, the page of
    # (1, 2, 0)'s entry, which no context holds: the engine's contexts hold 5 pages, and it may refuse
    # c7's 2 in a pool of 6
    ops = [O.Allocate(), O.Fork("c1"), O.Extend("c2", (0,), seed=0), O.Allocate(), O.Fork("c3"), O.Fork("c2"),
           O.Close("c2"), O.Retain("c5"), O.Close("c5"), O.Extend("c4", (1, 1, 0, 1, 1), seed=0), O.Allocate(),
           O.Extend("c6", (1, 2, 0), seed=0), O.Retain("c4"), O.Retain("c6"), O.Truncate("c4", 3),
           O.Overwrite("c6", 0, (0,), seed=0), O.Match((1, 1)), O.Extend("c7", (0, 0), seed=0)]
    lockstep = run(engine.Q8_PAGE2, ops)
    assert "refused" in lockstep.history[len(ops) - 1]


def test_a_free_queue_declared_reclaim_is_caught_though_the_probe_would_refresh_its_entries():
    # pinned semantics' full-pool row, with no check between the operations: the per-step probe (match and
    # close every entry) sends the entry's pages to the back of the free queue and hid this (0 of 600 runs)
    from kvstate.stateful.conform import conform
    from foreign import free_queue

    wrong = conform(free_queue.factory, configs=[free_queue.CONFIG.with_(on_full="reclaim")],
                    checks=["pinned semantics"])[0]
    assert not wrong.passed and "forgot an entry's pages without pressure" in str(wrong.failure)
    right = conform(free_queue.factory, configs=[free_queue.CONFIG], checks=["pinned semantics"])[0]
    assert right.passed, right.failure


def test_an_entry_retained_since_pressure_may_go_for_the_bounds_where_the_engines_recency_differs():
    # no check between the operations (a tree-tier backend is not probed): the engine reclaimed Z (the
    # longest) and kept X, which the reference evicted for max_entries (bounded_out); the match of X
    # refreshes X in the engine, so G's retain evicts F there (its least recently used) and Z here. F was
    # retained since the pool was last short, yet is gone for the bound: a miss is right, not a floor of 3
    X, Z, F, G = (1,) * 3, (2,) * 6, (4,) * 3, (5,) * 3

    def cached(key, handle, seed):
        return [O.Allocate(), O.Extend(handle, key, seed=seed), O.Retain(handle), O.Close(handle)]

    ops = cached(X, "c1", 1) + cached(Z, "c2", 2) + [O.Allocate(), O.Extend("c3", (3,) * 18, seed=3), O.Close("c3")]
    ops += cached(F, "c4", 4) + [O.Match(X), O.Close("c5")] + cached(G, "c6", 5) + [O.Match(F)]
    lockstep = Lockstep(engine.factory, engine.F16_PAGE3.with_(max_entries=2))
    lockstep.run(ops, check_every_step=False)
    assert lockstep.reference.pressed and lockstep.live["c7"][0].__len__() == 0
    lockstep.finish()


class ForgetsTheBoundOnceReclaimed(engine.PoolCache):
    """Planted: once it has reclaimed for room, retain no longer evicts for max_entries."""

    reclaimed = False

    def make_room(self, need, writer=None):
        if need and len(self.live) + need > self.pool and self.context_pages() + need <= self.pool and self.entries:
            self.reclaimed = True
        super().make_room(need, writer)

    def retain(self, ctx):
        bound = self.max_entries
        if self.reclaimed:
            self.max_entries = 1 << 30
        try:
            super().retain(ctx)
        finally:
            self.max_entries = bound


def test_an_engine_that_stops_evicting_for_the_bound_once_it_reclaimed_is_caught():
    # an entry evicted for max_entries once pressed stays an upper bound on a hit (bounded_out) only while the
    # engine may still hold it: once max_entries newer keys were retained with no pressure and no use of it
    # between (the probe after each step matches it until it leaves the reference's entries), an engine
    # evicting least recently used for the bound has let it go
    def cached(key, handle, seed):
        return [O.Allocate(), O.Extend(handle, key, seed=seed), O.Retain(handle), O.Close(handle)]

    config = engine.F16_PAGE3.with_(pool_pages=16)          # max_entries 4
    ops = cached((7,) * 6, "c1", 1) + [O.Allocate(), O.Extend("c2", (8,) * 45, seed=2), O.Close("c2")]
    for k in range(8):                                      # pressed (2 + 15 > 16): then eight one-page keys
        ops += cached((20 + k,) * 3, f"c{3 + k}", 10 + k)
    ops += [O.Match((20,) * 3)]              # (20,) went for the bound at the fifth, four more came after
    lockstep = Lockstep(engine.factory, config)
    lockstep.run(ops)
    lockstep.finish()
    assert lockstep.reference.pressed
    try:
        Lockstep(ForgetsTheBoundOnceReclaimed, config).run(ops)
    except InvariantViolation as caught:
        assert "never longer" in str(caught), caught
    else:
        raise AssertionError("an engine keeping entries past max_entries once it reclaimed passed")


def test_a_hit_that_leaves_its_cached_page_in_the_free_queue_is_caught_when_the_pool_fills():
    # An audit's engine (s66): a hit took a cached page but left it queued, so a full pool handed it out
    # again, to another context; it passed ci in one configuration. The full-pool row now holds a hit on a
    # cached page while a context fills the pool and asks for one page more.
    from kvstate.stateful.conform import conform
    from foreign import free_queue

    class LeftQueued(free_queue.PoolCache):
        def take(self, page):
            page.refcount += 1      # the bug: a page taken at refcount 0 stays in the free queue

    def planted(config):
        return LeftQueued(config)
    planted.configs = free_queue.factory.configs
    wrong = conform(planted, configs=[free_queue.CONFIG], checks=["pinned semantics"])[0]
    assert not wrong.passed and "A pool that runs out does what the configuration declares" in str(wrong.failure)
    right = conform(free_queue.factory, configs=[free_queue.CONFIG], checks=["pinned semantics"])[0]
    assert right.passed, right.failure


def test_an_error_raised_by_the_suites_own_probe_is_said_to_be_the_probes():
    # An audit (s66) read "failing call: retain(ctx='c2')" over a traceback "in match": the suite's probe of
    # the entries after the step had raised it, which the report did not say.
    import pytest

    from kvstate.stateful.conform import describe
    from foreign import free_queue

    class MatchFails(free_queue.PoolCache):
        def match(self, tokens):
            raise RuntimeError("match fails")

    run = Lockstep(MatchFails, free_queue.CONFIG)
    handle = run.apply(O.Allocate())
    run.apply(O.Extend(handle, (1, 2), seed=0))
    run.apply(O.Retain(handle))
    with pytest.raises(RuntimeError) as raised:
        run.check()         # a black box: its entries are probed through match
    said = describe(raised.value, run.history)
    assert "raised by the suite's own match of entry [1, 2]" in said and "failing call: retain(ctx='c1')" in said
