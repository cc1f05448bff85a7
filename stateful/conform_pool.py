"""Conformance configurations in worker processes, a few checks of one configuration per task.

Checks are Python holding the GIL, so threads add nothing: ``kvstate conform`` on a 2-core machine
runs two tasks at once in two processes. A worker imports the backend by name (so only a backend
named on the command line, not a factory object, can be spread), runs its task's checks exactly as
``conform`` does in-process, and sends the ``ConfigResult`` back; results come out in the
configurations' order, one ``ConfigResult`` each. A worker that dies (a backend that crashes the
interpreter) is that configuration's failure, by name.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import CancelledError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from kvstate.spec.protocol import Config

from .conform import ConfigResult, Outcome, conform, progress_line, use_cache_folder_for_hypothesis


# The checks that take seconds each, longest first; every other check of a configuration runs in
# one task after them. A task per configuration left the last one (15 s of CPU) running alone
# while the other core idled; tasks this size, longest first, keep both busy to the end.
LONG_CHECKS = ("lockstep", "seeded")


def tasks(configs: list[Config], names: list[str]) -> list[tuple[Config, list[str]]]:
    """(configuration, checks) in the order they are handed out: every configuration's lockstep,
    then every seeded, then the rest of each configuration's checks together."""
    rest = [n for n in names if n not in LONG_CHECKS]
    return ([(config, [name]) for name in LONG_CHECKS if name in names for config in configs]
            + ([(config, rest) for config in configs] if rest else []))


def conform_in_processes(backend: str, configs: list[Config], workers: int, profile: str = "ci",
                         checks: list[str] | None = None, time_limit: float | None = None,
                         sizes: tuple[int | None, int | None] = (None, None),
                         progress: Callable[[str], None] | None = None) -> list[ConfigResult]:
    """``conform`` of the backend named ``backend`` on ``workers`` processes, each task one
    configuration's lockstep, its seeded runs, or its other checks (``tasks``); the results are
    those of ``conform`` in one process, outcomes in the checks' order. ``sizes`` overrides the
    profile's (examples, steps) of the lockstep machine."""
    from .conform import CHECKS

    names = list(checks or CHECKS)
    context = multiprocessing.get_context("spawn")     # a fresh interpreter: no threads or locks inherited
    outcomes: list[dict[str, Outcome]] = [{} for _ in configs]
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        submitted = [(configs.index(config), part,
                      pool.submit(_one_configuration, backend, config, profile, part, time_limit, sizes))
                     for config, part in tasks(configs, names)]
        hung: dict[int, str] = {}           # configuration -> its check that timed out
        for at, (index, part, future) in enumerate(submitted):
            config = configs[index]
            try:
                got = future.result().outcomes
            except CancelledError:
                got = {name: Outcome.skipped_after(hung[index]) for name in part}
            except BrokenProcessPool as error:
                got = {"worker": Outcome("FAIL", 0.0, f"the worker process running this configuration died "
                                                      f"(checks: {', '.join(part)}): {error}")}
            timed_out = [name for name, outcome in got.items() if outcome.status == "TIMEOUT"]
            if timed_out and index not in hung:     # as in one process: its later checks are not started
                hung[index] = timed_out[0]
                for other, _, waiting in submitted[at + 1:]:
                    if other == index:
                        waiting.cancel()            # a task already started runs on; only queued ones stop
            outcomes[index].update(got)
            if progress:
                for name, outcome in got.items():
                    progress(progress_line(config, name, outcome))
    return [ConfigResult(config, {name: found[name] for name in [*names, "worker"] if name in found})
            for config, found in zip(configs, outcomes)]


def _one_configuration(backend: str, config: Config, profile: str, checks: list[str] | None,
                       time_limit: float | None, sizes: tuple[int | None, int | None]) -> ConfigResult:
    from .backends import load_factory
    from .configs import PROFILES

    use_cache_folder_for_hypothesis()
    examples, steps = sizes
    settings = None
    if examples or steps:
        from hypothesis import settings as Settings

        base = PROFILES[profile]
        settings = Settings(base, max_examples=examples or base.max_examples,
                            stateful_step_count=steps or base.stateful_step_count)
    options = {} if time_limit is None else {"time_limit": time_limit}
    (result,) = conform(load_factory(backend), profile=profile, configs=[config], checks=checks,
                        settings=settings, **options)
    return result
