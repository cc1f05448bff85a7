"""Races a scheduler creates, under threads, at CI size (``kvstate stress`` runs them for minutes).

The scenarios live in ``kvstate.stateful.races.scenarios``; each checks the invariants and the
reference itself and raises ``RaceFailure`` naming store, seed and iteration. At CI size
each runs once under every configuration of ``race_configs()`` (the six standard ones
and every declared semantics), ``pressure_vs_match`` under every ``pressure_configs()``.
Stores: ``available_stores()`` -- ``numpy``, plus ``torch`` once ``impl/torch.py`` exists; the three
scenarios racing over the tree and the books alone run the torch store under ``-m slow`` (``BOOKS_STORES``).

The planted bugs at the end show which scenario catches which concurrency defect of the
semantics code, and how reliably.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading

import numpy as np
import pytest

from kvstate.impl.cache import Cache
from kvstate.impl.pool_policy import PoolPolicy, _keeps_a_page
from kvstate.impl.radix import pack
from kvstate.impl.tree_bounds import TreeBounds
from kvstate.spec import invariants
from kvstate.spec.errors import CapacityError, ContextBusyError, ContextClosedError
from kvstate.spec.layout import check_tokens
from kvstate.stateful.races import scenarios as races

STORES = races.available_stores()
SEED = int(os.environ.get("KVSTATE_RACE_SEED", "20261129"))
# The scenarios whose threads race over the tree and the pool's books (under the cache lock, the
# same engine code for every store) run on the NumPy store by default and on the others under
# ``-m slow``; the scenarios whose threads write, read and copy page data run on every store.
BOOKS_STORES = [pytest.param(store, marks=[] if store == "numpy" else [pytest.mark.slow]) for store in STORES]


def _run(name: str, store: str):
    report = races.SCENARIOS[name](store=store, seed=SEED, iterations=races.CI_ITERATIONS[name])
    assert report.iterations == races.CI_ITERATIONS[name]
    # Every declared semantics, once each: the configurations CI cycles through are all of them.
    configs = races.pressure_configs() if name == "pressure_vs_match" else races.race_configs()
    assert sorted(report.configs) == sorted(config.name for config in configs)
    return report


def test_race_configurations_cover_every_declared_semantics():
    from kvstate.spec.protocol import SEMANTICS_TAGS
    from kvstate.stateful.configs import semantics_configs

    names = [config.name for config in races.race_configs()]
    assert len(names) == len(set(names)) == 6 + len(semantics_configs())
    # 'prefix-values' only changes which values the random engines draw, which no race compares
    assert set().union(*(config.tags for config in races.race_configs())) == SEMANTICS_TAGS - {"prefix-values"}
    assert all(config.layout == races.RACE_LAYOUT for config in races.race_configs())
    pressure = races.pressure_configs()
    assert {config.on_full for config in pressure} == {"evict", "refuse", "evict-then-refuse"}
    assert {config.match for config in pressure} == {"entry", "token", "block"}


@pytest.fixture(autouse=True)
def _switch_interval_restored():
    before = sys.getswitchinterval()
    yield
    assert sys.getswitchinterval() == before, "a scenario left the switch interval changed"


@pytest.mark.parametrize("store", STORES)
def test_reads_racing_a_copy_on_write_of_many_pages_see_only_the_values_written(store):
    report = _run("reads_during_copy_on_write", store)
    assert report.counts["copies_on_write"] == 6 * report.iterations
    assert report.counts.get("reads", 0) + report.counts.get("busy_reads", 0) > 0      # pauses were read in


@pytest.mark.parametrize("store", BOOKS_STORES)
def test_a_hit_paused_at_its_lines_while_retains_run_leaves_recency_in_order(store):
    report = _run("stamps_vs_retains", store)
    assert "skipped" not in report.counts       # every race configuration applies
    assert report.counts["stamp_rounds"] == races.MOST_PAUSES * report.iterations
    assert report.counts["retains"] == races.RETAINS_IN_PAUSE * report.counts["stamp_rounds"]


@pytest.mark.parametrize("store", STORES)
def test_sixteen_threads_fork_one_parent_then_write_their_own_branch(store):
    report = _run("fork_storm", store)
    assert report.threads == 16
    assert report.counts["forks"] == 16 * report.iterations
    assert report.counts["pages_copied"] > 0
    assert report.counts["observations"] > 0


@pytest.mark.parametrize("store", BOOKS_STORES)
def test_eviction_races_allocation(store):
    report = _run("eviction_vs_allocation", store)
    assert report.counts["retains"] > 0 and report.counts["allocations"] > 0
    assert report.counts["match_hits"] > 0
    assert report.counts["refusals"] > 0          # the refusing pools did refuse, and nothing changed


@pytest.mark.parametrize("store", BOOKS_STORES)
def test_pressure_eviction_and_refusal_race_allocation_and_match(store):
    report = _run("pressure_vs_match", store)
    assert report.counts["pressure_evictions"] > 0     # the pools that evict did, while others matched
    assert report.counts["refusals"] > 0               # the pools that refuse did, leaving contexts as they were
    assert report.counts["match_hits"] > 0 and report.counts["retains"] > 0
    assert report.counts["observations"] > 0


@pytest.mark.parametrize("store", BOOKS_STORES)
def test_match_and_close_race_clear(store):
    report = _run("match_close_vs_clear", store)
    assert report.counts["clears"] > 0 and report.counts["match_hits"] > 0


@pytest.mark.parametrize("store", STORES)
def test_close_racing_use_close_and_fork_gives_named_errors(store):
    report = _run("close_races", store)
    # Every user thread ends by seeing the context closed: one "closed" outcome per user per iteration.
    assert report.counts["uses_closed"] == report.iterations * (report.threads - 2)


@pytest.mark.parametrize("store", STORES)
def test_snapshot_and_restore_race_a_decode_rewriting_the_shared_prefix(store):
    report = _run("snapshot_vs_decode", store)
    assert report.counts["snapshots"] > 0 and report.counts["decode_steps"] > 0


@pytest.mark.parametrize("store", STORES)
def test_observe_while_other_threads_write_sees_consistent_structure(store):
    report = _run("observe_during_writes", store)
    assert report.counts["observed_changes"] == 40 * report.iterations     # different states, each checked
    assert report.counts["contexts_written"] > 0


def test_watch_checks_each_new_state_and_never_takes_an_aliased_one_for_old():
    """``Watch`` checks an observation unless it equals the last one checked; an observation
    that shares a dict with the last one (a backend changing it in place) is checked again."""
    from kvstate.spec.errors import InvariantViolation

    config = races.race_configs()[0]
    cache = races.make_cache("numpy", config)
    watch = races.Watch(cache, config)
    assert watch.look() is True and watch.look() is False and watch.changes == 1
    ctx = cache.allocate()
    races.extend(ctx, config, [1, 2, 3, 4])
    assert watch.look() is True and watch.changes == 2

    class InPlace:              # a new Observation each time, sharing one pages dict changed in place
        def __init__(self):
            self.obs = cache.observe()

        def observe(self):
            return dataclasses.replace(self.obs)

    in_place = InPlace()
    watch = races.Watch(in_place, config)
    assert watch.look() is True
    page_id, page = next(iter(in_place.obs.pages.items()))
    in_place.obs.pages[page_id] = type(page)(page.page_id, page.refcount + 1, page.slot)
    with pytest.raises(InvariantViolation):
        watch.look()
    ctx.close()


# -- deterministic: one thread holds a context, another is refused by name -----------------

def _holding(ctx):
    """A thread that holds ``ctx`` (as an operation in progress would) until released."""
    held, release = threading.Event(), threading.Event()

    def hold():
        ctx._owned(lambda: (held.set(), release.wait(10)))

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(10)
    return release, thread


def _operations(cache, config, ctx, folder):
    ops = {
        "read": lambda: ctx.read(),
        "tokens": lambda: ctx.tokens,
        "extend": lambda: races.extend(ctx, config, [5]),
        "overwrite": lambda: races.overwrite(ctx, config, 0, [6]),
        "fork": lambda: ctx.fork(),
        "truncate": lambda: ctx.truncate(1),
        "retain": lambda: cache.retain(ctx),
        "close": lambda: ctx.close(),
        "snapshot": lambda: ctx.snapshot(folder / "s.kvs"),
    }
    return ops


@pytest.mark.parametrize("store", STORES)
def test_every_operation_on_a_context_held_by_another_thread_is_refused_and_changes_nothing(store, tmp_path):
    config = races.race_configs()[1]
    cache = races.make_cache(store, config)
    ctx = cache.allocate()
    races.extend(ctx, config, [1, 2, 3, 4])
    sibling = ctx.fork()
    before = cache.observe()
    release, thread = _holding(ctx)
    try:
        for name, op in _operations(cache, config, ctx, tmp_path).items():
            with pytest.raises(ContextBusyError, match=f"context {ctx.context_id}"):
                op()
            assert cache.observe() == before, f"refused {name} changed the cache"
    finally:
        release.set()
        thread.join()
    races.verify(ctx, config, "ctx", want_tokens=[1, 2, 3, 4])
    for c in (ctx, sibling):
        c.close()
    races.check_emptied(cache, "held")


@pytest.mark.parametrize("store", STORES)
def test_concurrent_forks_of_one_parent_all_succeed(store):
    """A fork runs whole under the cache lock and only tests the busy flag: forks of one parent
    from many threads take turns (README, Concurrency), none is refused, and every page ends
    with one holder more per fork."""
    config = races.race_configs()[0]
    cache = races.make_cache(store, config)
    parent = cache.allocate()
    races.extend(parent, config, list(range(3 * config.page_tokens)))
    threads, start = 8, threading.Barrier(8)
    children, errors = [], []

    def fork_many():
        start.wait(10)
        for _ in range(50):
            try:
                children.append(parent.fork())
            except Exception as error:     # noqa: BLE001 - any refusal fails the test below
                errors.append(error)

    workers = [threading.Thread(target=fork_many) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert errors == [] and len(children) == threads * 50
    assert {page.refcount for page in parent._pages} == {1 + threads * 50}
    for ctx in (parent, *children):
        ctx.close()
    races.check_emptied(cache, "forked")


@pytest.mark.parametrize("store", STORES)
def test_use_after_close_from_another_thread_is_refused_and_refcounts_hold(store, tmp_path):
    config = races.race_configs()[0]
    cache = races.make_cache(store, config)
    ctx = cache.allocate()
    races.extend(ctx, config, list(range(10)))
    sibling = ctx.fork()                          # shares every page: a double release would free them
    closer = threading.Thread(target=ctx.close)
    closer.start()
    closer.join()
    assert ctx.closed
    after_close = cache.observe()
    invariants.check_structure(after_close)
    errors = []

    def use_everything():
        for name, op in _operations(cache, config, ctx, tmp_path).items():
            try:
                op()
                errors.append(f"{name} succeeded on a closed context")
            except ContextClosedError:
                pass
            except Exception as error:            # noqa: BLE001 - collected and asserted below
                errors.append(f"{name} raised {error!r}")

    user = threading.Thread(target=use_everything)
    user.start()
    user.join()
    assert errors == []
    assert cache.observe() == after_close
    races.verify(sibling, config, "sibling", want_tokens=list(range(10)))
    assert all(page.refcount == 1 for page in cache.observe().pages.values())
    sibling.close()
    races.check_emptied(cache, "use-after-close")


@pytest.mark.parametrize("store", STORES)
def test_closing_twice_at_once_succeeds_once(store):
    config = races.race_configs()[2]
    cache = races.make_cache(store, config)
    ctx = cache.allocate()
    races.extend(ctx, config, [3, 1, 4, 1, 5])
    sibling = ctx.fork()
    outcomes, barrier = [], threading.Barrier(8)

    def close():
        barrier.wait()
        while True:
            try:
                ctx.close()
                outcomes.append("closed")
            except ContextBusyError:
                continue
            except ContextClosedError:
                outcomes.append("already closed")
            return

    with races.switch_interval():
        threads = [threading.Thread(target=close) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(outcomes) == ["already closed"] * 7 + ["closed"]
    invariants.check_structure(cache.observe())
    races.verify(sibling, config, "sibling", want_tokens=[3, 1, 4, 1, 5])
    sibling.close()
    races.check_emptied(cache, "double close")


def test_a_refused_write_must_leave_its_context_unchanged():
    """``attempt`` is what lets a refusing pool refuse: it fails a refusal that changed the context,
    and any ``CapacityError`` where the pool does not refuse."""
    refusing = next(c for c in races.race_configs() if c.on_full == "refuse")
    evicting = next(c for c in races.race_configs() if c.on_full == "evict")
    report = races.RaceReport("attempt", "numpy", 0)
    cache = races.make_cache("numpy", refusing)
    ctx = cache.allocate()
    races.extend(ctx, refusing, [1, 2, 3])

    def half_done():           # a write that lands, then is reported refused
        races.extend(ctx, refusing, [4])
        raise CapacityError("pool full")

    with pytest.raises(races.RaceFailure, match="refused write changed the length from 3 to 4"):
        races.attempt(half_done, ctx, refusing, report, "ctx", want_tokens=[1, 2, 3])

    def refused():
        raise CapacityError("pool full")

    assert races.attempt(refused, ctx, refusing, report, "ctx", want_tokens=[1, 2, 3, 4]) is False
    assert report.counts["refusals"] == 2
    with pytest.raises(races.RaceFailure, match="CapacityError although on_full='evict'"):
        races.attempt(refused, ctx, evicting, report, "ctx")
    ctx.close()


def test_reports_name_the_seed_and_iteration_of_a_failure(monkeypatch):
    """A planted race bug (fork forgets its refcount increments) is caught and reported rerunnably."""
    from kvstate.impl import refcounts

    monkeypatch.setattr(refcounts.Refcounts, "share_holding", lambda self, holding: None)
    with pytest.raises(races.RaceFailure, match=r"fork_storm\[numpy, f32-heap\] seed=7 iteration=0"):
        races.fork_storm("numpy", seed=7, iterations=1, threads=4)


def test_kv_for_depends_on_token_and_position():
    layout = races.RACE_LAYOUT
    a = races.kv_for(layout, [1, 2], 0)
    assert not np.array_equal(a[0], races.kv_for(layout, [1], 1)[0])     # same token, other position
    assert not np.array_equal(a[1], races.kv_for(layout, [3], 1)[0])     # same position, other token
    assert np.array_equal(a[1], races.kv_for(layout, [2], 1)[0])


# -- the tree's bounds, checked from both sides --------------------------------------------------

def test_a_tree_past_its_page_budget_is_caught(monkeypatch):
    """Planted: retain evicts for ``max_entries`` only, ignoring ``max_pages``."""
    monkeypatch.setattr(TreeBounds, "exceeded", lambda self, tree: len(tree) > self.max_entries)
    budgeted = [c for c in races.race_configs() if c.max_pages]
    with pytest.raises(races.RaceFailure, match=r"count \d+ pages, max_pages is"):
        races.eviction_vs_allocation("numpy", seed=SEED, iterations=len(budgeted), configs=budgeted)


def test_a_tree_evicting_more_than_its_bounds_ask_is_caught(monkeypatch):
    """Planted: retain evicts one entry too many (down to ``max_entries - 1``); the tree's size
    after the threads follows the bounds from below too."""
    monkeypatch.setattr(TreeBounds, "exceeded", lambda self, tree: len(tree) >= self.max_entries)
    with pytest.raises(races.RaceFailure, match="evict only while passed"):
        races.eviction_vs_allocation("numpy", seed=SEED, iterations=2, configs=races.race_configs()[:2])


def test_a_block_hit_not_in_whole_blocks_is_caught(monkeypatch):
    """Planted: a ``block`` cache that returns the token match without rounding it down to whole
    blocks; the match results and every entry's own match follow ``hit_length``."""
    from kvstate.impl import cache as cache_module, matching

    monkeypatch.setattr(cache_module, "finder_for", lambda match, block_tokens: matching.finder_for("token", 0))
    blocks = [c for c in races.race_configs() if c.match == "block"]
    with pytest.raises(races.RaceFailure, match=r"block\d+-.*(not a whole number of \d+-token blocks|a block match holds)"):
        races.eviction_vs_allocation("numpy", seed=SEED, iterations=len(blocks), configs=blocks)


