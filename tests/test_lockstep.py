"""The lockstep machine, engine against reference, in all six configurations, with every page
recycled.

The machine's layouts are small, so its pages would normally be left to malloc (``np.zeros``;
pages of 2 MiB or more go through the NumPy store's spares). Here every page goes through the
spares, dirty from its last holder, at every precision, with and without an arena: one run checks
both the engine's semantics and page recycling (a fresh page is still made whenever no spare is
kept, as at every run's start). The malloc path runs under the lockstep machine in the seven
semantics configurations of tests/test_planted_bugs.py (and under -m slow the seeded engine in
all thirteen).
"""

import pytest

from kvstate.impl import numpy_store
from kvstate.impl.numpy import factory as numpy_factory
from kvstate.stateful.configs import PROFILES
from kvstate.stateful.machine import machine_for, run_machine

from helpers import default_suite_budget

# The ci profile at the default suite's 25 examples: the six configurations at 11.5 CPU seconds,
# not 20; the whole ci budget runs in ``kvstate conform`` and under -m slow below.
BUDGET = default_suite_budget("ci")


def _run_recycling(machine_config, monkeypatch, budget):
    """The machine's runs: (its stats, how many heap pages were a freed page's, back dirty)."""
    reused = []
    spare = numpy_store.NumpyStore._spare

    def counting(store):
        buffer = spare(store)
        reused.append(buffer is not None)
        return buffer
    monkeypatch.setattr(numpy_store.NumpyStore, "_spare", counting)
    machine = machine_for(numpy_factory, machine_config)
    run_machine(machine, budget)
    return machine.stats, sum(reused)


def test_lockstep_machine(machine_config, monkeypatch):
    stats, reused = _run_recycling(machine_config, monkeypatch, BUDGET)
    # The run really exercised the engine: many runs, many checked steps, snapshots restored (25
    # examples: 27-40 runs, 828-1,262 steps, 84-437 snapshots and 87-401 restores per configuration;
    # the same in every process, ``stateful/fixed_constants.py``).
    assert stats.runs >= BUDGET.max_examples
    assert stats.steps >= 500
    assert stats.snapshots >= 50 and stats.restores >= 50
    # Pages really came back dirty from the spares (the heap configurations reuse 25-127 pages;
    # with an arena the heap holds only what the arena does not, 10-26).
    assert reused >= (15 if machine_config.arena_pages == 0 else 5)


@pytest.mark.slow
def test_lockstep_machine_at_the_ci_budget(machine_config, monkeypatch):
    stats, reused = _run_recycling(machine_config, monkeypatch, PROFILES["ci"])
    # 50 examples: 56-68 runs, 1,820-2,258 steps, 196-543 snapshots and 152-257 restores per
    # configuration; the heap configurations reuse 83-110 pages, the arena ones 20-59.
    assert stats.runs >= PROFILES["ci"].max_examples
    assert stats.steps >= 1000
    assert stats.snapshots >= 100 and stats.restores >= 100
    assert reused >= (30 if machine_config.arena_pages == 0 else 5)


def test_a_refusal_where_the_reference_had_room_prints_both_books(monkeypatch):
    """From an audit: the hint blamed pages held past their use when the engine counted its need one page
    high; it now gives the pages both sides hold and both causes."""
    from kvstate.impl import pool_policy
    from kvstate.impl.numpy import factory as numpy_factory
    from kvstate.stateful import ops as O
    from kvstate.stateful.configs import config_named
    from kvstate.stateful.lockstep import Lockstep

    config = config_named("f32-arena10-refuse").with_(page_tokens=2)
    monkeypatch.setattr(pool_policy.PoolPolicy, "fits",
                        lambda self, needed: self.pool.live_count + needed + 1 <= self.limit)    # one page high
    run = Lockstep(numpy_factory, config)
    ctx = run.apply(O.Allocate())
    with pytest.raises(AssertionError) as refused:
        run.apply(O.Extend(ctx, tuple(i % 3 for i in range(2 * config.pool_limit)), seed=1))
    message = str(refused.value)
    assert "engine CapacityError" in message and "reference accepted" in message, message
    assert f"the reference had room: {config.pool_limit} pages live of the pool's {config.pool_limit} after it, " \
           "the engine 0 before it" in message, message
    assert "counts the operation's need higher" in message, message


