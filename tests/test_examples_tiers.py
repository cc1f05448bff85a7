"""One example backend per observation tier passes conformance; what it does not expose is n/a.

``examples/blackbox_backend.py`` exposes nothing (``black_box()``), ``pages_tier_backend.py``
pages and refcounts only, ``token_pool_backend.py`` pages, arena books (of 0 slots: no
arena) and entries, and declares token matching over a fixed pool that refuses when full.
Each passes; each directed check that needs a tier the backend lacks, or an arena, is n/a,
saying which; and a bug that the remaining tiers can show is still caught.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import settings

from kvstate.cli import main
from kvstate.spec.invariants import tiers
from kvstate.stateful import ops as O
from kvstate.stateful.configs import configs_for, configs_named
from kvstate.stateful.conform import conform, load_factory
from kvstate.stateful.exhaustive import Scope, explore, semantics_scope
from kvstate.stateful.lockstep import Lockstep

from helpers import by_default_or_slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SMALL = settings(max_examples=25, stateful_step_count=15, derandomize=True, deadline=None, database=None)

# example -> (the tiers its observation has, the directed checks that are n/a and what their reason names)
TIERS = {
    "blackbox_backend": ([], {"fork allocates 0": "'pages' tier", "1 write copies 1": "'pages' tier",
                              "arena evidence": "'arena' tier"}),
    "pages_tier_backend": (["pages"], {"arena evidence": "'arena' tier"}),
    "token_pool_backend": (["pages", "arena", "tree"], {"arena evidence": "no arena in this configuration"}),
}
PAGE_CHECKS = ("fork allocates 0", "1 write copies 1", "arena evidence")


def _factory(name):
    return load_factory(str(EXAMPLES / f"{name}.py"))


# Configurations each example passes in the default suite: every semantics it declares and every
# precision among the three examples; the rest of each example's configurations (the same code at
# another precision or arena size, 8 of 14) are ``-m slow``.
DEFAULT_SUITE = {"blackbox_backend": ("f16-heap", "q8-arena6", "token-f32-heap", "block2-q8-heap"),
                 "pages_tier_backend": ("f32-heap",),
                 "token_pool_backend": ("token-q8-pool10-refuse",)}


def _example_configs():
    for name in sorted(TIERS):
        for config in configs_for(_factory(name)):
            yield by_default_or_slow(name, config, DEFAULT_SUITE)


def test_the_default_suite_names_only_declared_configurations():
    for name, chosen in DEFAULT_SUITE.items():
        assert set(chosen) <= {config.name for config in configs_for(_factory(name))}, name


@pytest.mark.parametrize("name,config", _example_configs())
def test_example_passes_with_the_tiers_it_lacks_reported_na(name, config):
    factory = _factory(name)
    exposed, missing = TIERS[name]
    assert tiers(factory(config).observe()) == exposed
    (result,) = conform(factory, settings=SMALL, configs=[config])
    assert result.config == config and result.passed, result.failure
    assert result.outcomes["lockstep"].steps > 100
    for check in PAGE_CHECKS:
        outcome = result.outcomes[check]
        if check in missing:
            assert outcome.status == "n/a" and missing[check] in outcome.detail, (check, outcome)
        else:
            assert outcome.status == "pass", (check, outcome)


def test_blackbox_example_is_checked_under_the_semantics_it_declares():
    names = [config.name for config in configs_for(_factory("blackbox_backend"))]
    assert "token-f32-heap" in names and "block2-q8-heap" in names and "f32-arena6" in names


def test_token_pool_example_declares_a_refusing_token_pool():
    configs = configs_for(_factory("token_pool_backend"))
    assert {(c.match, c.on_full, bool(c.pool_pages), c.arena_pages) for c in configs} == {("token", "refuse", True, 0)}


def test_token_pool_example_refuses_as_the_reference_does_and_changes_nothing():
    """The pool fills, the engine refuses with ``CapacityError`` exactly when the reference does,
    and a refusal changes nothing: the suite is not passing it for want of trying."""
    factory = _factory("token_pool_backend")
    config = configs_for(factory)[0]
    run = Lockstep(factory, config)
    run.apply(O.Allocate())
    positions = config.pool_pages * config.page_tokens
    run.apply(O.Extend("c1", tuple(i % 3 for i in range(positions - 1)), seed=1))   # the pool is full
    run.apply(O.Retain("c1"))
    before = run.engine.observe()
    run.apply(O.Extend("c1", (1,), seed=2))          # the partly filled last page is shared: a copy
    assert run.history[-1].endswith("# refused: CapacityError")
    assert run.engine.observe() == before
    run.check()
    c2 = run.apply(O.Match((0, 1, 2, 2)))            # a token hit ending inside page 0, which stays shared
    assert len(run.live[c2][0]) == 3
    run.apply(O.Extend(c2, (5,), seed=3))              # its copy does not fit either
    assert run.history[-1].endswith("# refused: CapacityError")
    run.check()
    run.apply(O.Close("c1"))
    run.apply(O.Clear())                               # the entry's pages go back to the pool
    run.apply(O.Extend(c2, (5,), seed=3))
    assert "refused" not in run.history[-1] and len(run.live[c2][0]) == 4
    run.check()
    run.finish()


def _variant(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(f"import sys\nsys.path.insert(0, {str(EXAMPLES)!r})\n{body}")
    return load_factory(str(path))


def test_a_token_pool_that_never_refuses_is_rejected(tmp_path):
    """The refusal is checked, not assumed: the same engine falling back instead fails lockstep."""
    factory = _variant(tmp_path, "never_refuses", """