# -- planted concurrency bugs in the semantics code ------------------------------------------------
#
# Each runs a scenario with ``yields`` (threads give up the interpreter at random calls into
# the engine, see ``kvstate.stateful.races.harness.yielding_calls``): ``pressure_vs_match`` on the pools the bug
# concerns, or ``match_close_vs_clear``. Measured catch rates are in
# the report of the change that added them: the first three were caught in every run, the
# last in about four iterations of ten.

def _lock_of(policy: PoolPolicy):
    return policy.release_entry.__self__.lock


def _without_lock(policy: PoolPolicy, step):
    """Run ``step`` with the cache lock let go entirely (the RLock's own save/restore)."""
    lock = _lock_of(policy)
    saved = lock._release_save()
    try:
        return step()
    finally:
        lock._acquire_restore(saved)


def _pressure(on_full: str):
    configs = [c for c in races.pressure_configs() if c.on_full == on_full]
    return dict(seed=SEED, iterations=len(configs), configs=configs)


def test_memory_pressure_eviction_without_the_cache_lock_is_caught(monkeypatch):
    """Planted: ``make_room`` runs its whole eviction (victim choice, tree removal, page release)
    with the cache lock let go, racing every other thread's tree and refcount changes."""
    original = PoolPolicy.make_room
    monkeypatch.setattr(PoolPolicy, "make_room", lambda self, needed: _without_lock(self, lambda: original(self, needed)))
    with pytest.raises(races.RaceFailure, match=r"pressure_vs_match\[numpy, [^\]]*evict[^\]]*\] seed="):
        races.pressure_vs_match("numpy", **_pressure("evict"))


