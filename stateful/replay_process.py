"""A replay run in a process of its own, watched from the one that started it.

The backend a replay runs may end its process (``os._exit(0)``, exit 3, a signal) or hang in C
code that holds the GIL, where no timer of that process runs. In the replaying process itself, the
first ended ``kvstate replay`` with the backend's own status (0 read as "fixed"), the second held it
for good. So the replay runs in a forked child, which tells this process each step before it
applies it and sends back the lines it prints and the failure it found. A child that dies without
a result is a ``ProcessDied`` failure at the step it had begun, naming its exit status or signal; one
still running after ``time_limit`` is killed and, where the file records a ``RunTimeout``, is a
``RunTimeout`` failure naming the step and the operation it was stuck in; where the file records
anything else, the replay was merely slower than the limit: ``RunTimeout`` is raised (``kvstate
replay`` exits 2, "raise --time-limit"), not read as a failure that differs from the recorded one.

Where processes cannot be forked (Windows), the replay runs in this process, as before. With
``kvstate replay --spawn`` the child starts fresh (``spawn``) and imports the backend by its name:
for a backend that cannot run in a forked copy of a process that built a cache (CUDA).
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from dataclasses import asdict
from typing import Callable

from kvstate.spec.errors import ReplayFileError, RunTimeout
from kvstate.spec.protocol import Factory

from . import replay as R
from .backends import FactoryError
from .exits import ended_how


def _child(recorded: R.Replay, factory: Factory, every_step: bool, conn) -> None:
    def out(line: str) -> None:
        conn.send(("line", str(line)))

    def started(step, op) -> None:
        conn.send(("start", step, str(op)))
    try:
        failure = R.replay(recorded, factory, out, every_step=every_step, on_start=started)
        conn.send(("done", None if failure is None else asdict(failure)))
    except ReplayFileError as error:        # the file's fault (a handle it never made): exit 2 there
        conn.send(("file", str(error)))
    except BaseException as error:          # noqa: BLE001 -- whatever else stopped the replay
        conn.send(("error", f"{type(error).__name__}: {error}"))


def _spawned(recorded: R.Replay, backend: str, every_step: bool, conn) -> None:
    """``_child`` in a fresh process (``spawn``): the backend imported there, by its name."""
    from .backends import load_factory
    try:
        factory = load_factory(backend)
    except BaseException as error:          # noqa: BLE001 -- told to the parent, which exits 2 (not "reproduces")
        conn.send(("load", f"{type(error).__name__}: {error}"))
        return
    _child(recorded, factory, every_step, conn)


def replay(recorded: R.Replay, factory: Factory, out: Callable[[str], None] = print,
           time_limit: float | None = None, every_step: bool = False,
           spawn_backend: str | None = None) -> R.Failure | None:
    """``replay.replay`` in a forked child: the failure it found, or the child's death or hang as one.

    With ``spawn_backend`` (a backend's name, as ``load_factory`` takes it) the child starts fresh
    (``spawn``) and imports the backend itself, rather than being a fork of this process, which imported
    it already: a CUDA backend cannot run in a forked child of a process that used CUDA. Patches made in this process (``planted.PLANTED``) do not reach a spawned child."""
    methods = multiprocessing.get_all_start_methods()
    if spawn_backend is not None and "spawn" in methods:
        context = multiprocessing.get_context("spawn")
        target, backend_arg = _spawned, spawn_backend
    elif "fork" in methods:
        context = multiprocessing.get_context("fork")
        target, backend_arg = _child, factory
    else:
        return R.replay(recorded, factory, out, time_limit, every_step)
    receive, send = context.Pipe(duplex=False)
    sys.stdout.flush()
    sys.stderr.flush()
    child = context.Process(target=target, args=(recorded, backend_arg, every_step, send),
                            name="kvstate-replay", daemon=False)   # a backend may start processes
    child.start()
    send.close()
    deadline = None if time_limit is None else time.monotonic() + time_limit
    step, op = 0, None
    try:
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                child.kill()
                if getattr(recorded.failure, "error", None) != "RunTimeout":
                    # Not the recorded failure (none was a hang): the replay is slower than the limit.
                    raise RunTimeout(f"the replay did not finish within {time_limit:g} s (it was in "
                                     + (f"step {step}, {op}" if step else "building the cache")
                                     + "): raise --time-limit")
                failure = R.Failure(step, "apply" if step else "build", op, "RunTimeout", None,
                                    f"the replay was still running after --time-limit {time_limit:g} s, stuck in "
                                    + (f"step {step}, {op}" if step else "building the cache")
                                    + "; its process was ended")
                break
            if not receive.poll(0.2 if left is None else min(left, 0.2)):
                if child.is_alive() or receive.poll(0):
                    continue
                failure = _died(child, step, op)
                break
            try:
                message = receive.recv()
            except EOFError:
                failure = _died(child, step, op)
                break
            if message[0] == "line":
                out(message[1])
            elif message[0] == "start":
                _, step, op = message
            elif message[0] == "done":
                return None if message[1] is None else R.Failure(**message[1])
            elif message[0] == "file":
                raise ReplayFileError(message[1])
            elif message[0] == "load":
                raise FactoryError(f"the backend could not be loaded in the replay's fresh process (--spawn): "
                                   f"{message[1]}")
            else:
                raise RuntimeError(message[1])
    finally:
        receive.close()
        if child.is_alive():
            child.kill()
        child.join()
    out("")
    out(f"FAILED {failure}")
    return failure


def _died(child, step: int, op: str | None) -> R.Failure:
    child.join(5)
    how = ended_how(child.exitcode)
    how = f": {how}" if how else ""
    where = f"in step {step}, {op}" if step else "building the cache"
    return R.Failure(step, "apply" if step else "build", op, "ProcessDied", None,
                     f"the backend ended the replay's process {where}, without a result{how}")
