"""The suite is tested too: each planted bug is caught by conform's hunt profile (the ci runs,
unshrunk) and the check that caught it passes without the bug; the engine itself passes what
conform runs, in every configuration it declares."""

import re

import pytest

from kvstate.impl.numpy import factory as numpy_factory
from kvstate.spec.semantics import evicts_for_room, may_refuse
from kvstate.stateful.configs import all_configs, configs_for, machine_configs
from kvstate.stateful.conform import CHECKS, conform
from kvstate.stateful.planted import PLANTED

from helpers import assert_the_catch_is_the_bugs, default_suite_budget

ARENA_BUGS = {"arena_slot_kept_on_eviction", "dirty_recycled_slot"}
Q8_BUGS = {"q8_rounds_half_away_from_zero"}      # the bug is in the q8 encoding: only q8 configurations
POOL_BUGS = {"refused_extend_keeps_pages"}       # only a pool that refuses shows it
EVICT_THEN_REFUSE_BUGS = {"evicts_before_refusing"}      # only a pool that evicts and refuses shows it
EVICTING_POOL_BUGS = {"pool_evicts_newest"}      # only a pool that evicts for room shows it
SCALE_BUGS = {"refcounts_split_on_growth"}    # behind a size: the scale check
# Planted to show what random runs miss: the hunt profile does not reach it in any of the
# six configurations; tests/test_exhaustive.py finds it with a minimal trace.
EXHAUSTIVE_ONLY = {"truncate_shared_boundary"}


def _configs(bug):
    if bug in EVICT_THEN_REFUSE_BUGS:
        return [c for c in all_configs() if c.on_full == "evict-then-refuse"]
    if bug in EVICTING_POOL_BUGS:
        return [c for c in all_configs() if evicts_for_room(c.on_full)]
    if bug in POOL_BUGS:
        return [c for c in all_configs() if may_refuse(c.on_full)]
    return [c for c in machine_configs()
            if (c.arena_pages or bug not in ARENA_BUGS) and (c.precision == "q8" or bug not in Q8_BUGS)]


@pytest.mark.parametrize("bug", sorted(set(PLANTED) - EXHAUSTIVE_ONLY))
def test_planted_bug_is_caught(bug):
    configs = _configs(bug)
    checks = ["scale"] if bug in SCALE_BUGS else None
    with PLANTED[bug]():
        results = conform(numpy_factory, profile="hunt", configs=configs, checks=checks, first_failure=True)
    failures = [r for r in results if not r.passed]
    assert failures, f"{bug} was not caught in any of {[c.name for c in configs]}"
    # Caught as the bug it is, not as the plant itself breaking (an attribute the engine's
    # slotted Context refuses once made two planted bugs "caught" by their own AttributeError; a
    # plant that grew the refcount array but not the page table beside it, by a ValueError).
    for result in failures:
        assert not re.search(r"raised (AttributeError|NameError|TypeError|ValueError|IndexError)\b",
                             str(result.failure)), result.failure
    assert_the_catch_is_the_bugs(results, numpy_factory, "hunt")     # our engine, unplanted


def _engine_checks(config) -> list[str]:
    """What ``kvstate conform`` runs, less the races (tests/test_races.py's scenarios, in every
    semantics, at more iterations than conform's races check), the seeded engine (the slow test
    below) and, in the six standard configurations, the lockstep machine (tests/test_lockstep.py's:
    the ci profile at 25 examples, with every page recycled and the snapshots and restores counted)."""
    standard = config in machine_configs()
    return [name for name in CHECKS if name not in ("races", "seeded") and not (standard and name == "lockstep")]


# The lockstep machine in the seven semantics configurations at 25 examples, as tests/test_lockstep.py
# runs the six standard ones: 818-1,225 steps each, 13 CPU s for the seven, not 26 at the hunt
# profile's 50 (which ``kvstate conform`` runs, and the slow test below).
ENGINE_BUDGET = default_suite_budget("hunt")


@pytest.mark.parametrize("config", configs_for(numpy_factory), ids=lambda config: config.name)
def test_engine_passes_what_conform_runs(config):
    """In the seven semantics configurations this is the lockstep machine's run of each declared semantics."""
    checks = _engine_checks(config)
    (result,) = conform(numpy_factory, settings=ENGINE_BUDGET, configs=[config], checks=checks)
    assert result.passed, result.failure
    if "lockstep" in checks:
        assert result.outcomes["lockstep"].steps >= 500
    assert len(configs_for(numpy_factory)) > len(machine_configs())


@pytest.mark.slow
@pytest.mark.parametrize("config", configs_for(numpy_factory), ids=lambda config: config.name)
def test_engine_passes_the_random_checks_at_the_hunt_budget(config):
    """The seeded engine, and the lockstep machine at the hunt profile's whole budget."""
    (result,) = conform(numpy_factory, profile="hunt", configs=[config], checks=["lockstep", "seeded"])
    assert result.passed, result.failure