def test_an_evicted_entry_released_outside_the_lock_is_caught(monkeypatch):
    """Planted: the victim is chosen and taken out of the tree under the lock, but its pages are
    released after letting the lock go (a refcount dropped unlocked; pages briefly unheld)."""
    def make_room(self, needed):
        while needed > 0 and not self.fits(needed) and self.on_full == "evict":
            held = self.context_page_ids()
            victim = self.tree.pop_oldest(where=lambda entry: _keeps_a_page(entry, held))
            if victim is None:
                return
            _without_lock(self, lambda: self.release_entry(victim))
            self.evictions += 1
        if needed > 0 and not self.fits(needed) and self.on_full == "refuse":
            raise CapacityError("full")

    monkeypatch.setattr(PoolPolicy, "make_room", make_room)
    with pytest.raises(races.RaceFailure, match=r"pressure_vs_match\[numpy, [^\]]*evict"):
        races.pressure_vs_match("numpy", **_pressure("evict"))


def test_a_refusing_pool_that_lets_the_lock_go_between_check_and_allocation_is_caught(monkeypatch):
    """Planted: the pool decides "it fits" and then lets the lock go before the pages are taken,
    so two threads can both fit into the last free pages: the observer sees the pool passed."""
    original = PoolPolicy.make_room

    def make_room(self, needed):
        original(self, needed)
        _without_lock(self, lambda: PoolPolicy.fits(self, 0))

    monkeypatch.setattr(PoolPolicy, "make_room", make_room)
    with pytest.raises(races.RaceFailure, match=r"refuse.*live pages in a pool of \d+ pages that refuses"):
        races.pressure_vs_match("numpy", **_pressure("refuse"))


