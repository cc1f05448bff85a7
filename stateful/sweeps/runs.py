"""One (configuration, seed) run of a sweep, and what becomes of it when it fails.

These are the sweep's tasks: module-level functions of picklable arguments (backend path,
configuration, seed, steps), so that a process pool or a Dask worker runs them by name, and
their results (``RunResult``) travel back to the sweeping process. Only that process writes
files (``save_replay``): a worker on another machine has no place to write them to.

A result is a function of (backend, configuration, seed, steps) and the shrink's try limit, whatever
the machine's load, the executor or the number of workers, except where a wall-clock limit cut a
stage short: ``RunResult.clock`` then names each such stage (``RUN``, ``PIN``, ``SHRINK``), and the
sweep's report carries it, so two reports that differ there can tell why.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

from kvstate.spec.errors import RunTimeout
from kvstate.spec.protocol import Config, Factory

from .. import ops as O
from ..backends import canonical_backend, load_factory
from ..configs import page_sizes
from ..deadline import Deadline
from ..generate import Generator
from ..lockstep import Lockstep
from ..replay import AsWatched, Failure, Replay, execute, failure_to_json, save
from ..shrink import CLOCK, DEFAULT_TRIES, Shrinker
from ..stretches import ends_stretch, unobserved
from . import watchdog


@dataclass
class RunResult:
    config: str
    seed: int
    page_tokens: int
    steps: int
    seconds: float
    cpu_seconds: float
    failure: Failure | None = None
    ops: list | None = None            # the operations that ran (JSON), kept only for failures
    replay_file: str | None = None
    minimised: bool = False
    clock: list = field(default_factory=list)   # the stages a wall-clock limit cut short (RUN, PIN, SHRINK)
    # With ``ops``: the steps (from 1) run with nothing observed before them (``stretches``), and those
    # of them checked after; a replay runs them so (``Replay.unobserved``).
    unobserved: list = field(default_factory=list)
    checked_after: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.failure is None


RUN, PIN, SHRINK, SHRINK_LOST = "run", "pin", "shrink", "shrink-lost"
"""The stages of a failing run that have a time limit: the run (``--run-timeout``), the re-run that pins
its failure (``_pinned``, the same limit) and the shrink (``--shrink-budget``); and a shrink whose task
came back without a result (its worker lost, say), which another sweep of the plan would have finished."""

_factories: dict[str, Callable] = {}


def factory_for(backend: str):
    """The backend's factory, imported once per process (a pool process or a worker imports it
    at its first run, not at each)."""
    if backend not in _factories:
        _factories[backend] = load_factory(backend)
    return _factories[backend]


def run_seed(backend: "str | Factory", config: Config, seed: int, steps: int,
             timeout_s: float | None = None, on_op: Callable[[int, O.Op], None] | None = None) -> RunResult:
    """Seed ``seed``'s ``steps`` operations against ``backend`` (a factory, or its name) in
    ``config``, every invariant after every step but in the stretches run unobserved (``stretches``:
    checked after the last of each), and invariant 6 at the end. Past ``timeout_s``
    seconds the run stops and is a ``RunTimeout`` failure at the step it had reached. In a pool
    process the sweep's ``watchdog`` sees each step begin (and ends the process where C code holds
    it past ``timeout_s``); ``on_op(step, op)`` sees each operation drawn, before it is applied."""
    factory = factory_for(backend) if isinstance(backend, str) else backend
    generator = Generator(seed, page_sizes(factory, config))
    config = config.with_(page_tokens=generator.page_tokens)
    ran: list[O.Op] = []
    quiet = AsWatched({}, {})       # the steps left unobserved, as they are drawn
    failure = None
    clock: list[str] = []
    started, cpu_started = time.perf_counter(), time.process_time()
    watchdog.begin(timeout_s)
    try:
        with Deadline(timeout_s) as deadline:
            lockstep = Lockstep(factory, config)
            lockstep.reads_changed_only = True     # every operation goes through ``execute``

            def generated():
                # Each operation is chosen from the state the previous ones left.
                for step in range(1, steps + 1):
                    op = generator.next_op(lockstep)
                    ran.append(op)
                    if unobserved(step - 1):
                        quiet.leave(op, checked=ends_stretch(step - 1))
                    if on_op is not None:
                        on_op(step, op)
                    watchdog.step(step)
                    yield op

            failure, _ = quiet(factory, config, generated(), lockstep=lockstep)
    except RunTimeout:
        pass                    # raised outside execute's own catch; deadline.fired says it all
    if deadline.fired:
        failure = Failure(len(ran), "apply", str(ran[-1]) if ran else None, RunTimeout.__name__, None,
                          f"the run took longer than --run-timeout {timeout_s:g} s")
        clock.append(RUN)
    elif failure is not None:      # "finish" too: its read of every context finds a stray write late
        failure, ran, cut = _pinned(factory, config, failure, ran, timeout_s, quiet)
        clock += [PIN] if cut else []
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    result = RunResult(config.name, seed, generator.page_tokens, len(ran), seconds, cpu_seconds, failure, clock=clock)
    if failure is not None:
        result.ops = [op.to_json() for op in ran]
        result.unobserved, result.checked_after = map(list, quiet.steps(ran))
    return result


def _pinned(factory, config: Config, failure: Failure, ran: list,
            timeout_s: float | None, quiet: AsWatched | None = None) -> tuple[Failure, list, bool]:
    """The failure where it first shows with every live context read at every step (a replay's reading):
    a run reads only the contexts an operation could have changed (``Lockstep.reads_changed_only``), so
    a backend that damages another one is seen a step or more late, or only at ``finish`` (which reads
    every live context once), and its replay file, which a replay fails earlier, did not reproduce it
    exactly ("fails, but NOT as recorded"). Run again on failure only, under a run timeout
    of its own (a failing seed may so take twice ``--run-timeout``); the operations after the step it
    pins are dropped. A re-run that times out (it reads more) keeps the run's own failure, and says so
    (the third value: True where the clock, not the backend, decided what is kept). The re-run
    reports each step it begins to the watchdog, as the run did: a crash or a hang in C during it is
    saved at the step it happened in (it was saved at step 0, with no operations). The steps the run left
    unobserved (``quiet``, None: none) are left so again."""
    quiet = quiet or AsWatched({}, {})
    watchdog.begin(timeout_s)       # a phase of its own, under the same limit

    def reported(step, op, lockstep) -> bool:
        watchdog.step(step)         # a crash or a hang in C here is saved at the step it was in
        return id(op) not in quiet.unwatched     # every other step checked, as without a watch
    try:
        with Deadline(timeout_s) as deadline:
            again, _ = execute(factory, config, list(ran), watch=reported,
                               checked=lambda op: id(op) in quiet.checked_after)
    except RunTimeout:
        return failure, ran, True
    if deadline.fired or (again is not None and again.error == RunTimeout.__name__):
        return failure, ran, True   # the run again took too long (it reads more)
    if again is None or again.phase == "finish" or again.step >= failure.step:
        return failure, ran, False  # it pinned nothing earlier
    return again, ran[:again.step], False


def shrinkable(result: RunResult) -> bool:
    """A timeout or a crash would make every shrinking try wait for it again: saved unshrunk."""
    return (not result.passed and result.failure.phase != "crash"
            and result.failure.error != RunTimeout.__name__)


def to_shrink(results: Iterable[RunResult], limit: int) -> list[RunResult]:
    """The first failure (by configuration, then seed) of each configuration and failure kind,
    up to ``limit``: which ones does not depend on the order runs finished in."""
    chosen, seen = [], set()
    for r in sorted((r for r in results if shrinkable(r)), key=lambda r: (r.config, r.seed)):
        kind = (r.config, r.failure.signature)
        if kind not in seen and len(chosen) < limit:
            seen.add(kind)
            chosen.append(r)
    return chosen


def shrink_result(backend: str, config: Config, result: RunResult, budget_s: float,
                  max_tries: int = DEFAULT_TRIES) -> RunResult:
    """A failing run shrunk: its operations and failure replaced by the shrunk ones. ``minimised``
    only where the shrinker found no single change that still fails: one stopped by ``max_tries`` (the
    same on any machine) or cut short by ``budget_s`` (``SHRINK`` in ``clock``) kept what it had (still
    failing the same way). In a pool process, the sweep's watchdog ends a shrink that C code holds
    ``watchdog.GRACE_S`` past the budget (``shrink_cut``)."""
    watchdog.begin(budget_s)
    factory = factory_for(backend)
    config = config.with_(page_tokens=result.page_tokens)
    ops = [O.op_from_json(op) for op in result.ops]
    quiet = AsWatched.from_steps(ops, result.unobserved, result.checked_after)    # as the run observed them
    shrinker = Shrinker(factory, config, result.failure, budget_s, max_tries=max_tries, run=quiet)
    shrunk = shrinker.shrink(ops)
    unobserved, checked = quiet.steps(shrunk)
    return RunResult(result.config, result.seed, result.page_tokens, result.steps, result.seconds,
                     result.cpu_seconds, shrinker.failure, [op.to_json() for op in shrunk],
                     minimised=shrinker.stopped is None,
                     clock=result.clock + ([SHRINK] if shrinker.stopped == CLOCK else []),
                     unobserved=list(unobserved), checked_after=list(checked))


def shrink_cut(result: RunResult, error: BaseException) -> RunResult:
    """``result`` unshrunk, marked with why its shrink task brought back ``error`` instead of a result:
    ``SHRINK`` where it was ended from outside (a ``RunTimeout``: the watchdog or a Dask nanny,
    ``watchdog.GRACE_S`` past ``--shrink-budget``), else ``SHRINK_LOST`` (its worker died or was given
    up on, or the task raised). Either was left unmarked: a sweep whose shrink was so lost reported the
    run's own failure where another reported the shrunk one, and nothing said why."""
    return replace(result, clock=result.clock + [SHRINK if isinstance(error, RunTimeout) else SHRINK_LOST])


def save_replay(backend: str, config: Config, result: RunResult, replays: Path) -> RunResult:
    """Write a failing run's replay file (shrunk or not) into ``replays`` and note where, as an absolute
    path: the printed ``kvstate replay`` commands and the reports' paths work from any folder. The file
    names a file backend by its absolute path, as a local sweep does, also where a cluster's workers
    were handed it as given: the same failure gives the same file either way."""
    config = config.with_(page_tokens=result.page_tokens)
    ops = [O.op_from_json(op) for op in result.ops]
    replay = Replay(canonical_backend(backend), config, result.seed, ops, result.failure, minimised=result.minimised,
                    original_steps=result.steps, unobserved=tuple(result.unobserved),
                    checked_after=tuple(result.checked_after))
    result.replay_file = os.path.abspath(save(replay, replays / f"{result.config}-seed{result.seed}.json"))
    return result


def result_to_json(result: RunResult) -> dict:
    data = asdict(result)
    if result.failure is not None:
        data["failure"] = failure_to_json(result.failure)
    return data


def result_from_json(data: dict) -> RunResult:
    failure = data.get("failure")
    return RunResult(**{**data, "failure": Failure(**failure) if failure else None})     # no ``clock``: an older journal
