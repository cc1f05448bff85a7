"""Under ``match="block"`` an entry's pages past its last whole block are the engine's to keep or not.

No hit reaches past a retained key's last whole block, so a block-hash engine that caches full
blocks only (vLLM) keeps no partly filled last page, and a later write into the context's own such
page copies nothing. With a pool that refuses, the reference judges room between counting those
pages and not: either answer is right there, and the run goes on with the engine's. An outside
audit's block engine with a refusing pool was rejected in 215 of 300 sweep runs for it.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

from kvstate.reference import RefCache
from kvstate.spec import Layout
from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.errors import CapacityError
from kvstate.stateful import ops as O
from kvstate.stateful.conform import conform, load_factory
from kvstate.stateful.lockstep import Lockstep

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SMALL = settings(max_examples=15, stateful_step_count=20, derandomize=True, deadline=None, database=None)
LAYOUT = Layout(layers=1, kv_heads=1, head_dim=2)


def _block_pool(keep_tails: bool, limit_slack: int = 0):
    """The example token pool (``examples/token_pool_backend.py``) matching whole blocks of 4 with a
    refusing pool of 12 pages. ``keep_tails`` False: a retained key's pages past its last whole block
    are not kept (vLLM's way). ``limit_slack`` > 0 plants a bug: the pool takes that many pages past
    its limit."""
    base = sys.modules[load_factory(str(EXAMPLES / "token_pool_backend.py")).__module__].TokenPoolCache

    class BlockPool(base):
        def retain(self, ctx) -> None:
            super().retain(ctx)
            entry = self.entries[-1][1]
            whole = len(entry) - len(entry) % self.config.block_tokens
            if not keep_tails and len(entry) > whole:     # it holds its whole blocks only
                for page in entry.pages[pages_needed(whole, self.page_tokens):]:
                    self.release(page)
                entry.pages, entry.length = entry.pages[:pages_needed(whole, self.page_tokens)], whole

        def make_room(self, needed: int) -> None:
            if needed and len(self.live) + needed <= self.config.pool_limit + limit_slack:
                return
            super().make_room(needed)

    def factory(config):
        return BlockPool(config)

    factory.configs = [dataclasses.replace(config, layout=LAYOUT, match="block", block_tokens=4, pool_pages=12,
                                           values="prefix", max_entries=4)
                       for config in load_factory(str(EXAMPLES / "token_pool_backend.py")).configs[:1]]
    return factory


def _tail_kept_by_the_reference_only(run: Lockstep) -> str:
    """One token retained (no whole block), then 11 pages more in another context: 12 live, the pool
    full. Returns the first context's handle, whose one page its entry may list or not."""
    first = run.apply(O.Allocate())
    run.apply(O.Extend(first, (0,), seed=0))
    run.apply(O.Retain(first))
    second = run.apply(O.Allocate())
    run.apply(O.Extend(second, (1,) * 44, seed=0))
    return first


@pytest.mark.parametrize("keep_tails", [False, True])
def test_a_write_into_a_page_only_a_retained_tail_shares_may_or_may_not_copy(keep_tails):
    # Kept, the page is shared and the write must copy it: no room, refused. Not kept, it is the
    # context's alone: written in place. The reference counted it kept, and refused either way.
    factory = _block_pool(keep_tails)
    run = Lockstep(factory, factory.configs[0])
    first = _tail_kept_by_the_reference_only(run)
    run.apply(O.Extend(first, (0,), seed=0))
    run.check()
    assert len(run.live[first][0]) == (1 if keep_tails else 2) and len(run.engine.live) == 12


def test_the_reference_alone_still_counts_the_tail():
    # With no engine's answer (``engine_refused`` None) the band is closed: the labels decide.
    reference = RefCache(_block_pool(False).configs[0])
    first = reference.allocate()
    first.extend([0], np.zeros((1, 1, 2, 1, 2), np.float32))
    reference.retain(first)
    reference.allocate().extend([1] * 44, np.zeros((44, 1, 2, 1, 2), np.float32))
    with pytest.raises(CapacityError, match=r"12 live pages \+ 1 needed \(at least 12 \+ 0\)"):
        first.extend([0], np.zeros((1, 1, 2, 1, 2), np.float32))


def test_past_the_band_a_block_pool_taking_more_than_its_limit_is_caught():
    # Counted either way, the second context's 12 pages more pass the pool: an engine taking them is over it.
    factory = _block_pool(False, limit_slack=2)
    run = Lockstep(factory, factory.configs[0])
    first = _tail_kept_by_the_reference_only(run)
    with pytest.raises(AssertionError, match="errors"):
        run.apply(O.Extend(first, (0,) * 8, seed=0))


@pytest.mark.parametrize("keep_tails", [False, True])
def test_conform_passes_a_block_pool_keeping_tails_or_not_and_rejects_an_overfull_one(keep_tails):
    passed = conform(_block_pool(keep_tails), settings=SMALL, checks=["lockstep", "seeded"])
    assert all(result.passed for result in passed), [result.failure for result in passed]
    failed = conform(_block_pool(keep_tails, limit_slack=1), settings=SMALL, checks=["lockstep", "seeded"])
    assert not any(result.passed for result in failed)