def test_match_stamping_its_entry_outside_the_lock_is_caught(monkeypatch):
    """Planted: ``match`` forks the hit under the lock but stamps its entry on the clock after
    letting the lock go, racing ``clear`` and eviction (a stamp re-inserts a node they removed).
    The window is one call wide: ``match_close_vs_clear`` with ``yields`` catches it in about
    four iterations of ten, so twelve iterations miss it about once in a few hundred runs, more often
    on a loaded machine (a clean-clone CI run missed it once): up to three rounds of twelve, each of
    which must end in the failure or in nothing, and one of which must find it."""
    def match(self, tokens):
        query = pack(check_tokens(tokens))
        with self.lock:
            node, matched = self.find_hit(self.tree, query)
            if node is None:
                return self._new_context([], 0), 0
            found = self._fork(node.value, length=matched), matched
        self.tree.stamp(node)
        return found

    monkeypatch.setattr(Cache, "match", match)
    for round_ in range(3):
        try:
            races.match_close_vs_clear("numpy", seed=SEED + round_, iterations=len(races.race_configs()), yields=True)
        except races.RaceFailure as caught:
            assert re.search(r"match_close_vs_clear\[numpy, ", str(caught)), caught
            return
    pytest.fail("three rounds of match_close_vs_clear missed a match stamping its entry outside the lock")


