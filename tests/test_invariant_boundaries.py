"""Each invariant check at its exact boundary: one page, one count or one holder past what holds is a
violation. An audit (s73) weakened two checks by one case each (invariant 1 skipping cached pages,
invariant 2's count allowing one page more) and the whole suite passed: planted bugs were still caught,
later and under another name, so nothing else pinned where these checks draw the line."""

from __future__ import annotations

import pytest

from kvstate.spec.errors import InvariantViolation
from kvstate.spec.invariants import check_liveness, check_refcounts
from kvstate.spec.observation import Observation, PageView


def _observation(pages: dict, holders: dict, allocated: int, freed: int) -> Observation:
    return Observation(pages=pages, holders=holders, lengths={holder: 1 for holder in holders},
                       pages_allocated=allocated, pages_freed=freed, arena_size=None, arena_out={},
                       arena_free=(), tree=None, entries=None)


def test_a_cached_page_a_holder_lists_breaks_invariant_1():
    cached = {1: PageView(1, 0, None, cached=True)}
    check_refcounts(_observation(cached, {}, 1, 0))        # cached, listed by no one: refcount 0 holds
    with pytest.raises(InvariantViolation, match="page 1 has refcount 0 but 1 holders") as broken:
        check_refcounts(_observation(cached, {"ctx:1": (1,)}, 1, 0))
    assert broken.value.invariant == 1


def test_a_page_held_by_many_names_the_first_holders_and_counts_the_rest():
    # A page a hundred hits held printed a 740-character first line (s74): the rest are counted.
    holders = {f"ctx:{i}": (1,) for i in range(100, 130)}
    with pytest.raises(InvariantViolation, match=r"30 holders \['ctx:100', .*'ctx:111', 'and 18 more'\]$"):
        check_refcounts(_observation({1: PageView(1, 1, None)}, holders, 1, 0))


@pytest.mark.parametrize("allocated, freed", [(3, 0), (1, 0), (4, 1), (2, 1)])
def test_pages_allocated_less_freed_must_equal_the_live_pages_exactly(allocated, freed):
    live = {1: PageView(1, 1, None), 2: PageView(2, 1, None)}
    holders = {"ctx:1": (1, 2)}
    check_liveness(_observation(live, holders, 2, 0))
    with pytest.raises(InvariantViolation, match="pages allocated") as broken:
        check_liveness(_observation(live, holders, allocated, freed))
    assert broken.value.invariant == 2


def test_a_refusal_may_move_only_the_counters_that_count_refusals():
    # An audit (s73): dropping the counters from what a refusal must leave unchanged passed the suite.
    import dataclasses

    from kvstate.stateful.lockstep import observable_change

    before = dataclasses.replace(_observation({}, {}, 0, 0), counters={"refusals": 0, "pressure_evictions": 0})
    assert observable_change(before, dataclasses.replace(before, counters={"refusals": 1,
                                                                           "pressure_evictions": 0})) is None
    changed = observable_change(before, dataclasses.replace(before, counters={"refusals": 0, "pressure_evictions": 1}))
    assert changed is not None and changed.startswith("counters"), changed
