"""One (configuration, seed) run of a sweep, and what becomes of it when it fails.

These are the sweep's tasks: module-level functions of picklable arguments (backend path,
configuration, seed, steps), so that a process pool or a Dask worker runs them by name, and
their results (``RunResult``) travel back to the sweeping process. Only that process writes
files (``save_replay``): a worker on another machine has no place to write them to.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from kvstate.spec.errors import RunTimeout
from kvstate.spec.protocol import Config, Factory

from .. import ops as O
from ..backends import load_factory
from ..configs import page_sizes
from ..deadline import Deadline
from ..generate import Generator, generate
from ..lockstep import Lockstep
from ..replay import Failure, Replay, execute, save
from ..shrink import shrink


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

    @property
    def passed(self) -> bool:
        return self.failure is None


_factories: dict[str, Callable] = {}

# A run stuck past its timeout in code the deadline cannot interrupt (C: a lock, a sleep) held its pool
# process, and every resume, for good. In a pool process of the sweep's own (``hard_timeouts``, set by
# ``sweep.LocalPool``'s initializer) it ends that process this long after the timeout, with
# ``STUCK_EXIT``: the pool records the seed as a ``RunTimeout``. Never in the sweep's own process.
STUCK_GRACE_S = 2.0
STUCK_EXIT = 124
hard_timeouts = False


@contextmanager
def _ended_if_stuck(timeout_s: float | None) -> Iterator[None]:
    """Within the block, end this process ``STUCK_GRACE_S`` after ``timeout_s`` (where ``hard_timeouts``)."""
    if not hard_timeouts or timeout_s is None:
        yield
        return
    timer = threading.Timer(timeout_s + STUCK_GRACE_S, os._exit, (STUCK_EXIT,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def factory_for(backend: str):
    """The backend's factory, imported once per process (a pool process or a worker imports it
    at its first run, not at each)."""
    if backend not in _factories:
        _factories[backend] = load_factory(backend)
    return _factories[backend]


def run_seed(backend: "str | Factory", config: Config, seed: int, steps: int,
             timeout_s: float | None = None) -> RunResult:
    """Seed ``seed``'s ``steps`` operations against ``backend`` (a factory, or its name) in
    ``config``, every invariant after every step, and invariant 6 at the end. Past ``timeout_s``
    seconds the run stops and is a ``RunTimeout`` failure at the step it had reached."""
    factory = factory_for(backend) if isinstance(backend, str) else backend
    generator = Generator(seed, page_sizes(factory, config))
    config = config.with_(page_tokens=generator.page_tokens)
    ran: list[O.Op] = []
    failure = None
    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        with _ended_if_stuck(timeout_s), Deadline(timeout_s) as deadline:
            lockstep = Lockstep(factory, config)
            lockstep.reads_changed_only = True     # every operation goes through ``execute``

            def generated():
                # Each operation is chosen from the state the previous ones left.
                for _ in range(steps):
                    op = generator.next_op(lockstep)
                    ran.append(op)
                    yield op

            failure, _ = execute(factory, config, generated(), lockstep=lockstep)
    except RunTimeout:
        pass                    # raised outside execute's own catch; deadline.fired says it all
    if deadline.fired:
        failure = Failure(len(ran), "apply", str(ran[-1]) if ran else None, RunTimeout.__name__, None,
                          f"the run took longer than --run-timeout {timeout_s:g} s")
    elif failure is not None and failure.phase != "finish":
        failure, ran = _pinned(factory, config, failure, ran, timeout_s)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    return RunResult(config.name, seed, generator.page_tokens, len(ran), seconds, cpu_seconds, failure,
                     [op.to_json() for op in ran] if failure else None)


def _pinned(factory, config: Config, failure: Failure, ran: list, timeout_s: float | None) -> tuple[Failure, list]:
    """The failure where it first shows with every live context read at every step (a replay's reading):
    a run reads only the contexts an operation could have changed (``Lockstep.reads_changed_only``), so
    a backend that damages another one is seen a step or more late, and its replay file, which a
    replay fails earlier, did not reproduce it exactly. Run again on failure only, under a run timeout
    of its own (a failing seed may so take twice ``--run-timeout``); the operations after the step it
    pins are dropped. A re-run that times out (it reads more) keeps the run's own failure."""
    try:
        with _ended_if_stuck(timeout_s), Deadline(timeout_s) as deadline:
            again, _ = execute(factory, config, list(ran))
    except RunTimeout:
        return failure, ran
    if deadline.fired or again is None or again.error == RunTimeout.__name__ or again.phase == "finish" \
            or again.step >= failure.step:
        return failure, ran         # the run again took too long (it reads more), or pinned nothing earlier
    return again, ran[:again.step]


def crashed(config: Config, seed: int, steps: int, error: BaseException, sizes: tuple[int, ...]) -> RunResult:
    """A run that took its worker down with it (Dask gives up on a task after its worker died
    ``allowed-failures`` times running it), or raised outside any step: a failure of that seed,
    kept with the whole generated sequence so that its replay file reproduces the crash. The
    sequence is drawn again at the page ``sizes`` the backend's run drew from (its declared one),
    with the NumPy engine beside the reference, since the backend itself may crash again."""
    page_tokens, ops = generate(seed, steps, config, sizes=sizes)
    failure = Failure(steps, "crash", None, type(error).__name__, None, str(error) or repr(error))
    return RunResult(config.name, seed, page_tokens, steps, 0.0, 0.0, failure, [op.to_json() for op in ops])


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


def shrink_result(backend: str, config: Config, result: RunResult, budget_s: float) -> RunResult:
    """A failing run shrunk: its operations and failure replaced by the shrunk ones."""
    factory = factory_for(backend)
    config = config.with_(page_tokens=result.page_tokens)
    ops = [O.op_from_json(op) for op in result.ops]
    shrunk, failure = shrink(factory, config, ops, result.failure, budget_s)
    return RunResult(result.config, result.seed, result.page_tokens, result.steps, result.seconds,
                     result.cpu_seconds, failure, [op.to_json() for op in shrunk], minimised=True)


def save_replay(backend: str, config: Config, result: RunResult, replays: Path) -> RunResult:
    """Write a failing run's replay file (shrunk or not) into ``replays`` and note where, as an absolute
    path: the printed ``kvstate replay`` commands and the reports' paths work from any folder."""
    config = config.with_(page_tokens=result.page_tokens)
    ops = [O.op_from_json(op) for op in result.ops]
    replay = Replay(backend, config, result.seed, ops, result.failure, minimised=result.minimised,
                    original_steps=result.steps)
    result.replay_file = os.path.abspath(save(replay, replays / f"{result.config}-seed{result.seed}.json"))
    return result


def result_to_json(result: RunResult) -> dict:
    return asdict(result)


def result_from_json(data: dict) -> RunResult:
    failure = data.get("failure")
    return RunResult(**{**data, "failure": Failure(**failure) if failure else None})
