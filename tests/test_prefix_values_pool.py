"""A full pool under ``values="prefix"``: an engine that shares equal pages on retain is judged in a band.

SGLang's insert keeps the slots the tree already holds for a prefix and frees the request's own, so
such an engine can hold fewer pages than forks and retains alone would share, or, once the entry
whose pages it took is gone, more. The reference counts pages each way (``reference.model``'s page
labels, one name a way of sharing); with a pool that refuses, where the counts disagree on whether
there is room, either answer is right (``RefCache.check_room``), and where they agree the reference
decides alone. Each such answer narrows the ways the rest of the run may follow.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

from kvstate.reference import RefCache
from kvstate.reference.model import FORKS, SAME_KEY, WHOLE_PAGES
from kvstate.spec import Config, Layout
from kvstate.spec.errors import CapacityError
from kvstate.stateful import ops as O
from kvstate.stateful.conform import conform, load_factory
from kvstate.stateful.lockstep import Lockstep

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SMALL = settings(max_examples=40, stateful_step_count=20, derandomize=True, deadline=None, database=None)
PAGE, POOL = 2, 6


def _pool_module():
    return sys.modules[load_factory(str(EXAMPLES / "token_pool_backend.py")).__module__]


def _sharing_pool(limit_slack: int = 0, same_key_last_page: bool = False, on_full: str = "refuse",
                  evict_newest: bool = False):
    """The example's refusing token pool, retaining as SGLang inserts: each whole page of a retained
    context whose tokens up to the page's end an older entry's key begins with is given back, and
    the context and its new entry hold the entry's page instead (an entry of the same key included:
    the tree keeps its old slots). ``same_key_last_page``: from an entry of the same key, its partly
    filled last page too. ``limit_slack`` > 0 plants a bug: the pool takes that many pages past its
    limit. ``on_full="evict"``: a full pool evicts instead, least recently used entries keeping a
    page no context holds first, and past that takes ordinary memory; ``evict_newest`` plants a bug
    there: the most recently used such entry goes first."""
    base = _pool_module().TokenPoolCache

    class SharingPool(base):
        def __init__(self, config: Config):
            base.__mro__[1].__init__(self, config)      # the list cache's: the example refuses evicting pools
            self.config = config

        def retain(self, ctx) -> None:
            key, size = tuple(ctx.tokens), self.page_tokens
            kept = {}
            for i in range(len(ctx.pages)):
                end = min((i + 1) * size, len(key))
                if end == (i + 1) * size:
                    older = next((e for e in self.entries if e[0][:end] == key[:end]), None)
                else:
                    older = next((e for e in self.entries if e[0] == key), None) if same_key_last_page else None
                if older is not None and older[1].pages[i] is not ctx.pages[i]:
                    kept[i] = older[1].pages[i]
                    kept[i].refcount += 1       # held through the retain, which may drop that entry
            super().retain(ctx)
            entry = self.entries[-1][1]
            for i, page in kept.items():
                own = ctx.pages[i]
                page.refcount += 1              # the context's and the new entry's hold
                ctx.pages[i] = entry.pages[i] = page
                self.release(own)
                self.release(own)

        def make_room(self, needed: int) -> None:
            while on_full == "evict" and needed and len(self.live) + needed > self.config.pool_limit:
                held = {id(page) for ctx in self.contexts for page in ctx.pages}
                keeps = [e for e in self.entries if any(id(page) not in held for page in e[1].pages)]
                if not keeps:
                    return
                self._drop((max if evict_newest else min)(keeps, key=lambda e: e[2]))
            if on_full == "evict" or len(self.live) + needed <= self.config.pool_limit + limit_slack:
                return
            raise CapacityError(f"{len(self.live)} live pages + {needed} needed > pool")

    def factory(config: Config):
        return SharingPool(config)

    factory.configs = [Config(Layout(layers=1, kv_heads=1, head_dim=2), page_tokens=PAGE, precision="f32",
                              max_entries=3, match="token", pool_pages=POOL, on_full=on_full, values="prefix")]
    return factory


def _lockstep(factory) -> Lockstep:
    return Lockstep(factory, factory.configs[0])


def _two_equal_entries(run: Lockstep) -> str:
    """Two contexts written apart, (1, 2, 3, 4, 9) and (1, 2, 3, 4), both retained: the engine now holds
    the 2 pages they share once (3 pages), the reference's labels twice (5). Returns the second
    context's handle."""
    first = run.apply(O.Allocate())
    run.apply(O.Extend(first, (1, 2, 3, 4, 9), seed=1))
    run.apply(O.Retain(first))
    second = run.apply(O.Allocate())
    run.apply(O.Extend(second, (1, 2, 3, 4), seed=2))
    run.apply(O.Retain(second))
    return second


