"""A time limit on one run, in whatever thread runs it.

A backend bug can make one operation loop forever (a cycle in a tree walk); the sweep
must record that seed as a timeout and go on, not wait with it. Runs execute in the main
thread of a pool process, or in a thread of a Dask worker's pool, where signals cannot
reach (``signal.alarm`` works only in a main thread). So a timer thread raises
``RunTimeout`` *in the running thread* through CPython's ``PyThreadState_SetAsyncExc``,
delivered at that thread's next bytecode. Code blocked inside C (a lock that never opens)
is not interrupted; Python-level loops, which is where a backend's own bugs live, are.

The exception lands at whatever the thread runs next, and a finalizer (a weakref callback, a
``__del__``) that runs there prints it as "Exception ignored in ..." and drops it: a sweep under
Dask once printed that for ``WeakSet._remove``, and the stuck run then went on with its deadline
spent. So it fires once more, ``REFIRE_S`` later, if the block is still running. Only once: a
second exception can itself land at the entry of ``__exit__``, before the block is marked left,
and escape the ``with`` (the callers' ``except RunTimeout`` around it take it); a timer that kept
re-firing would then go on raising into whatever code the thread ran next, forever.

One thread fires every deadline of a process (``_Clock``), not a ``threading.Timer`` each: a
shrink arms hundreds, one a try, and every thread's start and end takes the interpreter's
thread-list lock, which on CPython 3.11 was one of the three things a Dask worker's stall
needed (python/cpython#106883; ``sweeps/worker_gate.py``).
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import os
import threading
import time
import traceback

from kvstate.spec.errors import RunTimeout

from .held_interpreter import guarding

REFIRE_S = 1.0      # after the first, when the exception is raised the second and last time, if the block runs on

# An own prototype of the one C function, rather than argtypes set on ctypes.pythonapi's shared entry.
_raise_in = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.py_object)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi))


class _Drained(BaseException):
    """Sent to this thread by ``Deadline.__exit__`` in place of a fired ``RunTimeout``, and caught there."""


class Deadline:
    """``with Deadline(seconds):`` raises ``RunTimeout`` in this thread once ``seconds`` have
    passed; ``fired`` tells afterwards whether it did. ``None`` means no limit.

    Leaving the block disarms it under the same lock the timer fires under, and takes back an
    exception fired but not yet delivered, so none escapes the block into the caller's code.
    """

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.fired = False
        self._lock = threading.Lock()
        self._done = False
        self._armed: int | None = None      # the clock's number for the next firing, once armed
        self._thread_id = 0
        self._refires = 1

    def __enter__(self) -> "Deadline":
        if self.seconds is not None:
            self._thread_id = threading.get_ident()
            self._arm(self.seconds)
        return self

    def _arm(self, seconds: float) -> None:
        self._armed = _clock.arm(seconds, self._fire)

    def _fire(self) -> None:
        with self._lock:
            if not self._done:
                self.fired = True
                _raise_in(self._thread_id, RunTimeout)
                if self._refires:       # in case it is dropped where it lands; ``__exit__`` cancels it
                    self._refires -= 1
                    self._arm(REFIRE_S)

    def __exit__(self, *exc_info) -> None:
        if self._armed is None:
            return
        with self._lock:
            self._done = True
            _clock.cancel(self._armed)
        if self.fired:
            _drain()


class _Clock:
    """One daemon thread that makes every armed deadline's call when it is due, earliest first.

    Its thread starts at the first deadline armed in the process. A call is made outside the
    clock's lock: it takes its deadline's lock, and may arm again (the re-fire), and a deadline's
    ``__exit__`` cancels under its own lock, so both take the two locks in the same order."""

    def __init__(self) -> None:
        self._wake = threading.Condition(threading.Lock())
        self._due: list[tuple[float, int, object]] = []     # (when, number, call): a heap
        self._armed: set[int] = set()       # numbers neither made nor cancelled; the rest leave ``_due`` lazily
        self._numbers = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, call) -> int:
        """``call()`` in ``seconds``, unless cancelled first: its number, for ``cancel``."""
        with self._wake:
            number = next(self._numbers)
            heapq.heappush(self._due, (time.monotonic() + seconds, number, call))
            self._armed.add(number)
            start = self._thread is None
            if start:
                self._thread = threading.Thread(target=self._run, name="kvstate-deadlines", daemon=True)
            elif self._due[0][1] == number:     # due before the one the thread waits for
                self._wake.notify()
        if start:
            try:
                self._thread.start()
            except BaseException:   # no thread (none left to start): the next deadline tries again
                with self._wake:
                    self._thread = None
                    self._armed.discard(number)
                raise
        return number

    def cancel(self, number: int) -> None:
        with self._wake:
            self._armed.discard(number)
            if len(self._due) > 2 * len(self._armed) + 64:     # mostly cancelled: they go now, not when due
                self._due = [entry for entry in self._due if entry[1] in self._armed]
                heapq.heapify(self._due)

    def _run(self) -> None:
        try:
            self._fire_when_due()
        finally:        # should the loop ever end (it should not), the next deadline starts a thread again
            with self._wake:
                self._thread = None

    def _fire_when_due(self) -> None:
        armed = self._armed
        while True:
            with self._wake:
                while True:
                    due = self._due         # ``cancel`` may have replaced the list
                    while due and due[0][1] not in armed:
                        heapq.heappop(due)
                    if not due:
                        self._wake.wait()
                    elif due[0][0] <= time.monotonic():
                        break
                    else:       # a deadline past TIMEOUT_MAX (or inf) waits in steps: wait() refuses more
                        self._wake.wait(min(due[0][0] - time.monotonic(), threading.TIMEOUT_MAX))
                _when, number, call = heapq.heappop(due)
                armed.discard(number)
            try:
                call()
            except Exception:       # printed; the thread goes on, or no later deadline would fire
                traceback.print_exc()


_clock = _Clock()


def _new_clock() -> None:
    """A forked child's own clock: the parent's thread is not in it, and its lock may have been held."""
    global _clock
    _clock = _Clock()


os.register_at_fork(after_in_child=_new_clock)


def _drain() -> None:
    """Take back a fired exception that may not have landed yet, leaving nothing pending.

    Not with ``PyThreadState_SetAsyncExc(id, NULL)``: on CPython up to 3.11 that still raises the
    interpreter's "asynchronous exception pending" flag, which only the delivery of a real one
    lowers. Left up, every thread takes the eval loop's slow path at every check, and a thread
    under a profile hook (``threading.setprofile``) loops forever at its first call (the race tests
    hung for 120 s after a fired replay deadline). So a sentinel replaces whatever is pending and
    is delivered here, at the loop's first backward jump, which lowers the flag."""
    try:
        _raise_in(threading.get_ident(), _Drained)
        for _ in range(1_000_000):      # delivered at the first check; the bound is only a backstop
            pass
    except _Drained:
        return


