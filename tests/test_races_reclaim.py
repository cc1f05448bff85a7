"""Races in a pool that reclaims its own way (``on_full`` "reclaim" or "reclaim-fifo").

From an audit (s66, Finding 3): every race scenario was n/a under ``reclaim``, so a thread-safe
backend whose ``extend`` checked the pool's room under the lock and took the blocks after letting
it go passed ``kvstate conform`` (exit 0), though a threaded script broke its pool in 183 of 200
trials. A reclaiming pool is where that bug lives. Now such a backend is raced in every scenario
but the one whose verdict is which whole entry goes next (``hits_stamp_under_race``, n/a with its
reason); the tree is held only to what reclaiming promises (entries may be gone, a hit shorter)."""

from __future__ import annotations

import os
import threading

import pytest

from foreign.reclaiming import CONFIG as TOKEN_RECLAIM
from kvstate.stateful.backends import load_factory
from kvstate.stateful.races import scenarios as races
from kvstate.stateful.races.applicable import backend_scenarios

SEED = int(os.environ.get("KVSTATE_RACE_SEED", "20261129"))
POOL = "tests/foreign/fifo_pool.py"


def _raced(factory, config, seed: int = SEED) -> list[races.RaceReport]:
    """One iteration of each scenario ``factory`` is raced in under ``config``, at conform's options."""
    scenarios = backend_scenarios(factory, config)
    assert not isinstance(scenarios, str), scenarios
    return [races.SCENARIOS[name](store=factory, seed=seed, iterations=1, configs=[config], **options)
            for name, options in scenarios]


def test_a_reclaiming_pool_is_raced_and_a_correct_one_passes():
    factory = load_factory(f"{POOL}:factory")
    config = factory.configs[1]         # block4-f32-pool12-reclaim-fifo-prefixkv: short of blocks at once
    reports = {report.scenario: report for report in _raced(factory, config)}
    assert {"fork_storm", "close_races", "observe_during_writes", "fork_vs_owner_writes", "pressure_vs_match",
            "eviction_vs_allocation", "match_close_vs_clear"} <= set(reports)
    assert reports["hits_stamp_under_race"].skipped == {
        config.name: "on_full='reclaim-fifo': which entry goes is the engine's choice"}
    assert sum(report.counts.get("refusals", 0) for report in reports.values()) > 0     # the pool was short


class _OneLock:
    """``target`` with one lock held around each of its calls, and the contexts they return wrapped
    alike: a single-threaded engine made thread-safe the plainest way."""

    def __init__(self, target, lock) -> None:
        self._target, self._lock = target, lock

    def _wrapped(self, result):
        if isinstance(result, tuple) and result and hasattr(result[0], "fork"):       # match's (context, hit)
            return (_OneLock(result[0], self._lock), *result[1:])
        return _OneLock(result, self._lock) if hasattr(result, "fork") else result

    def __getattr__(self, name):
        with self._lock:
            found = getattr(self._target, name)
        if not callable(found):
            return found

        def call(*args, **kwargs):
            args = tuple(arg._target if isinstance(arg, _OneLock) else arg for arg in args)
            with self._lock:
                return self._wrapped(found(*args, **kwargs))
        return call

    def __len__(self) -> int:
        with self._lock:
            return len(self._target)


@pytest.mark.parametrize("on_full", ["reclaim", "reclaim-fifo"])
def test_a_tree_a_reclaiming_pool_cut_short_is_not_held_to_a_floor(on_full):
    """``test_reclaim``'s correct engine listing the keys it can still hit whole: its pool reclaims
    entries no bound would evict, which the tree's floor (``_check_bounds``) took for a lost entry."""
    from test_reclaim import ListsItsEntries

    made = []

    def factory(config):
        made.append(ListsItsEntries(config))
        return _OneLock(made[-1], threading.RLock())
    factory.configs, factory.any_page_size, factory.thread_safe = [TOKEN_RECLAIM], False, True
    config = TOKEN_RECLAIM.with_(on_full=on_full)
    for attempt in range(5):        # until a run's pool reclaimed entries' pages, where a floor is wrong
        races.eviction_vs_allocation(store=factory, seed=SEED + attempt, iterations=1, configs=[config])
        if made[-1].reclaimed:
            return
    pytest.fail("5 runs never reclaimed: the pool was never short")


@pytest.mark.parametrize("config", load_factory(POOL).configs, ids=lambda config: config.name)
def test_a_pool_letting_the_lock_go_between_its_check_and_the_allocation_is_caught(config):
    """Two threads pass the check for the last blocks, and the second finds the free queue empty
    (``KeyError``) or the pool past its limit: one round of the scenarios catches it in most runs."""
    plant = load_factory(f"{POOL}:check_then_act")
    for attempt in range(10):
        try:
            _raced(plant, config, SEED + attempt)
        except races.RaceFailure as caught:
            assert f"[check_then_act, {config.name}]" in str(caught)
            return
    pytest.fail("10 rounds missed a pool check let go before the allocation")