def test_the_engine_holds_the_pages_the_reference_counts_as_retains_share_them():
    run = _lockstep(_sharing_pool())
    _two_equal_entries(run)
    assert len(run.engine.live) == 3
    assert run.reference.live_pages(FORKS) == 5 and run.reference.live_pages(WHOLE_PAGES) == run.reference.live_pages(SAME_KEY) == 3


def test_inside_the_band_the_reference_follows_an_engine_that_had_room():
    """5 pages by the labels + 2 needed > 6, but 3 + 2 <= 6: the engine's answer (room) stands."""
    run = _lockstep(_sharing_pool())
    second = _two_equal_entries(run)
    run.apply(O.Extend(second, (5, 6, 7, 8), seed=3))
    run.check()
    assert len(run.engine.live) == 5


def test_the_engine_may_hold_more_pages_than_forks_share_and_refuse_for_it():
    """A retained fork moved onto an older entry's page leaves its own page to its parent: once that
    entry's other holders are gone the engine holds 2 pages where forks alone would share 1, and it
    refuses an extend the fork count has room for. Either answer is right there."""
    run = _lockstep(_sharing_pool())
    parent = run.apply(O.Allocate())
    run.apply(O.Extend(parent, (2, 2), seed=1))
    child = run.apply(O.Fork(parent))
    other = run.apply(O.Allocate())
    run.apply(O.Extend(other, (2, 2), seed=2))
    run.apply(O.Retain(other))
    run.apply(O.Retain(child))          # the same key: the tree keeps the page ``other`` wrote
    run.apply(O.Close(other))
    assert (len(run.engine.live), run.reference.live_pages(FORKS), run.reference.live_pages(WHOLE_PAGES)) == (2, 1, 2)
    filler = run.apply(O.Allocate())
    run.apply(O.Extend(filler, tuple(range(8)), seed=3))        # 4 pages: the pool's 6 are all live
    last = run.apply(O.Allocate())
    run.apply(O.Extend(last, (7, 7), seed=4))
    assert run.history[-1].endswith("refused: CapacityError")
    run.check()


def test_a_retain_of_a_key_held_already_may_keep_its_partly_filled_last_page_too():
    """(1, 2, 3) written twice apart and retained twice: an engine keeping the old entry's last page
    (half full, page size 2) holds 2 pages, one keeping whole pages only holds 3, forks alone 4. An
    extend of 2 pages into a pool of 6 is either answer's to give, as long as the engine has room."""
    for same_key_last_page, held in ((True, 2), (False, 3)):
        run = _lockstep(_sharing_pool(same_key_last_page=same_key_last_page))
        first = run.apply(O.Allocate())
        run.apply(O.Extend(first, (1, 2, 3), seed=1))
        run.apply(O.Retain(first))
        second = run.apply(O.Allocate())
        run.apply(O.Extend(second, (1, 2, 3), seed=2))
        run.apply(O.Retain(second))
        counts = [run.reference.live_pages(sharing) for sharing in (FORKS, WHOLE_PAGES, SAME_KEY)]
        assert (len(run.engine.live), counts) == (held, [4, 3, 2])
        third = run.apply(O.Allocate())
        run.apply(O.Extend(third, (4, 5, 6, 7), seed=3))         # 2 more pages: room for 2 or 3 held, not 4
        assert "refused" not in run.history[-1]
        run.check()


def test_conform_passes_a_pool_that_keeps_a_held_keys_last_page():
    results = conform(_sharing_pool(same_key_last_page=True), settings=SMALL, checks=["lockstep", "seeded"])
    assert all(result.passed for result in results), [result.failure for result in results]


def test_an_evicting_pool_that_shares_on_retain_evicts_less_and_the_reference_keeps_what_it_kept():
    """The two entries alone hold 5 pages as forks share them, 3 as the engine holds them: an extend of 2
    pages into a pool of 6 makes the reference evict the oldest entry by the first count, and the engine
    nothing. The engine's entries (its tree tier) tell which way of sharing it follows, and the
    reference keeps those."""
    run = _lockstep(_sharing_pool(on_full="evict"))
    second = _two_equal_entries(run)
    run.apply(O.Close("c1"))
    run.apply(O.Close(second))
    third = run.apply(O.Allocate())
    run.apply(O.Extend(third, (5, 6, 7, 8), seed=3))
    run.check()
    assert len(run.engine.entries) == len(run.reference.entries) == 2


def test_conform_passes_an_evicting_pool_that_shares_on_retain():
    results = conform(_sharing_pool(on_full="evict"), settings=SMALL, checks=["lockstep", "seeded"])
    assert all(result.passed for result in results), [result.failure for result in results]


