"""Conformance's second engine: seeded sequences from ``generate.py``, shrunk by delta debugging.

The Hypothesis machine explores short sequences well; long fixed-seed runs build
what short ones rarely do (nested retained keys, a full pool, deep fork chains).
The same generator and shrinker serve ``kvstate sweep``, so a failure found here
replays with ``kvstate replay`` exactly as a sweep's does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvstate.spec.protocol import Config, Factory

from . import ops as O
from .generate import Generator
from .lockstep import Lockstep
from .replay import Failure, execute
from .shrink import shrink


@dataclass
class SeededFailure:
    seed: int
    config: Config              # page size included: the sequence replays in exactly this
    ops: list[O.Op]
    failure: Failure
    original_steps: int
    shrink_timed_out: bool


@dataclass
class SeededRuns:
    runs: int = 0
    steps: int = 0
    failure: SeededFailure | None = None


def run_seed(factory: Factory, config: Config, seed: int, steps: int) -> tuple[Failure | None, Config, list[O.Op]]:
    """Seed ``seed``'s ``steps`` operations, every invariant after every step."""
    generator = Generator(seed)
    config = config.with_(page_tokens=generator.page_tokens)
    lockstep = Lockstep(factory, config)
    ran: list[O.Op] = []

    def generated():
        for _ in range(steps):
            op = generator.next_op(lockstep)
            ran.append(op)
            yield op

    failure, _ = execute(factory, config, generated(), lockstep=lockstep)
    return failure, config, ran


def run_seeds(factory: Factory, config: Config, seeds: int, steps: int, budget_s: float,
              shrink_budget_s: float) -> SeededRuns:
    """Seeds 0, 1, ... until ``seeds`` ran, ``budget_s`` passed, or one failed (then shrunk)."""
    result = SeededRuns()
    deadline = time.monotonic() + budget_s
    for seed in range(seeds):
        if result.runs and time.monotonic() > deadline:
            break
        failure, seeded_config, ran = run_seed(factory, config, seed, steps)
        result.runs += 1
        result.steps += len(ran)
        if failure is not None:
            started = time.monotonic()
            shrunk, shown = shrink(factory, seeded_config, ran, failure, shrink_budget_s)
            timed_out = time.monotonic() - started >= shrink_budget_s
            result.failure = SeededFailure(seed, seeded_config, shrunk, shown, len(ran), timed_out)
            break
    return result