from token_pool_backend import TokenPoolCache, factory as working

class Cache(TokenPoolCache):
    def make_room(self, needed):
        pass

def factory(config):
    return Cache(config)
factory.configs = working.configs[:1]
factory.any_page_size = True
""")
    (result,) = conform(factory, profile="hunt", checks=["lockstep"])     # the default's sequences
    assert not result.passed and "CapacityError" in result.outcomes["lockstep"].detail


def test_a_blackbox_backend_that_never_stamps_a_hit_is_rejected(tmp_path):
    """Even with nothing observed, the eviction order is checked as ``match`` sees it: a hit that
    does not mark its entry used evicts the wrong key later, and a match then misses. The random
    engines probe every entry through ``match`` after every step, so the lockstep machine catches
    it; the directed prefix edges build the sequence on purpose and quote the rule."""
    factory = _variant(tmp_path, "never_stamps", """
from blackbox_backend import BoxCache, factory as working

class Cache(BoxCache):
    def match(self, tokens):
        saved = list(self.entries)
        ctx, matched = super().match(tokens)
        for key in saved:                      # undo the stamp: the order stays as retained
            self.entries.move_to_end(key)
        return ctx, matched

def factory(config):
    return Cache(config)
factory.semantics = working.semantics
""")
    (edges,) = conform(factory, configs=configs_for(factory)[:1], checks=["prefix edges"], settings=SMALL)
    assert not edges.passed and "least recently used" in edges.failure, edges.failure
    random = conform(factory, configs=configs_named(["block2-q8-heap", "q8-arena6"], configs_for(factory)),
                     checks=["lockstep", "seeded"], first_failure=True)
    assert not random[-1].passed and "through match" in random[-1].failure, [r.failure for r in random]


def test_conform_command_prints_na_for_the_missing_tiers(capsys):
    rc = main(["conform", str(EXAMPLES / "blackbox_backend.py"), "--config", "token-f32-heap",
               "--examples", "10", "--steps", "8"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0
    header = re.split(r"\s{2,}", next(line for line in lines if line.startswith("configuration")))
    row = re.split(r"\s{2,}", next(line for line in lines if line.startswith("token-f32-heap")))
    status = dict(zip(header, row))
    assert status["lockstep"] == status["seeded"] == status["prefix edges"] == "pass"
    assert status["fork allocates 0"] == status["1 write copies 1"] == status["arena evidence"] == "n/a"


@pytest.mark.parametrize("name,semantics", [("blackbox_backend", "token"), ("token_pool_backend", "refuse")])
def test_the_exhaustive_search_runs_on_fewer_tiers(name, semantics):
    """The small-scope search builds its canonical state from whatever tiers a backend exposes
    (none, for the black box) and the reference's state."""
    result = explore(_factory(name), semantics_scope(semantics, Scope(max_depth=4)))
    assert result.passed, str(result.violation)
    assert result.depth == 4 and result.states > 100


def test_a_backend_that_frees_at_close_and_checks_positions_first_passes():
    """From an audit: ``len()`` of a closed context is free (a backend freeing everything says 0) and any
    applicable error is right: ``overwrite(0, ...)`` on a closed context raising ``PositionError`` was
    rejected by ``pinned semantics``. Positions of a closed context are judged against length 0 too."""
    import sys

    from kvstate.spec.errors import PositionError
    from kvstate.stateful.conform import conform, load_factory

    box = sys.modules[load_factory(str(EXAMPLES / "blackbox_backend.py")).__module__]

    class FreeOnClose(box.BoxContext):
        def close(self):
            super().close()
            self.values, self.token_list = self.values[:0].copy(), []      # storage freed: len() is 0

        def overwrite(self, start, tokens, kv):
            if not box._is_int(start) or start < 0 or start + len(tokens) > len(self):   # positions first
                raise PositionError(f"overwrite at {start!r} is outside length {len(self)}")
            super().overwrite(start, tokens, kv)

    class Cache(box.BoxCache):
        def adopt(self, values, tokens):
            ctx = FreeOnClose(self, values, tokens)
            self.contexts.append(ctx)
            return ctx

    factory = lambda config: Cache(config)      # noqa: E731
    from kvstate.stateful.configs import config_named

    (result,) = conform(factory, settings=SMALL, configs=[config_named("f32-heap")],
                        checks=["pinned semantics", "bad input"])
    assert result.passed, result.failure
