"""Conform's verdict both ways: a correct backend built differently from ours is never rejected.

- A backend that validates its inputs in another order (the context first, token ids last) passes
  the default profile: when several inputs are wrong, any error that applies is right.
- A backend that takes only the page size its configurations declare (a block is a page, as in
  vLLM) passes the default profile: a factory listing ``configs`` is run at exactly those sizes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstate.spec.errors import ConfigError, ContextClosedError, PositionError
from kvstate.spec.layout import check_tokens, check_values, require_finite
from kvstate.spec import precision as precisions
from kvstate.stateful.configs import page_sizes
from kvstate.stateful.conform import conform, load_factory

from helpers import default_suite_budget

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
listcache_factory = load_factory(str(EXAMPLES / "listcache.py"))
listcache = sys.modules[listcache_factory.__module__]


class ContextFirst(listcache.ListContext):
    """Validates in the reverse of the reference's order: the context, positions, the values,
    the array's shape, the token ids last."""

    def _encode(self, tokens, kv, start=None):
        self._open()
        count = len(tokens)
        if start is not None and not (isinstance(start, int) and 0 <= start and start + count <= self.length):
            raise PositionError(f"overwrite of [{start}, {start + count}) outside length {self.length}")
        if isinstance(kv, np.ndarray) and kv.dtype.kind == "f":
            require_finite(kv)
        kv = check_values(self.cache.layout, kv, count)
        tokens = check_tokens(tokens)
        return tokens, precisions.roundtrip(self.cache.precision, kv)


class ContextFirstCache(listcache.ListCache):
    context_class = ContextFirst


def context_first(config):
    return ContextFirstCache(config)


context_first.configs = listcache_factory.configs[:1]
context_first.any_page_size = True


class FourTokenPages(listcache.ListCache):
    """Refuses every page size but the one it declares, as an engine whose block is its page."""

    def __init__(self, config):
        if config.page_tokens != 4:
            raise ConfigError(f"this engine's pages hold 4 tokens, not {config.page_tokens}")
        super().__init__(config)


def four_token_pages(config):
    return FourTokenPages(config)


four_token_pages.configs = listcache_factory.configs[1:2]


@pytest.mark.parametrize("factory", [context_first, four_token_pages], ids=lambda f: f.__name__)
def test_a_correct_backend_built_otherwise_passes_the_default_profile(factory):
    """At the default suite's budget (25 examples); the profile's whole budget is the slow test below."""
    (result,) = conform(factory, settings=default_suite_budget("ci"))
    assert result.passed, result.failure
    assert result.outcomes["lockstep"].steps > 500 and result.outcomes["seeded"].steps > 1000


@pytest.mark.slow
@pytest.mark.parametrize("factory", [context_first, four_token_pages], ids=lambda f: f.__name__)
def test_a_correct_backend_built_otherwise_passes_the_whole_default_profile(factory):
    (result,) = conform(factory, profile="ci")
    assert result.passed, result.failure
    assert result.outcomes["lockstep"].steps > 1000 and result.outcomes["seeded"].steps > 1000


def test_the_other_order_is_really_another_order():
    """The control: with a closed context and a wrong array, the variant names the context where
    the reference names the array, so the pass above is the rule at work, not a coincidence."""
    config = context_first.configs[0]
    ctx = context_first(config).allocate()
    ctx.close()
    two_rows = np.zeros(config.layout.batch_shape(2), np.float32)
    with pytest.raises(listcache.ContextClosedError):
        ctx.extend([1], two_rows)
    from kvstate.reference import RefCache
    from kvstate.spec.errors import ShapeError, applicable_errors

    ref = RefCache(config).allocate()
    ref.close()
    with pytest.raises(ShapeError) as refused:
        ref.extend([1], two_rows)
    assert set(applicable_errors(refused.value)) == {ShapeError, listcache.ContextClosedError}