def test_a_context_freed_between_the_check_and_the_refusal_is_busy_not_closed():
    """A caller saw the busy flag set; the thread that held the context clears it without the lock.
    What the caller is told must not be "closed" for a context that is open (a retry goes through)."""
    cache = races.make_cache("numpy", races.race_configs()[1])
    ctx = cache.allocate()
    with pytest.raises(ContextBusyError):
        ctx._refuse_use()               # the flag already cleared (FREE) by the time it is read again
    ctx.close()
    with pytest.raises(ContextClosedError):
        ctx._refuse_use()


def test_writable_from_another_thread_while_an_operation_holds_the_context_is_refused():
    """``writable`` replaces the page list under the lock, but the holding operation replaces it again
    from the one it read before: a copy made between would lose its refcounts. So it is refused by
    name, like every other use of a held context; the holder's own calls (its writes) go through."""
    cache = races.make_cache("numpy", races.race_configs()[1])
    ctx = cache.allocate()
    races.extend(ctx, races.race_configs()[1], [1, 2, 3, 4])
    sibling = ctx.fork()                                  # every page shared: writable would copy
    release, thread = _holding(ctx)
    try:
        before = cache.observe()
        with pytest.raises(ContextBusyError, match=f"context {ctx.context_id}"):
            ctx.writable(0)                               # this thread is not the holder
        assert cache.observe() == before
    finally:
        release.set()
        thread.join()
    assert ctx.writable(0) is not None                    # free again: the copy is made
    for c in (ctx, sibling):
        c.close()



