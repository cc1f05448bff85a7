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
"""

from __future__ import annotations

import ctypes
import threading

from kvstate.spec.errors import RunTimeout

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
        self._timer: threading.Timer | None = None
        self._thread_id = 0
        self._refires = 1

    def __enter__(self) -> "Deadline":
        if self.seconds is not None:
            self._thread_id = threading.get_ident()
            self._arm(self.seconds)
        return self

    def _arm(self, seconds: float) -> None:
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if not self._done:
                self.fired = True
                _raise_in(self._thread_id, RunTimeout)
                if self._refires:       # in case it is dropped where it lands; ``__exit__`` cancels it
                    self._refires -= 1
                    self._arm(REFIRE_S)

    def __exit__(self, *exc_info) -> None:
        if self._timer is None:
            return
        with self._lock:
            self._done = True
            self._timer.cancel()
        if self.fired:
            _drain()


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


def in_daemon_thread(call, seconds: float, name: str):
    """``call()`` in a daemon thread: its result, or whatever it raised (re-raised here, ``SystemExit``
    included); past ``seconds``, ``Overran`` and the thread is abandoned. Unlike ``Deadline`` this
    cannot stop the call, only stop waiting for it: for a backend's import, its first cache, or a
    whole conformance check, which may hang where no exception can reach."""
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