class Overran(Exception):
    """``in_daemon_thread``'s call did not return in time; ``ident`` names its abandoned thread."""

    def __init__(self, seconds: float, ident: int | None):
        super().__init__(f"no result within {seconds:g} s")
        self.seconds, self.ident = seconds, ident


def in_daemon_thread(call, seconds: float, name: str, what: str | None = None, watched_for: float | None = None):
    """``call()`` in a daemon thread: its result, or whatever it raised (re-raised here, ``SystemExit``
    included); past ``seconds``, ``Overran`` and the thread is abandoned. Unlike ``Deadline`` this
    cannot stop the call, only stop waiting for it: for a backend's import, its first cache, or a
    whole conformance check, which may hang where no exception can reach. In the ``kvstate`` command
    a call that holds the interpreter so long that not even the wait can end is ended from outside
    (``held_interpreter``), named by ``what`` (default: ``name``), past ``watched_for`` (default:
    ``seconds``) and its grace."""
    with guarding(watched_for or seconds, what or name):
        return _in_daemon_thread(call, seconds, name)


def _in_daemon_thread(call, seconds: float, name: str):
    box: dict = {}

    def target():
        try:
            box["result"] = call()
        except BaseException as error:      # handed to the caller, whatever it is
            box["error"] = error

    worker = threading.Thread(target=target, name=name, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise Overran(seconds, worker.ident)
    if "error" in box:
        raise box["error"]
    return box["result"]
