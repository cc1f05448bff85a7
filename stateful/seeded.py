"""Conformance's second engine: seeded sequences from ``generate.py``, shrunk by delta debugging.

The Hypothesis machine explores short sequences well; long fixed-seed runs build
what short ones rarely do (nested retained keys, a full pool, deep fork chains).
The same runs (``runs.run_seed``) and shrinker serve ``kvstate sweep``, so a failure found here
replays with ``kvstate replay`` exactly as a sweep's does.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Callable

from kvstate.spec.protocol import Config, Factory

from . import ops as O
from .replay import AsWatched, Failure, execute
from .sweeps.runs import run_seed
from .shrink import Shrinker


@dataclass
class SeededFailure:
    seed: int
    config: Config              # page size included: the sequence replays in exactly this
    ops: list[O.Op]
    failure: Failure
    original_steps: int
    shrink_stopped: str | None     # why shrinking stopped short of a minimal sequence (shrink.TRIES, CLOCK), or None
    history: list[str] | None = None    # the readable history of the run that showed ``failure`` (``Shrunk``)
    run: Callable = execute     # how ``ops`` run, observed as the seeded run observed them (``AsWatched``)


@dataclass
class SeededRuns:
    runs: int = 0
    steps: int = 0
    failure: SeededFailure | None = None


def first_seed(config: Config) -> int:
    """Where a configuration's seeds start in conform: a thousand-seed block picked by its name.
    The standard configurations differ only in precision and arena, so from one start they ran
    the same sequences; a bug in the sequences, not in the storage, then had 16 tries in all where
    six starts give it 96, at no cost."""
    return zlib.crc32(config.name.encode()) % 1000 * 1000


def run_seeds(factory: Factory, config: Config, seeds: int, steps: int, budget_s: float,
              shrink_budget_s: float, first: int = 0, stop: Callable[[], bool] = lambda: False,
              shrinking: Callable[[int, list[O.Op], Shrinker], None] | None = None) -> SeededRuns:
    """Seeds ``first``, ``first + 1``, ... until ``seeds`` ran, ``budget_s`` passed, or one failed
    (then shrunk). ``stop()`` True ends it between seeds and between shrink tries (its caller stopped
    waiting: conform's time limit); ``shrinking(seed, ops, shrinker)`` is told of a failure found, with
    the operations that showed it, before it is shrunk (``shrinker.best`` is the shortest so far)."""
    result = SeededRuns()
    deadline = time.monotonic() + budget_s
    for seed in range(first, first + seeds):
        if stop() or (result.runs and time.monotonic() > deadline):
            break
        run = run_seed(factory, config, seed, steps)
        result.runs += 1
        result.steps += run.steps
        if run.failure is not None:
            failure, seeded_config = run.failure, config.with_(page_tokens=run.page_tokens)
            ran = [O.op_from_json(op) for op in run.ops]
            quiet = AsWatched.from_steps(ran, run.unobserved, run.checked_after)    # as the run observed them
            shrinker = Shrinker(factory, seeded_config, failure, shrink_budget_s, stop, run=quiet)
            if shrinking is not None:
                shrinking(seed, ran, shrinker)
            shrunk = shrinker.shrink(ran)
            result.failure = SeededFailure(seed, seeded_config, shrunk, shrinker.failure, len(ran), shrinker.stopped,
                                           shrinker.best.history, quiet)
            break
    return result
