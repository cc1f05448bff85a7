"""``races`` against a fine-grained-locking backend (audit s67/audit3: ``tests/foreign/finelock.py``,
its plants in ``finelock_plants.py``).

Two plants passed ``races`` before the scenarios added for them, each a window with no call and
no loop inside it, atomic under the GIL (CPython switches threads only at calls and backward
jumps, and ``yields`` yields only at calls), so no scenario's thread ever ran inside it:

- ``half_cow``: lock-free reads, and a copy-on-write that publishes the private copy before NumPy
  slice copies fill it. ``reads_during_copy_on_write`` pauses an owner overwriting a forked
  context whole at random lines and reads the context in each pause.
- ``late_stamp``: a match stamping recency outside the tree lock with ``tick = clock + 1`` then
  ``clock = tick``. ``stamps_vs_retains`` pauses a hit at each of its lines in turn while retains
  move the clock on, then judges the eviction order sequentially (hit one entry, retain
  ``max_entries - 1`` fresh keys: the hit entry and the fresh keys alone stay).

The correct engine and its try-lock variant pass. Catch rates measured by hand over ``kvstate
conform`` are in the commit that added these.
"""

from __future__ import annotations

import re

import pytest

from foreign import finelock, finelock_plants, finelock_trylock
from kvstate.stateful.conform import conform
from kvstate.stateful.races import scenarios as races

SEEDS = 3       # conform runs of a plant, at most: each is expected to fail in its first configuration


@pytest.mark.parametrize("factory, configs", [(finelock.factory, finelock.factory.configs),
                                              (finelock_trylock.factory, finelock_trylock.factory.configs[:1])],
                         ids=["finelock", "trylock"])     # the variant in its first configuration: 5 s less
def test_a_correct_fine_grained_locking_backend_passes_races(factory, configs):
    results = conform(factory, configs=list(configs), checks=["races"])
    assert len(results) == len(configs)
    for result in results:
        outcome = result.outcomes["races"]
        assert outcome.status == "pass", (result.config.name, outcome.detail)


def _fails_races(factory) -> str:
    """The detail of ``races`` failing in ``factory``'s first configuration that fails."""
    for _ in range(SEEDS):
        results = conform(factory, checks=["races"], first_failure=True)
        outcome = results[-1].outcomes["races"]
        if outcome.status == "FAIL":
            return outcome.detail
    pytest.fail(f"{SEEDS} conform runs of {factory.__name__} passed races")


def test_a_copy_on_write_published_before_it_is_filled_fails_races():
    """Caught by the scenario written for it, or (a schedule's luck, seen under load) by a fork racing the
    owner's writes first, which names the same bug: a page copied half-written."""
    detail = _fails_races(finelock_plants.half_cow)
    read = re.search(r"reads_during_copy_on_write\[half_cow, \S+\] seed=\d+ iteration=\d+, thread 1: "
                     r"InvariantViolation: invariant 4: a read racing a copy-on-write of its pages position \d+", detail)
    fork = re.search(r"fork_vs_owner_writes\[half_cow, \S+\] seed=\d+ iteration=\d+: branch .* so the fork saw the "
                     r"parent mid-write \(a length raised before its bytes landed, or a page copied half-written\)", detail)
    assert read or fork, detail
    scenario = "reads_during_copy_on_write" if read else "fork_vs_owner_writes"
    assert f"kvstate race {scenario} --backend" in detail


def test_a_match_stamping_with_an_unlocked_clock_fails_races():
    detail = _fails_races(finelock_plants.late_stamp)
    assert re.search(r"stamps_vs_retains\[late_stamp, \S+\] seed=\d+ iteration=\d+ round \d+: after hits racing "
                     r"retains, then, the threads done, a hit of \[\d+\] and retains of 3 fresh keys .*: "
                     r"\[.+\] stayed and \[.+\] went", detail), detail
    assert "kvstate race stamps_vs_retains --backend" in detail


@pytest.mark.parametrize("name", ["reads_during_copy_on_write", "stamps_vs_retains"])
def test_the_new_scenarios_pass_the_correct_engine_in_every_configuration_with_yields(name):
    for yields in (False, True):
        report = races.SCENARIOS[name](finelock.factory, seed=1, iterations=3, configs=finelock.factory.configs,
                                       yields=yields)
        assert report.iterations == 3 and not report.skipped


def test_the_recency_scenario_is_not_applicable_where_its_bound_does_not_fit():
    config = finelock.factory.configs[0]
    unbounded = races.stamps_vs_retains(finelock.factory, iterations=1, configs=[config.with_(max_entries=2**30)])
    assert unbounded.skipped == {config.name: "max_entries 1073741824: the scenario fills at most 64 entries of "
                                              "1-token keys, so its retains never evict for the entry bound"}
    reclaiming = config.with_(on_full="reclaim", pool_pages=12, values="prefix")
    assert races.stamps_vs_retains("numpy", iterations=1, configs=[reclaiming]).skipped == {
        reclaiming.name: "on_full='reclaim': which entry goes is the engine's choice"}


def test_a_factory_built_by_a_helper_is_labelled_as_it_was_loaded():
    """From the third audit (F3): where a file's plants are made by one helper (as ``audit_bugs.py``'s),
    each race headline read ``fork_storm[_make.<locals>.factory, f32-heap]``, whichever plant failed."""
    from pathlib import Path

    from kvstate.stateful.backends import load_factory
    from kvstate.stateful.races.harness import store_label

    from foreign import audit_bugs

    path = Path(audit_bugs.__file__).resolve()
    assert audit_bugs.cow_ignores_entries.__qualname__ == "_make.<locals>.factory"      # what the label was
    loaded = load_factory(f"{path}:cow_ignores_entries")
    assert store_label(loaded) == "audit_bugs.py:cow_ignores_entries"
    assert store_label(load_factory(f"{path}:evict_newest_for_room")) == "audit_bugs.py:evict_newest_for_room"
    assert store_label(finelock_plants.split_refcount) == "split_refcount"     # a plain function: its name
    assert store_label("numpy") == "numpy"