def test_the_room_hint_counts_pages_the_way_of_sharing_the_run_follows(monkeypatch):
    """Under values="prefix" the reference counts pages once per way of sharing, and an engine's answers
    narrow them (``viable``); the hint's count is that of the way still followed, not of forks' sharing."""
    from kvstate.impl import pool_policy
    from kvstate.impl.numpy import factory as numpy_factory
    from kvstate.reference.model import WHOLE_PAGES
    from kvstate.stateful import ops as O
    from kvstate.stateful.configs import config_named
    from kvstate.stateful.lockstep import Lockstep

    config = config_named("f32-arena10-refuse").with_(page_tokens=2, values="prefix", match="token")
    run = Lockstep(numpy_factory, config)
    second = _two_entries_sharing_whole_pages(run)
    run.reference.viable = (WHOLE_PAGES,)       # as if an earlier answer of the engine had narrowed it
    monkeypatch.setattr(pool_policy.PoolPolicy, "fits",
                        lambda self, needed: self.pool.live_count + needed + 1 <= self.limit)    # one page high
    with pytest.raises(AssertionError) as refused:
        run.apply(O.Extend(second, tuple(range(6, 15)), seed=3))    # 5 new pages: a copy of the last, 4 more
    assert "the reference had room: 8 pages live of the pool's 10 after it" in str(refused.value), refused.value


@pytest.mark.parametrize("bug, said", [("stamp", "the same entries in another order"),
                                       ("no_eviction", "the engine keeps entries the reference evicted")])
def test_an_eviction_order_difference_says_which_way_it_differs(monkeypatch, bug, said):
    """From an audit: every eviction-order difference in an evicting pool carried the hint for entries
    evicted another way, also where the engine kept one the reference evicted or only their order differed."""
    from kvstate.impl import pool_policy, radix
    from kvstate.impl.numpy import factory as numpy_factory
    from kvstate.stateful import ops as O
    from kvstate.stateful.configs import config_named
    from kvstate.stateful.lockstep import Lockstep

    if bug == "stamp":
        original = radix.RadixTree.stamp
        monkeypatch.setattr(radix.RadixTree, "stamp",           # a hit stamps nothing (an insert still does)
                            lambda tree, node: None if node in tree.recency else original(tree, node))
    else:
        monkeypatch.setattr(pool_policy.PoolPolicy, "make_room", lambda policy, needed: None)     # falls back
    config = config_named("token-f32-arena6-evict").with_(page_tokens=2, max_entries=4)
    run = Lockstep(numpy_factory, config)
    for first in (1, 5):
        handle = run.apply(O.Allocate())
        run.apply(O.Extend(handle, (first, first + 1), seed=first))
        run.apply(O.Retain(handle))
        run.apply(O.Close(handle))
    with pytest.raises(AssertionError) as differs:
        if bug == "stamp":
            run.apply(O.Close(run.apply(O.Match((1, 2)))))
        else:
            run.apply(O.Extend(run.apply(O.Allocate()), tuple(i % 3 for i in range(2 * config.pool_limit)), seed=9))
        run.check()
    assert "eviction order" in str(differs.value) and said in str(differs.value), str(differs.value)


def test_a_directed_restore_tells_the_reference_how_the_engine_answered():
    """From a review: the snapshot checks' restores went to the reference without the engine's answer,
    and under values="prefix" the reference counts pages one way per way of sharing: an engine sharing
    whole pages by prefix, with room for the restore, met a reference refusing it as forks' count had
    none. ``Lockstep.restore_beside`` judges such a restore as ``apply`` judges the machine's."""
    import io

    from kvstate.impl import Cache
    from kvstate.impl.numpy import factory as numpy_factory
    from kvstate.reference.model import SAME_KEY, WHOLE_PAGES
    from kvstate.stateful.configs import config_named
    from kvstate.stateful.lockstep import Lockstep

    config = config_named("f32-arena10-refuse").with_(page_tokens=2, values="prefix", match="token", arena_pages=7)
    run = Lockstep(numpy_factory, config)
    second = _two_entries_sharing_whole_pages(run)
    stream = io.BytesIO()
    run.live[second][0].snapshot(stream)
    roomy = Cache(config.layout, page_tokens=2)     # an engine with room for 3 more pages, as whole pages' count has
    handle = run.restore_beside("restore(c2's bytes)", lambda: roomy.restore(io.BytesIO(stream.getvalue())), second)
    assert handle is not None and run.reference.viable == (WHOLE_PAGES, SAME_KEY)


def _two_entries_sharing_whole_pages(run) -> str:
    """Entries (1, 2, 3, 4) and (1, 2, 3, 4, 5) at 2-token pages under values="prefix", the second's
    context still open (its handle returned): 5 pages live as forks share them, 3 where retains share
    whole pages by prefix."""
    from kvstate.reference.model import FORKS, WHOLE_PAGES
    from kvstate.stateful import ops as O

    first = run.apply(O.Allocate())
    run.apply(O.Extend(first, (1, 2, 3, 4), seed=1))
    run.apply(O.Retain(first))
    run.apply(O.Close(first))
    second = run.apply(O.Allocate())
    run.apply(O.Extend(second, (1, 2, 3, 4, 5), seed=2))
    run.apply(O.Retain(second))
    assert (run.reference.live_pages(FORKS), run.reference.live_pages(WHOLE_PAGES)) == (5, 3)
    return second
