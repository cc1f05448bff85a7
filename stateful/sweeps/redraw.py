"""The operations a run that left no result really ran, drawn again with the backend under test.

A run that took its process down (``ProcessDied``, Dask's ``KilledWorker``), was killed stuck in C
(``RunTimeout`` from the watchdog) or raised outside any step sends back no operations. Its seed's
sequence depends on the backend (the generator reads the run's state: an engine without snapshots
is never asked for one, a refused match creates no context), so it is drawn again here exactly as
the run drew it (``runs.run_seed``, the same backend, configuration and seed) in a process of its
own, which sends each operation to this one before applying it. The sequence saved is what ran up
to the step where the run stopped:

- where the step is known (a local pool process reports each step it begins to the sweep's
  watchdog), the drawing stops after drawing that step's operation, without applying it;
- where it is not (Dask: a worker that died sent nothing), the drawing runs the whole sequence and
  the crash step is the last one it began where it too dies or hangs (a backend's crash repeats for
  the same operations); where it does not, the step is unknown and the message says so.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass, field

from kvstate.spec.errors import RunTimeout
from kvstate.spec.protocol import Config

from ..configs import page_sizes
from ..exits import ended_how
from ..generate import Generator
from ..ops import op_from_json
from ..replay import Failure
from ..stretches import numbered
from . import watchdog
from .runs import RUN, RunResult, factory_for, run_seed

REDRAW_LIMIT_S = 60.0
"""How long a drawing may take where the sweep has no ``--run-timeout``."""


class _Enough(BaseException):
    """Raised by the drawing process once it has drawn the step the run stopped at."""


@dataclass
class Redrawn:
    page_tokens: int | None = None
    ops: list = field(default_factory=list)       # JSON, each sent before it was applied
    ended: str = ""                               # how the drawing ended, where it did not finish


def _draw(backend: str, config: Config, seed: int, steps: int, stop_at: int | None, timeout_s, conn) -> None:
    def sent(step, op):
        conn.send(("op", op.to_json()))
        if stop_at is not None and step >= stop_at:
            raise _Enough()
    try:
        conn.send(("page", Generator(seed, page_sizes(factory_for(backend), config)).page_tokens))
        if stop_at != 0:
            run_seed(backend, config, seed, steps, timeout_s, on_op=sent)
        conn.send(("done", None))
    except _Enough:
        conn.send(("done", None))
    except BaseException as error:      # noqa: BLE001 -- told to the sweep, which records it
        conn.send(("raised", f"{type(error).__name__}: {error}"))


def redraw(backend: str, config: Config, seed: int, steps: int, stop_at: int | None,
           timeout_s: float | None) -> Redrawn:
    """Seed ``seed``'s operations against ``backend``, as its run drew them, in a process of its own,
    up to ``stop_at`` (drawn, not applied) or, without it, until the process ends or
    ``timeout_s`` (``REDRAW_LIMIT_S`` where None) plus ``watchdog.GRACE_S`` passes."""
    found = Redrawn()
    receive, send = multiprocessing.Pipe(duplex=False)
    process = multiprocessing.Process(target=_draw, args=(backend, config, seed, steps, stop_at, timeout_s, send),
                                      name="kvstate-sweep-redraw", daemon=False)   # a backend may start processes
    process.start()
    send.close()
    deadline = time.monotonic() + (REDRAW_LIMIT_S if timeout_s is None else timeout_s) + watchdog.GRACE_S
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                found.ended = "still running when drawn again (ended)"
                break
            if not receive.poll(min(left, 0.2)):
                if not process.is_alive() and not receive.poll(0):
                    found.ended = _how(process)
                    break
                continue
            try:
                kind, value = receive.recv()
            except EOFError:
                found.ended = _how(process)
                break
            if kind == "page":
                found.page_tokens = value
            elif kind == "op":
                found.ops.append(value)
            elif kind == "raised":
                found.ended = f"raised {value}"
                break
            else:
                break
    finally:
        receive.close()
        if process.is_alive():
            process.kill()
        process.join()
    return found


def _how(process) -> str:
    process.join(5)
    how = ended_how(process.exitcode)
    if how is None:
        return "ended without a result"
    return f"ended by {how}" if how.startswith("signal") else f"ended with {how}"


def crashed(backend: str, config: Config, seed: int, steps: int, error: BaseException,
            timeout_s: float | None = None) -> RunResult:
    """The failure of a run that came back as ``error`` instead of a result, with the operations it
    ran (``redraw``) and the step it stopped at: ``error.step`` where its process reported it (the
    operation that step began is the last one saved), else where the drawing stopped."""
    known = getattr(error, "step", None)
    found = redraw(backend, config, seed, steps, known, timeout_s)
    message = str(error) or repr(error)
    step = known if known is not None else len(found.ops)
    if known is None:
        message += (f"; drawn again with the backend, it {found.ended} at step {step}" if found.ended else
                    f"; drawn again with the backend it ran all {step} steps: the step the run stopped at is not known")
    elif len(found.ops) < known:
        # The drawing ended before the step the run stopped at (it died, raised or hung earlier: a
        # backend whose crash is not deterministic draws otherwise): the file holds fewer operations
        # than its failure's step, and says so; ``kvstate replay`` refuses such a file (exit 2).
        message += (f"; drawn again with the backend, it {found.ended or 'ended'} after {len(found.ops)} of the "
                    f"{known} operations: the replay file holds only those {len(found.ops)} and does not reach "
                    f"the failure")
    op = None
    if 0 < step <= len(found.ops):
        op = str(op_from_json(found.ops[step - 1]))
    phase = "apply" if isinstance(error, RunTimeout) else "crash"
    name = RunTimeout.__name__ if isinstance(error, RunTimeout) else type(error).__name__    # a watchdog's Stuck too
    failure = Failure(step, phase, op, name, None, message)
    page_tokens = found.page_tokens if found.page_tokens is not None else config.page_tokens
    unobserved, checked = numbered(len(found.ops[:step]))      # as the run left them (``run_seed``)
    return RunResult(config.name, seed, page_tokens, step, 0.0, 0.0, failure, found.ops[:step],
                     clock=[RUN] if isinstance(error, RunTimeout) else [], unobserved=list(unobserved),
                     checked_after=list(checked))