def test_page_sizes_are_the_declared_ones_unless_any_is_declared():
    assert page_sizes(four_token_pages, four_token_pages.configs[0]) == (4,)
    assert page_sizes(context_first, context_first.configs[0]) == tuple(range(1, 9))
    with pytest.raises(ConfigError):
        four_token_pages(four_token_pages.configs[0].with_(page_tokens=2))


class StoresWrongValues(listcache.ListContext):
    """Stores every write that reaches position 3 one off: the next check's read shows it."""

    def _store(self, start, tokens, values):
        if start + len(tokens) > 3:
            SlowBrokenCache.bug_written = True      # the bug happened: from now on, caches are slow
            values = values + 1
        super()._store(start, tokens, values)


class SlowBrokenCache(listcache.ListCache):
    """Fast until the bug first writes; from then on each new cache takes 0.3 s. The machine
    finds the bug in the run where it first writes (a bug that stays hidden for some runs would
    make those runs slow, and the limit would come before anything was found), and shrinking,
    which builds a cache for every sequence it tries, gets a handful of tries before the limit:
    too few to reach the minimal sequence, however fast Hypothesis shrinks (6.170 once finished a
    shrink in time under a slowdown that grew by 2 ms a cache)."""

    context_class = StoresWrongValues
    bug_written = False

    def __init__(self, config):
        if SlowBrokenCache.bug_written:
            time.sleep(0.3)
        super().__init__(config)


def slow_broken(config):
    return SlowBrokenCache(config)


slow_broken.configs = listcache_factory.configs[:1]
slow_broken.any_page_size = True


def test_a_failure_still_shrinking_at_the_limit_is_a_failure_not_a_timeout():
    """A backend that is slow but answers: when the time limit comes while the failure it found is
    being shrunk, the report is that failure with the shortest sequence found so far."""
    SlowBrokenCache.bug_written = False
    (result,) = conform(slow_broken, checks=["lockstep"], time_limit=3)
    outcome = result.outcomes["lockstep"]
    assert outcome.status == "FAIL", outcome
    assert "shrinking it ran out of the 3 s limit" in outcome.detail and "invariant 4" in outcome.detail


class SlowAfter:
    """The numpy backend, whose caches take ``seconds`` each to build after its first ``fast`` ones
    (a real engine on a loaded machine): a check finds a planted bug fast, then each shrink try is slow."""

    def __init__(self, fast: int, seconds: float):
        from kvstate.impl.numpy import factory
        from kvstate.stateful.configs import config_named

        self.base, self.fast, self.seconds, self.made = factory, fast, seconds, 0
        self.configs = [config_named("f32-heap")]

    def __call__(self, config):
        self.made += 1
        if self.made > self.fast:
            time.sleep(self.seconds)
        return self.base(config)

    def stopped_building(self) -> bool:
        """Whether no cache is built over a second after an in-flight one (a shrink try) could finish."""
        time.sleep(0.5)
        made = self.made
        time.sleep(0.8)
        return self.made == made


@pytest.mark.parametrize("check, bug, fast, found", [
    ("seeded", "missing_copy_on_write", 3, "invariant 4"),
    # the check's own run builds one cache, the replay that confirms it a second; every shrink try is slow
    ("prefix edges", "match_shortest_key", 2, "invariant 5"),
])
def test_a_seeded_or_directed_failure_still_shrinking_at_the_limit_is_a_failure_and_stops(check, bug, fast, found):
    """From a review: only lockstep reported a failure still being shrunk at the limit as one; seeded and
    the directed checks read as TIMEOUT ("the backend hangs"), the counterexample lost, and their shrink
    went on building caches in the background. Now the report is the failure with the shortest sequence
    found so far, and the shrink stops."""
    from kvstate.stateful.planted import PLANTED

    factory = SlowAfter(fast, 0.3)
    with PLANTED[bug]():
        (result,) = conform(factory, checks=[check], time_limit=2)
        stopped = factory.stopped_building()
    outcome = result.outcomes[check]
    assert outcome.status == "FAIL", outcome
    assert "shrinking it ran out of the 2 s limit" in outcome.detail and found in outcome.detail, outcome.detail
    assert "(found, then still being shrunk)" in outcome.detail, outcome.detail
    assert "failing sequence found so far, not minimal (" in outcome.detail, outcome.detail
    assert stopped, "the abandoned check still shrinks"