def test_a_numpy_write_while_another_thread_imports_torch(monkeypatch):
    """Another thread's ``import torch`` leaves a module without ``Tensor`` in sys.modules for a while:
    a write of a NumPy array must not read ``torch.Tensor`` from it (AttributeError before)."""
    import types
    cache = races.make_cache("numpy", races.race_configs()[1])
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))       # partly initialised
    ctx = cache.allocate()
    races.extend(ctx, races.race_configs()[1], [1, 2, 3])
    assert ctx.tokens == [1, 2, 3]
    ctx.close()


def test_stress_ends_within_one_stretch_past_its_deadline_and_each_round_starts_further_on(monkeypatch):
    """``kvstate stress --minutes M`` is a bound: the deadline is checked after each CI-sized stretch of
    a scenario's iterations (a whole round at scale 10 took minutes past a 12 s run; one scenario at
    ``--scale 100000`` would have run for days); rounds rotate where they start; the stretches number
    the iterations on, as one call of them all would."""
    from kvstate.stateful.races import scenarios

    ran = []

    def fake(name):
        def run(store, seed, iterations, yields=False):
            ran.append((name, seed, iterations))
            report = scenarios.RaceReport(name, store, seed, threads=1, iterations=len(iterations))
            report.add("ops", 2 * len(iterations))
            return report
        return run
    for name in ("fork_storm", "close_races"):
        monkeypatch.setitem(scenarios.SCENARIOS, name, fake(name))
    stretch = scenarios.CI_ITERATIONS["fork_storm"]
    lines = []
    totals = scenarios.stress(0, stores=["numpy"], scenarios=["fork_storm", "close_races"], out=lines.append,
                              scale=100_000)
    assert ran == [("fork_storm", 0, range(0, stretch))] and list(totals) == ["fork_storm[numpy]"]
    assert totals["fork_storm[numpy]"] == {"rounds": 1, "iterations": stretch, "ops": 2 * stretch}
    assert len(lines) == 1 and f"iterations={stretch}" in lines[0]
    ticks = iter(range(10**6))      # one second a reading: the deadline at 60 s, after a few rounds
    ran.clear()
    lines.clear()
    totals = scenarios.stress(1, stores=["numpy"], scenarios=["fork_storm", "close_races"], out=lines.append,
                              clock=lambda: next(ticks), scale=2)
    assert [(name, seed) for name, seed, _ in ran[:8]] == [
        ("fork_storm", 0), ("fork_storm", 0), ("close_races", 0), ("close_races", 0),
        ("close_races", 1), ("close_races", 1), ("fork_storm", 1), ("fork_storm", 1)]
    assert [iterations for _, _, iterations in ran[:2]] == [range(0, stretch), range(stretch, 2 * stretch)]
    assert len(ran) == 60       # one reading at the start, then one a stretch: stopped at the deadline
    assert sum(total["iterations"] for total in totals.values()) == 60 * stretch
    assert len(lines) == 30 and all(f"iterations={2 * stretch}" in line for line in lines)
