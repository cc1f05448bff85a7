"""A backend is raced only in the configurations it declares, its entry bound included.

From an audit (s66, Finding 1): a correct backend with no entry bound, declaring ``max_entries``
2**30 as vLLM's and SGLang's adapters do, FAILed ``races``: ``hits_stamp_under_race`` set
``max_entries`` to 4 and demanded an eviction such a cache never makes (blaming a lock), and
``match_close_vs_clear`` set it to 8, so a factory refusing that bound with ``ConfigError`` FAILed
too. Now a scenario whose expectation needs a bound the declaration does not give is n/a there;
one that races usefully without it runs in the declared configuration."""

from __future__ import annotations

import os

import pytest

from kvstate.spec import Config
from kvstate.stateful.backends import load_factory
from kvstate.stateful.conform import conform
from kvstate.stateful.races import scenarios as races

SEED = int(os.environ.get("KVSTATE_RACE_SEED", "20261129"))
UNBOUNDED = "tests/foreign/no_entry_bound.py"
AUDIT3 = "tests/foreign/audit3_locks.py"


@pytest.mark.parametrize("name", ["factory", "strict_factory"])
def test_races_pass_a_backend_with_no_entry_bound(name):
    """``strict_factory`` raises ``ConfigError`` for any bound but 2**30: it is never handed one."""
    factory = load_factory(f"{UNBOUNDED}:{name}")
    results = conform(factory, configs=factory.configs[:1], checks=["races"])
    (outcome,) = [result.outcomes["races"] for result in results]
    assert outcome.status == "pass", outcome.detail
    assert outcome.detail == ("n/a hits_stamp_under_race: max_entries 1073741824: the scenario fills at most "
                              "64 entries (1-token keys), so its retain never evicts for the entry bound; "
                              "n/a stamps_vs_retains: max_entries 1073741824: the scenario fills at most 64 "
                              "entries of 1-token keys, so its retains never evict for the entry bound")


def test_a_race_in_a_backend_with_no_entry_bound_is_still_caught():
    """Its ``match`` takes the blocks' references without the lock: ``eviction_vs_allocation``,
    which needs no bound, catches it (in every run by hand)."""
    factory = load_factory(f"{UNBOUNDED}:match_unlocked")
    (result,) = conform(factory, configs=factory.configs[:1], checks=["races"])
    assert result.outcomes["races"].status == "FAIL"
    assert "[match_unlocked, block1-f32-heap-prefixkv]" in result.outcomes["races"].detail


def test_the_recency_scenario_races_a_declared_bound_past_its_threads_with_fillers():
    """A declared ``max_entries`` of 8 with 3 hitting threads: 4 more entries, hit one by one after Z,
    fill the tree; the correct engine passes, and a stamp taken after the lock is caught."""
    configs = [config.with_(max_entries=8) for config in load_factory(AUDIT3).configs[:2]]
    correct = load_factory(AUDIT3)
    report = races.hits_stamp_under_race(correct, seed=SEED, iterations=2, configs=configs, yields=True)
    assert report.counts["hits"] == 3 * 10 * 2 and not report.skipped
    stamp_late = load_factory("tests/foreign/audit3_locks_bugs.py:stamp_outside_lock")
    for attempt in range(10):
        try:
            races.hits_stamp_under_race(stamp_late, seed=SEED + attempt, iterations=2, configs=configs, yields=True)
        except races.RaceFailure as caught:
            assert "the 4 others hit one by one after it) least recently used, so with max_entries 8" in str(caught)
            return
    pytest.fail("10 runs missed a stamp taken after the lock")


def test_the_recency_scenario_is_not_applicable_where_the_declared_bound_leaves_one_hit():
    config = Config(races.RACE_LAYOUT, 3, max_entries=2)
    report = races.hits_stamp_under_race(load_factory(AUDIT3), seed=SEED, iterations=1, configs=[config])
    assert report.counts == {"skipped": 1}
    assert report.skipped == {config.name: "max_entries 2: fewer than two entries besides the newest, so no "
                                           "concurrent hits to race"}


def test_the_rerun_command_says_why_a_scenario_does_not_apply(capsys):
    from kvstate.cli import main

    assert main(["race", "hits_stamp_under_race", "--backend", UNBOUNDED, "--config", "block4-f16-heap-prefixkv",
                 "--seed", "0", "--iteration", "0"]) == 0
    assert capsys.readouterr().out == ("n/a: hits_stamp_under_race in block4-f16-heap-prefixkv: max_entries "
                                       "1073741824: the scenario fills at most 64 entries (4-token keys), so its "
                                       "retain never evicts for the entry bound\n")
