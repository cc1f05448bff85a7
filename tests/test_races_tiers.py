"""The race scenarios against a backend that exposes no tree tier and no counters, and whose contexts
have no ``closed`` attribute: none of them is in the protocol. From an audit: a correct thread-safe
backend without them was rejected by ``races`` three ways, each reported as the backend raising
(``KeyError: 'live_contexts'``, ``AttributeError: ... 'closed'``, ``TypeError`` iterating no entries)."""

from __future__ import annotations

import dataclasses

import pytest

from kvstate.impl.cache import Cache
from kvstate.impl.numpy import factory as numpy_factory
from kvstate.spec.errors import ContextClosedError, PositionError
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
    """A context with no ``closed`` attribute: once closed, a read is refused with ``refusal`` (a closed
    context's error, or a position error: README lets a closed context read as 0 positions long)."""

    def __init__(self, refusal: type[Exception]):
        self.open, self.refusal = True, refusal

    def read(self, start=0, stop=None):
        if not self.open:
            raise self.refusal("closed")
        return (), ()


@pytest.mark.parametrize("refusal", [ContextClosedError, PositionError])
def test_a_context_without_a_closed_attribute_is_judged_by_a_read(refusal):
    ctx = _Context(refusal)
    assert not is_closed(ctx)
    ctx.open = False
    assert is_closed(ctx)


def test_the_format_check_leaves_alone_a_body_this_installation_cannot_checksum(monkeypatch):
    """From a review: a backend writing version 2 (XXH3) with its own xxhash, checked where kvstate has
    none, was told its file is out of format."""
    import io

    from kvstate.spec import snapshot_format as fmt
    from kvstate.stateful import ops as O
    from kvstate.stateful.directed.snapshot_writes import _as_the_spec_reads_it
    from kvstate.stateful.lockstep import Lockstep

    run = Lockstep(numpy_factory, config_named("f32-heap"))
    handle = run.apply(O.Allocate())
    run.apply(O.Extend(handle, (1, 2, 3), seed=1))
    stream = io.BytesIO()
    run.live[handle][0].snapshot(stream)
    if fmt.parse_header(stream.getvalue()).version != 2:
        pytest.skip("this installation writes version 1 (no xxhash): no XXH3 body to leave alone")
    monkeypatch.setattr(fmt, "xxhash", None)
    monkeypatch.setattr(fmt, "LOADABLE_VERSIONS", (1, 3))
    _as_the_spec_reads_it(run, handle, stream.getvalue(), "c1.snapshot(a BytesIO)")     # no BrokenPromise
