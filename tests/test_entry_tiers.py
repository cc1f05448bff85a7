"""Entries seen through the tree tier, in engines whose entries hold no reference to their pages.

From an audit that wrote a vLLM-like block cache (entries are a hash index, a page only entries keep
is ``cached`` at refcount 0) and exposed its entries:

- it was rejected in 3 operations, "entry (0,) holds None positions": invariant 5 read each entry's
  length under its holder name, and such an entry has no holder. ``EntryView.holder`` is None there.
- exposing the tree tier turned off the check of what entries hold: without it every check matches
  each entry by its key and compares the hit's values; with it only keys and their order were
  compared, so a write into a page only an entry keeps passed. ``Lockstep.finish`` now probes them.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

from kvstate.spec import Observation
from kvstate.spec.errors import InvariantViolation
from kvstate.spec.invariants import check_tree
from kvstate.spec.observation import EntryView
from kvstate.stateful import ops as O
from kvstate.stateful.conform import conform
from kvstate.stateful.lockstep import Lockstep

from foreign import block_pool

SMALL = settings(max_examples=15, stateful_step_count=20, derandomize=True, deadline=None, database=None)
POOL = next(config for config in block_pool.CONFIGS if config.pool_pages and config.precision == "f32")


def test_a_cached_page_engine_exposing_its_entries_passes():
    results = conform(block_pool.tree_factory, configs=[POOL], settings=SMALL,
                      checks=["lockstep", "seeded", "prefix edges", "pinned semantics"])
    assert all(result.passed for result in results), [result.failure for result in results]


def test_an_entry_naming_a_holder_the_books_do_not_list_is_named():
    obs = Observation(pages={}, holders={}, lengths={"ctx:0": 3}, pages_allocated=0, pages_freed=0,
                      arena_size=None, arena_out={}, arena_free=(), tree=None,
                      entries=(EntryView((1, 2), 0, "entry:0"),))
    with pytest.raises(InvariantViolation, match="names holder 'entry:0', which lengths does not list"):
        check_tree(obs, [((1, 2), 0)])
    check_tree(Observation(**{**obs.__dict__, "entries": (EntryView((1, 2), 0, None),)}), [((1, 2), 0)])


class WritesIntoCachedPages(block_pool.TreeTierCache):
    """Copy-on-write counts the contexts that list a page and forgets the entries that keep it: a
    write through the retained context changes the entry's page in place."""

    def shared(self, page: int) -> bool:
        return int(self.table.refcount[page]) > 1


@pytest.mark.parametrize("bug", [False, True])
def test_an_entry_changed_in_place_is_caught_with_the_tree_tier(bug):
    """Every check after each step passes (keys and order are right, and the context reads what it wrote);
    the run's end matches each entry and compares what it holds."""
    run = Lockstep(WritesIntoCachedPages if bug else block_pool.tree_factory, POOL)
    ctx = run.apply(O.Allocate())
    run.apply(O.Extend(ctx, (1, 2, 3, 4, 5), seed=1))
    run.apply(O.Retain(ctx))
    run.apply(O.Overwrite(ctx, 0, (1, 2), seed=2))
    run.check()
    if bug:
        with pytest.raises(AssertionError, match="invariant 5.*probing entry"):
            run.finish()
    else:
        run.finish()
