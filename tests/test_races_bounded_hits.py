"""The races' bound on hits for a backend without the tree tier (``scenarios._finish_tree``).

Without ``observe().entries`` the scenarios cannot see which entries stayed, so after the threads
each retained key is matched and its hit held to what its ``match`` kind allows: under ``block``,
at most the key's whole blocks. The threads' own queries end in two tokens nobody retained, so no
query during the race is a whole key; this end-of-race match is the only place a hit of a whole key
is judged. The planted engine below answers every match in whole blocks except one that covers its
whole query, which it returns whole, its partly filled last block included, with the right values:
only the bound can tell.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvstate.impl.numpy import factory as numpy_factory
from kvstate.spec.protocol import Config
from kvstate.stateful.races.harness import RACE_LAYOUT, RACE_PAGE_TOKENS, RaceFailure
from kvstate.stateful.races.scenarios import eviction_vs_allocation

BLOCK = Config(RACE_LAYOUT, RACE_PAGE_TOKENS, precision="f32", match="block", block_tokens=2, max_entries=3)


class BlockByTokens:
    """``block`` matching made of kvstate's token-matching cache: the token hit cut to whole blocks
    (the longest common prefix in whole blocks is a block hit). No tree tier. ``whole_key_hits``:
    the planted bug, a hit covering the whole query is not cut."""

    thread_safe = True

    def __init__(self, config: Config, whole_key_hits: bool):
        self.cache = numpy_factory(config.with_(match="token", block_tokens=0))
        self.block_tokens, self.whole_key_hits = config.block_tokens, whole_key_hits

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def observe(self):
        return dataclasses.replace(self.cache.observe(), entries=None, tree=None)

    def match(self, tokens):
        ctx, matched = self.cache.match(tokens)
        if self.whole_key_hits and matched == len(tokens):
            return ctx, matched
        whole = matched - matched % self.block_tokens
        if whole < matched:
            ctx.truncate(whole)
        return ctx, whole


def _factory(whole_key_hits: bool):
    def factory(config):
        return BlockByTokens(config, whole_key_hits)
    factory.thread_safe = True
    return factory


def _race(whole_key_hits: bool):
    return eviction_vs_allocation(store=_factory(whole_key_hits), seed=0, iterations=1, threads=4, steps=20,
                                  configs=[BLOCK])


def test_block_hits_cut_to_whole_blocks_pass():
    report = _race(whole_key_hits=False)
    assert report.iterations == 1 and report.counts.get("match_hits", 0) > 0, report


def test_a_whole_key_hit_past_its_last_whole_block_is_caught():
    with pytest.raises(RaceFailure, match=r"matched \d+ tokens, where a block match holds at most \d+ "
                                          r"in whole blocks of 2"):
        _race(whole_key_hits=True)
