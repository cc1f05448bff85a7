"""Steps run with no observation before them: recorded by the run, marked in its report, and replayed and
shrunk as they ran (``Lockstep.unwatched``/``checked_after``, ``replay.AsWatched``, the shrinker's ``like``).
Observing may settle what a backend keeps lazily, so a replay that observes more than its run did can pass
where the run failed. Each piece is pinned here on its own: a checker mutant dropping any one of them
passed every other test (an audit, s74)."""

from __future__ import annotations

from foreign import lazy_counts
from kvstate.impl.numpy import factory as numpy_factory
from kvstate.stateful import ops as O
from kvstate.stateful.configs import config_named
from kvstate.stateful.lockstep import CHECKED, UNOBSERVED, Lockstep
from kvstate.stateful.replay import AsWatched
from kvstate.stateful.shrink import created_handles, renumber

CONFIG = config_named("f32-heap").with_(page_tokens=4)


def test_a_check_after_an_unobserved_step_is_recorded_and_marked():
    run = Lockstep(numpy_factory, CONFIG)
    run.apply(O.Allocate())
    extend = O.Extend("c1", (1, 2), seed=1)
    run.apply(extend, watched=False)
    assert id(extend) in run.unwatched and id(extend) not in run.checked_after
    assert run.history[-1].endswith(UNOBSERVED)
    run.check()
    assert id(extend) in run.checked_after and run.history[-1].endswith(UNOBSERVED + CHECKED)


def test_a_replay_checks_an_unobserved_step_where_its_run_checked_it():
    # Retained and cleared with nothing observed between, then checked: the plant frees the page the
    # context still holds (its queued -1s before its +1s). Checked after the clear, as the run was, the
    # failure shows there; left unchecked it shows only at the run's end, another failure.
    retain, clear = O.Retain("c1"), O.Clear()
    ops = [O.Allocate(), O.Extend("c1", (1,), seed=1), retain, clear]
    replay = AsWatched({id(retain): retain, id(clear): clear}, {id(clear): clear})
    failure, _ = replay(lazy_counts.decrements_first_factory, CONFIG, ops)
    assert (failure.step, failure.phase, failure.invariant) == (4, "check", 2), failure
    passing, _ = AsWatched({}, {})(lazy_counts.decrements_first_factory, CONFIG, ops)
    assert passing is None, passing        # observed at every step, the plant is never seen


def test_renumbering_keeps_a_renamed_operation_observed_as_it_ran():
    extend = O.Extend("c2", (1,), seed=0)
    ops = [O.Allocate(), O.Allocate(), extend]
    replay = AsWatched({id(extend): extend}, {id(extend): extend})
    kept = renumber(ops[1:], created_handles(ops)[1:], replay.like)
    assert kept[1] == O.Extend("c1", (1,), seed=0)
    assert id(kept[1]) in replay.unwatched and id(kept[1]) in replay.checked_after
