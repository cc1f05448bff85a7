"""Bugs that once only a directed check caught, each caught by a random engine alone.

``tests/catch_points.py`` measures every bug against every check; these are the cheap witnesses
that the random engines keep biting where they used to miss: a read that aliases storage and a
zero-length write that allocates (``Lockstep``'s own checks), two hits of one entry writing past its
key, nested keys, and the snapshot of an overwritten hit (queries from entries' keys, a context
retained before a query, a hit's prefill, writes and snapshots steered to hits, checkpoints
restored at once), and f16 overflow accepted (one write seed in 256 carries a value past f16's
range). Each is caught within the first runs or seeds, and the same runs pass without the bug (on
our engine unplanted, or on the zoo bug's correct base backend).
"""

import contextlib

import pytest
from hypothesis import settings

from kvstate.impl.numpy import factory as numpy_factory
from kvstate.stateful.configs import PROFILES, config_named, seeded_size
from kvstate.stateful.conform import conform
from kvstate.stateful.planted import PLANTED
from kvstate.stateful.seeded import first_seed, run_seeds

import test_bug_zoo as zoo
from foreign.bugs import BUGS

# (engine, where the bug is from, bug, the runs or seeds it may take: a few past where it is caught
# today, in the zoo bug's one configuration or, for ours, q8-heap: a standard configuration whose
# derandomized runs reach each early)
CASES = [
    ("lockstep", "zoo", "read_aliases_storage", 10),
    ("seeded", "zoo", "zero_length_write_allocates", 4),
    ("seeded", "zoo", "snapshot_stale_tokens", 4),
    ("lockstep", "planted", "hits_append_in_place", 12),
    ("lockstep", "planted", "match_shortest_key", 12),
    ("lockstep", "planted", "snapshot_of_hit_stale_tokens", 12),
    ("seeded", "planted", "split_node_evicted", 4),
    ("seeded", "zoo", "f16_overflow_accepted", 4),
    ("lockstep", "zoo", "f16_overflow_accepted", 12),
]


def _subject(kind: str, bug: str):
    """(factory with the bug, the same backend without it, configuration, planting context manager)."""
    if kind == "planted":
        return numpy_factory, numpy_factory, config_named("q8-heap"), PLANTED[bug]
    factory = BUGS[bug]
    return factory, zoo.FOREIGN[zoo.ZOO[bug].base], zoo._config(zoo.ZOO[bug].config, factory), contextlib.nullcontext


def _failure(engine: str, factory, config, budget: int) -> str | None:
    """What the engine's first ``budget`` runs (or seeds) found in ``config``, unshrunk; None if they passed."""
    if engine == "seeded":
        _, steps = seeded_size(PROFILES["ci"])
        found = run_seeds(factory, config, budget, steps, budget_s=float("inf"), shrink_budget_s=0.0,
                          first=first_seed(config)).failure
        return None if found is None else str(found)
    hunt = settings(PROFILES["hunt"], max_examples=budget)
    (result,) = conform(factory, settings=hunt, configs=[config], checks=["lockstep"])
    return result.failure


@pytest.mark.parametrize("engine,kind,bug,budget", CASES, ids=[f"{e}-{k}-{b}" for e, k, b, _ in CASES])
def test_a_random_engine_alone_catches_it(engine, kind, bug, budget):
    buggy, clean, config, plant = _subject(kind, bug)
    with plant():
        assert _failure(engine, buggy, config, budget) is not None, \
            f"{bug}: {engine} passed its first {budget} runs of {config.name}"
    control = _failure(engine, clean, config, budget)      # the same runs without the bug
    assert control is None, control