@pytest.mark.parametrize("check, bug", [("lockstep", "missing_copy_on_write"),
                                        ("prefix edges", "match_shortest_key")])
def test_a_shrink_stopped_short_is_not_called_minimal(check, bug, monkeypatch):
    """From a review: lockstep and the directed checks called a sequence "minimised" whatever stopped
    the shrink; at no shrink budget it stops at once, and the report says it may not be minimal."""
    from kvstate.stateful import conform as conform_module
    from kvstate.stateful.planted import PLANTED

    monkeypatch.setattr(conform_module, "SHRINK_BUDGET_S", 0.0)
    with PLANTED[bug]():
        (result,) = conform(SlowAfter(10 ** 6, 0.0), checks=[check])
    detail = result.outcomes[check].detail
    assert "minimised failing sequence (shrinking stopped at its time budget, so it may not be minimal) (" in detail, \
        detail


# -- built otherwise, found by an audit: another memory order, errors of its own ------------------

class FortranOrderRead(listcache.ListContext):
    """``read`` returns a private float32 copy in Fortran order (as a torch ``.clone()`` of a permuted
    tensor is), its tokens as int32: the values are the promise, not a memory order."""

    def read(self, start=0, stop=None):
        values, tokens = super().read(start, stop)
        return np.asfortranarray(values), np.asarray(tokens, np.int32)


class FortranOrderCache(listcache.ListCache):
    context_class = FortranOrderRead


class OwnPositionError(PositionError):
    """A backend's own, more specific error: a caller's ``except PositionError`` catches it."""


class OwnClosedError(ContextClosedError):
    pass


class OwnErrors(listcache.ListContext):
    """Raises its own subclasses of the spec's position and closed-context errors."""

    def _open(self):
        try:
            super()._open()
        except ContextClosedError as error:
            raise OwnClosedError(str(error)) from None

    def read(self, start=0, stop=None):
        try:
            return super().read(start, stop)
        except PositionError as error:
            raise OwnPositionError(str(error)) from None

    def truncate(self, n):
        try:
            return super().truncate(n)
        except PositionError as error:
            raise OwnPositionError(str(error)) from None


class OwnErrorsCache(listcache.ListCache):
    context_class = OwnErrors


def _like_listcache(cache_class):
    def factory(config):
        return cache_class(config)
    factory.configs, factory.any_page_size = listcache_factory.configs, True
    return factory


@pytest.mark.parametrize("cache_class,checks", [
    (FortranOrderCache, ["no aliasing", "boundaries"]),
    (OwnErrorsCache, ["boundaries", "pinned semantics", "bad input"]),
], ids=["fortran-order-read", "own-error-subclasses"])
def test_a_correct_backend_built_otherwise_passes_the_checks_it_once_failed(cache_class, checks):
    from kvstate.stateful.directed.checks import DIRECTED
    factory = _like_listcache(cache_class)
    for config in factory.configs:
        for check in checks:
            DIRECTED[check](factory, config)


def test_an_own_subclass_is_judged_as_the_spec_class_it_derives_from():
    from kvstate.stateful.lockstep import same_refusal
    from kvstate.spec.errors import TokenError, spec_class
    assert spec_class(OwnPositionError("x")) is PositionError and spec_class(PositionError("x")) is PositionError
    assert same_refusal(OwnPositionError("x"), PositionError("y"))
    assert not same_refusal(OwnPositionError("x"), TokenError("y"))       # still the wrong class
    assert not same_refusal(ValueError("x"), PositionError("y"))
