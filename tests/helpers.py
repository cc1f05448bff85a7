"""Small shared builders for the directed tests, and the control every conform catch carries."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings as Settings

from kvstate import Cache, Layout
from kvstate.reference import RefCache
from kvstate.spec import invariants
from kvstate.spec.protocol import Config
from kvstate.stateful.configs import PROFILES
from kvstate.stateful.conform import conform
from kvstate.stateful.ops import values_for

LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)


class ObservedAs:
    """kvstate's NumPy engine, observed otherwise: ``observe()`` returns ``seen(its own observation)``,
    so a test makes a backend that exposes fewer tiers (a black box, one without the tree tier) or
    reports its books otherwise. ``observed_as(seen)`` makes such a factory; subclass it for more."""

    def __init__(self, config: Config):
        from kvstate.impl.numpy import factory

        self.cache = factory(config)

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def seen(self, obs):
        return obs

    def observe(self):
        return self.seen(self.cache.observe())


def observed_as(seen) -> type:
    """A factory (a class taking a ``Config``) of ``ObservedAs`` whose observation is ``seen(obs)``."""
    return type("ObservedAs", (ObservedAs,), {"seen": lambda self, obs: seen(obs)})


class StoreWithout:
    """A page store written to the protocol before some of it existed: ``inner`` with the methods
    named in ``missing`` hidden, so the engine's fallback for them is what runs."""

    def __init__(self, inner, *missing: str):
        self._inner, self._missing = inner, missing

    def __getattr__(self, name):
        if name in self._missing:
            raise AttributeError(name)
        return getattr(self._inner, name)


def make_cache(page_tokens=4, precision="f32", arena_pages=0, max_entries=4, **kw) -> Cache:
    return Cache(LAYOUT, page_tokens=page_tokens, precision=precision, arena_pages=arena_pages,
                 max_entries=max_entries, **kw)


def make_reference(page_tokens=4, precision="f32", arena_pages=0, max_entries=4) -> RefCache:
    return RefCache(Config(LAYOUT, page_tokens, precision, arena_pages, max_entries))


def kv(n: int, seed: int = 0) -> np.ndarray:
    return values_for(LAYOUT, n, seed)


def filled(cache, n: int, seed: int = 0, first_token: int = 0):
    ctx = cache.allocate()
    ctx.extend([(first_token + i) % 1000 for i in range(n)], kv(n, seed))
    return ctx


def assert_empty_after_closing(cache, contexts) -> None:
    for ctx in contexts:
        if not ctx.closed:
            ctx.close()
    cache.clear()
    invariants.check_empty(cache.observe())


def default_suite_budget(profile: str) -> Settings:
    """``profile`` at 25 examples: what the default suite runs a whole lockstep machine at, where
    ``kvstate conform`` runs 50 (Hypothesis plans a smaller budget's runs differently, so they are
    not the first 25 of the 50); the whole budget runs under ``-m slow``."""
    return Settings(PROFILES[profile], max_examples=25)


def by_default_or_slow(name: str, config: Config, default: dict[str, tuple[str, ...]]):
    """``(name, config)`` as a test parameter, in the default suite if ``default[name]`` lists the
    configuration, else ``-m slow``: for tests that run a whole backend per configuration."""
    slow = config.name not in default[name]
    return pytest.param(name, config, id=f"{name}-{config.name}", marks=[pytest.mark.slow] if slow else [])


def assert_the_catch_is_the_bugs(results, clean_factory, profile: str) -> None:
    """The control for a ``conform(..., first_failure=True)`` catch: its one failing check failed
    (not timed out), and passes the same configuration on ``clean_factory``, the same backend
    without the bug; so the catch is the bug's, not the check's."""
    (caught,) = [result for result in results if not result.passed]
    (check,) = [name for name, outcome in caught.outcomes.items() if not outcome.passed]
    assert caught.outcomes[check].status == "FAIL", caught.failure
    (clean,) = conform(clean_factory, profile=profile, configs=[caught.config], checks=[check])
    assert clean.passed, clean.failure


def conform_report(factory, config: Config, check: str) -> str:
    """conform's report of ``check`` failing ``factory`` in ``config``; the check must fail."""
    (result,) = conform(factory, configs=[config], checks=[check])
    detail = result.outcomes[check].detail
    assert detail is not None, f"{check} passed the plant"
    return detail


def printed_steps(detail: str) -> list[str]:
    """The operations a report prints after its header, its footnote on unobserved steps left out."""
    lines = detail.split("the failure shows right after the last):", 1)[1].splitlines()[1:]
    return [line for line in lines if not line.startswith("  (")]
