"""A hit that differs from the reference's is reported with the declared rule it is held to, and,
where the hit is no hit at all under that rule, with what is wrong with it.

A block-rounding bug used to be reported by ``prefix edges`` as "found while checking" the tie
rule, the scenario that happened to run first, with nothing in the report naming block rounding.
"""

from __future__ import annotations

import pytest

import kvstate.impl.cache as cache_module
import kvstate.impl.matching as matching
from kvstate.impl.numpy import factory
from kvstate.spec.semantics import hit_rule
from kvstate.stateful.configs import semantics_configs
from kvstate.stateful.conform import conform


def test_the_rule_says_what_no_hit_can_be():
    assert hit_rule("block", 4, 6, 9).endswith("6 is not a whole number of blocks")
    assert hit_rule("block", 4, 8, 9) == ('match="block" (blocks of 4): a hit is the longest common prefix with '
                                          'a retained key, rounded down to whole blocks')
    assert hit_rule("entry", 0, 3, 9, [2, 5]).endswith("the reference retains no key of 3 tokens that prefixes it")
    assert ";" not in hit_rule("entry", 0, 5, 9, [2, 5])
    assert ";" not in hit_rule("entry", 0, 0, 9, [2, 5])     # a miss is always a possible answer
    assert hit_rule("token", 0, 12, 9).endswith("12 positions for a query of 9 tokens: a hit is a prefix of the query")
    assert ";" not in hit_rule("token", 0, 9, 9)


def _failure(config) -> str:
    [result] = conform(factory, configs=[config], checks=["prefix edges"])
    assert not result.passed
    return str(result.outcomes["prefix edges"].detail)


def test_a_block_hit_not_rounded_down_names_block_rounding(monkeypatch):
    config = next(c for c in semantics_configs() if c.match == "block")
    monkeypatch.setattr(matching, "hit_length", lambda match, block, common: common)     # no rounding
    report = _failure(config)
    assert f'match="block" (blocks of {config.block_tokens})' in report
    assert "is not a whole number of blocks" in report


def test_a_hit_past_the_query_is_named(monkeypatch):
    config = next(c for c in semantics_configs() if c.match == "block")
    # Rounded up to the next whole block: whole blocks, but past the end of a query that is not.
    monkeypatch.setattr(matching, "hit_length", lambda match, block, common: -(-common // block) * block)
    report = _failure(config)
    assert "a hit is a prefix of the query" in report


def test_an_entry_hit_that_is_no_key_names_the_entry_rule(monkeypatch):
    config = next(c for c in semantics_configs() if c.match == "entry")
    # ``entry`` answering as ``token`` would: part of a key is a hit.
    monkeypatch.setattr(cache_module, "finder_for", lambda match, block: matching.finder_for("token", block))
    report = _failure(config)
    assert 'match="entry"' in report
    assert "the reference retains no key of" in report


@pytest.mark.parametrize("match", ["entry", "token", "block"])
def test_the_engine_passes_prefix_edges(match):
    """The checks above fail on the plant, not on the check: unplanted, each semantics passes."""
    config = next(c for c in semantics_configs() if c.match == match)
    [result] = conform(factory, configs=[config], checks=["prefix edges"])
    assert result.passed, result.outcomes
