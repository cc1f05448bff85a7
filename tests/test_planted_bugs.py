"""The suite is tested too: each planted bug must be caught by the lockstep machine's ci profile."""

import pytest

from kvstate.impl.numpy import factory as numpy_factory
from kvstate.spec.semantics import may_refuse
from kvstate.stateful.configs import all_configs, configs_for, machine_configs
from kvstate.stateful.conform import conform
from kvstate.stateful.planted import PLANTED

ARENA_BUGS = {"arena_slot_kept_on_eviction", "dirty_recycled_slot"}
Q8_BUGS = {"q8_rounds_half_away_from_zero"}      # the bug is in the q8 encoding: only q8 configurations
POOL_BUGS = {"refused_extend_keeps_pages"}       # only a pool that refuses shows it
# Planted to show what random runs miss: the hunt profile does not reach it in any of the
# six configurations; tests/test_exhaustive.py finds it with a minimal trace.
EXHAUSTIVE_ONLY = {"truncate_shared_boundary"}


def _configs(bug):
    if bug in POOL_BUGS:
        return [c for c in all_configs() if may_refuse(c.on_full)]
    return [c for c in machine_configs()
            if (c.arena_pages or bug not in ARENA_BUGS) and (c.precision == "q8" or bug not in Q8_BUGS)]


@pytest.mark.parametrize("bug", sorted(set(PLANTED) - EXHAUSTIVE_ONLY))
def test_planted_bug_is_caught(bug):
    configs = _configs(bug)
    with PLANTED[bug]():
        results = conform(numpy_factory, profile="hunt", configs=configs, first_failure=True)
    failures = [r for r in results if not r.passed]
    assert failures, f"{bug} was not caught in any of {[c.name for c in configs]}"


def test_unplanted_engine_passes_the_hunt_profile():
    """The control: without a planted bug the same runs pass, so the catches above are real."""
    results = conform(numpy_factory, profile="hunt")
    assert len(results) == len(configs_for(numpy_factory)) > len(machine_configs()) and all(r.passed for r in results), [r.failure for r in results if not r.passed]
