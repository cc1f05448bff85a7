"""What a black-box engine's entry probe says when it fails (an audit's findings, 2026-12-06).

The probe (``Lockstep._probe_entries``) matches every entry after every step. Its messages blamed
copy-on-write for a tie resolved to another entry, and a pool's eviction for a difference that a
retain (which takes no pages) showed.
"""

from __future__ import annotations

import pytest

from kvstate.spec import InvariantViolation
from kvstate.stateful import ops as O
from kvstate.stateful.lockstep import Lockstep

from foreign import audit_bugs, audit_minimal

CONFIG = next(c for c in audit_minimal.factory.configs if c.name == "block4-f32-pool10-evict")


def _checked_each_step(factory, steps) -> str:
    """``steps(apply)`` run in lockstep with every check after every operation; the violation's text."""
    run = Lockstep(factory, CONFIG)

    def apply(op):
        handle = run.apply(op)
        run.check()
        return handle
    with pytest.raises(InvariantViolation) as failed:
        steps(apply)
    return str(failed.value)


def _tie(apply):        # conform's shrunk counterexample for tie_first_retained
    c1 = apply(O.Allocate())
    apply(O.Extend(c1, (1, 0, 2, 1, 0), seed=0))
    apply(O.Retain(c1))
    c2 = apply(O.Match((1, 0, 2, 1)))
    apply(O.Overwrite(c2, 0, (1,), seed=12737))
    apply(O.Retain(c2))


def _stamp(apply):      # conform's shrunk counterexample for stamp_all_candidates: it shows at a retain
    c1 = apply(O.Allocate())
    apply(O.Extend(c1, (0,), seed=0))
    c2 = apply(O.Allocate())
    apply(O.Extend(c2, (2, 1, 1, 1), seed=0))
    c3 = apply(O.Allocate())
    apply(O.Extend(c3, (0, 0, 0, 0), seed=0))
    apply(O.Retain(c3))
    apply(O.Retain(c2))
    c4 = apply(O.Match((0, 0, 0, 0)))
    apply(O.Extend(c4, (0,), seed=0))
    apply(O.Retain(c4))
    apply(O.Retain(c1))


def test_a_tie_resolved_to_another_entry_is_named_beside_copy_on_write():
    said = _checked_each_step(audit_bugs.tie_first_retained, _tie)
    assert "the hit came from another entry than the reference's" in said and "most recently used" in said, said


def test_a_difference_a_retain_shows_is_not_blamed_on_the_pools_eviction():
    said = _checked_each_step(audit_bugs.stamp_all_candidates, _stamp)
    assert "probing entry" in said and "evicted for room" not in said, said
