"""Conformance configurations in worker processes, one configuration per task.

Checks are Python holding the GIL, so threads add nothing: ``kvstate conform`` on a 2-core machine
runs two configurations at once in two processes. A worker imports the backend by name (so only a
backend named on the command line, not a factory object, can be spread), runs every check of its
configuration exactly as ``conform`` does in-process, and sends the ``ConfigResult`` back; results
come out in the configurations' order. A worker that dies (a backend that crashes the interpreter)
is that configuration's failure, by name.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from kvstate.spec.protocol import Config

from .conform import ConfigResult, Outcome, conform, progress_line, use_cache_folder_for_hypothesis


def conform_in_processes(backend: str, configs: list[Config], workers: int, profile: str = "ci",
                         checks: list[str] | None = None, time_limit: float | None = None,
                         sizes: tuple[int | None, int | None] = (None, None),
                         progress: Callable[[str], None] | None = None) -> list[ConfigResult]:
    """``conform`` of the backend named ``backend`` with each configuration in its own task, on
    ``workers`` processes. ``sizes`` overrides the profile's (examples, steps) of the lockstep machine."""
    context = multiprocessing.get_context("spawn")     # a fresh interpreter: no threads or locks inherited
    results: list[ConfigResult] = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = [pool.submit(_one_configuration, backend, config, profile, checks, time_limit, sizes)
                   for config in configs]
        for config, future in zip(configs, futures):
            try:
                result = future.result()
            except BrokenProcessPool as error:
                result = ConfigResult(config, {"worker": Outcome("FAIL", 0.0, f"the worker process running this "
                                                                          f"configuration died: {error}")})
            results.append(result)
            if progress:
                for name, outcome in result.outcomes.items():
                    progress(progress_line(config, name, outcome))
    return results


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
