"""An audit's black-box engine (``tests/foreign/lru_leaf_pool.py``: a fixed pool, token matching, LRU
leaf eviction under ``reclaim``) and the plant conform let through (session 67, audit 2).

A hit shorter than its entry's key that did not stamp the entry passed every check and 300 sweep seeds
under ``reclaim``: the one row that sees a stamp in a black box, ``pinned semantics``' "hits stamp their
entry", skipped every reclaiming configuration, though the eviction it provokes is the entry bound's."""

from __future__ import annotations

import pytest

from kvstate.stateful.conform import conform

from foreign import lru_leaf_pool

CONFIGS = {config.on_full: config for config in lru_leaf_pool.factory.configs}


@pytest.mark.parametrize("on_full", sorted(CONFIGS))
def test_a_short_hit_that_stamps_nothing_is_caught_under_every_pool_policy(on_full, monkeypatch):
    config = CONFIGS[on_full]
    right = conform(lru_leaf_pool.factory, configs=[config], checks=["pinned semantics"])[0]
    assert right.passed, right.failure
    monkeypatch.setattr(lru_leaf_pool, "BUG", "stale_stamp_short_hit")
    wrong = conform(lru_leaf_pool.factory, configs=[config], checks=["pinned semantics"])[0]
    assert not wrong.passed and "A hit stamps the entry it is taken from" in str(wrong.failure), wrong.failure


def test_the_audits_engine_passes_the_quick_checks_in_every_configuration_it_declares():
    for result in conform(lru_leaf_pool.factory, checks=["fork isolation", "prefix edges", "boundaries",
                                                         "pinned semantics", "bad input"]):
        assert result.passed, (result.config.name, result.failure)


def test_a_pool_off_by_one_found_at_teardown_names_the_pool_not_the_row(monkeypatch):
    """The teardown's fill of an emptied pool refused (a limit off by one) and was reported as breaking
    "a miss" (audit 2, F2): the row's promise wrapped its ``run.finish()``."""
    from kvstate.stateful.lockstep import WHOLE_POOL_FITS

    monkeypatch.setattr(lru_leaf_pool, "BUG", "pool_edge_off_by_one")
    wrong = conform(lru_leaf_pool.factory, configs=[CONFIGS["refuse"]], checks=["pinned semantics"])[0]
    detail = str(wrong.outcomes["pinned semantics"].detail)
    assert not wrong.passed and WHOLE_POOL_FITS in detail and "`match` of tokens no entry shares" not in detail
