"""The races check holds an entry of a block-matching engine to its whole blocks only, as lockstep does.

Under ``match="block"`` the pages past a retained key's last whole block are the engine's to keep or
not (``spec/semantics.py``; ``test_block_tails.py``). The lockstep machine passed ``block_tokens`` to
invariant 5 for that; the races check's tree invariant did not, so it rejected vLLM's way (full
blocks cached only) with "entry (0, 1, 2, 3, 4) holds 4 positions, key has 5": a correct engine
rejected by one check of the suite while every other passed it.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvstate.stateful import ops as O
from kvstate.stateful.lockstep import Lockstep
from kvstate.stateful.races.harness import RaceFailure, check_after

from test_block_tails import _block_pool


def _retained_five_tokens(keep_tails: bool) -> tuple[Lockstep, object]:
    factory = _block_pool(keep_tails)
    config = factory.configs[0]
    run = Lockstep(factory, config)
    ctx = run.apply(O.Allocate())
    run.apply(O.Extend(ctx, (0, 1, 2, 3, 4), seed=0))     # one whole block of 4 and one token past it
    run.apply(O.Retain(ctx))
    run.check()         # lockstep's own invariants pass either way
    return run, config


@pytest.mark.parametrize("keep_tails", [False, True])
def test_races_tree_invariant_lets_an_entry_hold_its_whole_blocks_only(keep_tails):
    run, config = _retained_five_tokens(keep_tails)
    check_after(run.engine, "after retain", config=config)
    (entry,) = run.engine.entries
    assert len(entry[1]) == (4 if not keep_tails else 5)      # the engine did drop (or keep) the tail


def test_races_tree_invariant_still_refuses_an_entry_short_of_its_whole_blocks():
    run, config = _retained_five_tokens(False)
    entry = run.engine.entries[-1][1]
    # the tail rule is block matching's: the same entry under token matching holds too little
    with pytest.raises(RaceFailure, match="invariant 5"):
        check_after(run.engine, "after retain", config=dataclasses.replace(config, match="token", block_tokens=0))
    entry.length = 3        # a bug: the entry lost a position of its whole block
    with pytest.raises(RaceFailure, match="invariant 5"):
        check_after(run.engine, "after retain", config=config)