def test_an_evicting_pool_that_evicts_the_newest_entry_is_caught():
    """The band lets the reference follow an evicting pool's way of sharing, not its choice of what to
    evict: two entries of one page each, no context holding them, and an extend of 5 pages into the
    pool of 6 evicts one; the pool that evicts the newer is caught, its twin passes."""
    for newest in (False, True):
        run = _lockstep(_sharing_pool(on_full="evict", evict_newest=newest))
        for first, seed in ((1, 1), (3, 2)):
            handle = run.apply(O.Allocate())
            run.apply(O.Extend(handle, (first, first + 1), seed=seed))
            run.apply(O.Retain(handle))
            run.apply(O.Close(handle))
        run.apply(O.Extend(run.apply(O.Allocate()), tuple(range(10, 20)), seed=3))
        if newest:
            with pytest.raises(AssertionError, match="invariant 5"):
                run.check()
        else:
            run.check()
            assert run.engine.entries[0][0] == run.reference.entries[0][0] == (3, 4)


def test_conform_rejects_an_evicting_pool_that_evicts_the_newest_entry():
    """At the budget the tests above pass their correct twins at: the directed prefix edges catch it (the
    random runs at this budget do not reach an eviction where the choice shows)."""
    results = conform(_sharing_pool(on_full="evict", evict_newest=True), settings=SMALL,
                      checks=["lockstep", "seeded", "prefix edges"])
    failures = [str(result.failure) for result in results if not result.passed]
    assert failures and "invariant 5" in failures[0], failures


def _reference_with_two_entries(config: Config):
    """A reference alone holding ``_two_equal_entries``' entries; the second context, still open."""
    reference = RefCache(config)
    for tokens in ([1, 2, 3, 4, 9], [1, 2, 3, 4]):
        ctx = reference.allocate()
        ctx.extend(tokens, np.zeros((len(tokens), 1, 2, 1, 2), np.float32))
        reference.retain(ctx)
    return reference, ctx


def test_the_reference_alone_still_refuses_by_its_labels():
    """Without an engine's answer (``engine_refused`` None) the band is closed: the labels decide."""
    _, ctx = _reference_with_two_entries(_sharing_pool().configs[0])
    with pytest.raises(CapacityError):
        ctx.extend([5, 6, 7, 8], np.zeros((4, 1, 2, 1, 2), np.float32))


def test_past_the_band_a_pool_taking_more_than_its_limit_is_caught():
    """Counted either way (5 or 3 pages), the pages held plus the need (4) pass the pool of 6: a pool
    that takes them anyway is over its limit however it shares, and the lockstep names the disagreement."""
    run = _lockstep(_sharing_pool(limit_slack=2))
    second = _two_equal_entries(run)
    with pytest.raises(AssertionError, match="errors"):
        run.apply(O.Extend(second, tuple(range(5, 13)), seed=3))


def test_conform_passes_the_sharing_pool_and_rejects_its_overfull_twin():
    passed = conform(_sharing_pool(), settings=SMALL, checks=["lockstep", "seeded"])
    assert all(result.passed for result in passed), [result.failure for result in passed]
    failed = conform(_sharing_pool(limit_slack=1), settings=SMALL, checks=["lockstep", "seeded"])
    assert not any(result.passed for result in failed)


def test_seeded_values_keep_the_band_closed():
    """The band is for ``values="prefix"`` only: with seeded values equal tokens are not equal K/V, and an
    engine sharing them would be wrong, so an extend past the labels' count is refused there as before."""
    reference, ctx = _reference_with_two_entries(dataclasses.replace(_sharing_pool().configs[0], values="seeded"))
    reference.engine_refused = False
    with pytest.raises(CapacityError):
        ctx.extend([5, 6, 7, 8], np.zeros((4, 1, 2, 1, 2), np.float32))


def test_an_engine_sharing_one_way_then_another_is_caught():
    """Each answer inside the band narrows the ways of sharing the run may still follow: a pool that had
    room as a sharing engine, then refuses where only forks' count is full, shares no one way."""
    run = _lockstep(_sharing_pool())
    second = _two_equal_entries(run)
    run.apply(O.Extend(second, (5, 6, 7, 8), seed=3))            # room as retains share: 5 pages live
    assert run.reference.viable == (WHOLE_PAGES, SAME_KEY)

    def full(needed: int) -> None:
        raise CapacityError("counted as forks share pages")
    run.engine.make_room = full
    with pytest.raises(AssertionError, match="errors"):
        run.apply(O.Extend(second, (9,), seed=4))                # 5 + 1 fit the pool of 6 as it shares


def test_a_refusal_every_way_of_sharing_counts_alike_says_its_count_once():
    # An audit (s73): a refusal's message repeated "16 pages held by contexts ... + 9 needed" for each of
    # five ways of sharing pages, 1,063 characters, where every way counted the same.
    config = _sharing_pool().configs[0]
    reference = RefCache(config)
    ctx = reference.allocate()
    with pytest.raises(CapacityError) as refused:
        ctx.extend(list(range(4 * config.pool_pages + 1)), np.zeros((4 * config.pool_pages + 1, 1, 2, 1, 2), np.float32))
    said = str(refused.value)
    assert said.count("needed") == 1 and "every way of sharing pages counted" in said, said
