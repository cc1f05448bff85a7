"""The race scenarios against a backend that exposes no tree tier and no counters, and whose contexts
have no ``closed`` attribute: none of them is in the protocol. From an audit: a correct thread-safe
backend without them was rejected by ``races`` three ways, each reported as the backend raising
(``KeyError: 'live_contexts'``, ``AttributeError: ... 'closed'``, ``TypeError`` iterating no entries)."""

from __future__ import annotations

import dataclasses

from kvstate.impl.cache import Cache
from kvstate.impl.numpy import factory as numpy_factory
from kvstate.spec.errors import ContextClosedError
from kvstate.stateful.conform import conform
from kvstate.stateful.configs import config_named
from kvstate.stateful.races.harness import is_closed


def test_races_pass_a_backend_without_the_tree_tier_or_counters(monkeypatch):
    real = Cache.observe
    monkeypatch.setattr(Cache, "observe", lambda cache: dataclasses.replace(real(cache), entries=None, tree=None,
                                                                             counters={}))
    results = conform(numpy_factory, configs=[config_named("f32-arena10-refuse")], checks=["races"])
    outcomes = [outcome for result in results for outcome in result.outcomes.values()]
    assert outcomes and all(outcome.status == "pass" for outcome in outcomes), [o.detail for o in outcomes]


class _Context:
    """A context with no ``closed`` attribute: a closed one refuses a read, as every use."""

    def __init__(self):
        self.open = True

    def read(self, start, stop):
        if not self.open:
            raise ContextClosedError("closed")
        return (), ()


def test_a_context_without_a_closed_attribute_is_judged_by_a_read():
    ctx = _Context()
    assert not is_closed(ctx)
    ctx.open = False
    assert is_closed(ctx)
