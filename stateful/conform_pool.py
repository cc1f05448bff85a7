"""Conformance configurations in worker processes, a few checks of one configuration per task.

Checks are Python holding the GIL, so threads add nothing: ``kvstate conform`` on a 2-core machine
runs two tasks at once in two processes. A worker imports the backend by name (so only a backend
named on the command line, not a factory object, can be spread), runs its task's checks exactly as
``conform`` does in-process, and sends the ``ConfigResult`` back; results come out in the
configurations' order, one ``ConfigResult`` each. A worker that dies (a backend that crashes the
interpreter) is that configuration's failure, by name: it breaks the whole pool, so the tasks running
then are run again, each alone in a process of its own, and the ones not yet started in a fresh pool
(``conform_in_processes``); the others keep their verdicts.
"""

from __future__ import annotations

import multiprocessing
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from concurrent.futures import CancelledError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
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
    profile's (examples, steps) of the lockstep machine.

    A worker that dies breaks the whole pool: every task not finished by then fails with it, most of
    them other configurations' that never ran or were only running beside it. So only a task that
    had started and not finished is a suspect (each task marks its start in a file: a future's
    ``running()`` is set for tasks merely queued to a worker); each suspect is run again alone in
    its own process and is that configuration's failure, by name, only if it kills that one too.
    Tasks not yet started run on in a fresh pool. No task runs more than twice, so a backend that
    kills every worker ends the run as surely as one that kills none. A task that kills its process
    only sometimes may pass alone: its configuration then has that run's verdict."""
    from .conform import CHECKS

    names = list(checks or CHECKS)
    context = multiprocessing.get_context("spawn")     # a fresh interpreter: no threads or locks inherited
    jobs = tasks(configs, names)
    outcomes: list[dict[str, Outcome]] = [{} for _ in configs]
    hung: dict[int, str] = {}           # configuration -> its check that timed out

    def settle(job: int, got: dict[str, Outcome]) -> None:
        config, part = jobs[job]
        index = configs.index(config)
        timed_out = [name for name, outcome in got.items() if outcome.status == "TIMEOUT"]
        if timed_out and index not in hung:     # as in one process: its later checks are not started
            hung[index] = timed_out[0]
        outcomes[index].update(got)
        if progress:
            for name, outcome in got.items():
                progress(progress_line(config, name, outcome))

    def died(job: int, error: BaseException) -> dict[str, Outcome]:
        return {"worker": Outcome("FAIL", 0.0, f"the worker process running this configuration died, run alone in a "
                                              f"process of its own (checks: {', '.join(jobs[job][1])}): {error}")}

    with tempfile.TemporaryDirectory(prefix="kvstate-conform-") as folder:
        def submit(pool: ProcessPoolExecutor, job: int):
            """The job's future, or None where its configuration hung in an earlier pool (then skipped,
            not started, as in one process)."""
            config, part = jobs[job]
            if configs.index(config) in hung:
                settle(job, {name: Outcome.skipped_after(hung[configs.index(config)]) for name in part})
                return None
            return pool.submit(_one_configuration, backend, config, profile, part, time_limit, sizes, folder, job)

        def shared_pool(ids: list[int]) -> tuple[list[int], list[int], bool]:
            """``ids`` in one pool of ``workers``: (suspects, not started, whether it broke)."""
            suspects, waiting, broke = [], [], False
            with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool, _ended_if_stopped(pool):
                submitted = [(job, future) for job in ids if (future := submit(pool, job)) is not None]
                for at, (job, future) in enumerate(submitted):
                    index = configs.index(jobs[job][0])
                    try:
                        got = future.result().outcomes
                    except CancelledError:
                        got = {name: Outcome.skipped_after(hung[index]) for name in jobs[job][1]}
                    except BrokenProcessPool:
                        broke = True
                        (suspects if _started(folder, job) else waiting).append(job)
                        continue
                    settle(job, got)
                    if index in hung:
                        for other, later in submitted[at + 1:]:
                            if configs.index(jobs[other][0]) == index:
                                later.cancel()      # a task already started runs on; only queued ones stop
            return suspects, waiting, broke

        shared, alone = list(range(len(jobs))), []
        while shared:
            suspects, shared, broke = shared_pool(shared)
            alone += suspects
            if broke and not suspects:      # a worker died between tasks: no task to blame, none to trust
                alone, shared = alone + shared, []
        for start in range(0, len(alone), workers):     # each in a process of its own: a death there is its own
            pools = [ProcessPoolExecutor(max_workers=1, mp_context=context) for _ in alone[start:start + workers]]
            try:
                with _ended_if_stopped(*pools):
                    submitted = [(job, submit(pool, job)) for job, pool in zip(alone[start:start + workers], pools)]
                    for job, future in submitted:
                        if future is not None:
                            try:
                                got = future.result().outcomes
                            except BrokenProcessPool as error:
                                got = died(job, error)
                            settle(job, got)
            finally:
                for pool in pools:
                    pool.shutdown()
    return [ConfigResult(config, {name: found[name] for name in [*names, "worker"] if name in found})
            for config, found in zip(configs, outcomes)]


@contextmanager
def _ended_if_stopped(*pools: ProcessPoolExecutor) -> Iterator[None]:
    """Ctrl-C or a SIGTERM while waiting on ``pools``: their workers are ended, not waited for. A pool's
    own exit waits for the tasks already running, and a worker goes on to its next task after an
    interrupt of its own (a terminal's Ctrl-C reaches it too): the command took 15-26 s to stop.

    Each pool's manager thread is joined before the interrupt goes on. Left running, it closes its
    wake-up pipe while the interpreter's exit hook writes to that pipe without a lock (CPython 3.11's
    ``_python_exit``), and a Ctrl-C now and then printed an ``OSError: Bad file descriptor``
    traceback after "interrupted". With the workers ended first, the join is short: the thread sees
    them gone, fails what was pending, closes its pipes and returns."""
    try:
        yield
    except BaseException:
        children = multiprocessing.active_children()      # this command's workers: it starts no other
        for child in children:
            child.terminate()
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)
        for child in children:
            child.join(1)       # reaped: not left behind as zombies
        raise


def _started(folder: str, job: int) -> bool:
    return (Path(folder) / str(job)).exists()


def _one_configuration(backend: str, config: Config, profile: str, checks: list[str] | None,
                       time_limit: float | None, sizes: tuple[int | None, int | None],
                       folder: str | None = None, job: int | None = None) -> ConfigResult:
    from .backends import load_factory
    from .configs import PROFILES
    from .held_interpreter import enable

    if folder is not None:      # before anything of the backend's runs: this task may be the one to die
        (Path(folder) / str(job)).touch()
    # A check stuck in C holding the GIL stops this whole process, past any limit of its own: the
    # watcher ends it instead, which the pool sees as a worker that died (run alone again, then a
    # failure of this configuration by name), never a command waiting for good.
    enable(report_an_end=False)

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
