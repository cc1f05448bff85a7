"""``stateful.deadline.Deadline`` (the sweep's and replay's time limit on one run) leaves nothing
behind in the process once its block ends, fired or not: other threads, profiled ones included,
run as before. It used to take a fired exception back with ``PyThreadState_SetAsyncExc(id, NULL)``,
which on CPython 3.11 leaves the interpreter's "asynchronous exception pending" flag up for good:
a thread started afterwards under a profile hook (the race tests' ``yielding_calls``) then looped
at its first call forever."""

from __future__ import annotations

import threading

import pytest

from kvstate.spec.errors import RunTimeout
from kvstate.stateful.deadline import Deadline


def _spin():
    while True:
        pass


def _profiled_thread_finishes() -> bool:
    """Whether a thread started under a (do-nothing) profile hook runs its few calls to the end.
    The join's 10 s is only a bound on a hang, not a measurement."""
    def work():
        for _ in range(3):
            (lambda: None)()
    worker = threading.Thread(target=work, daemon=True)
    previous = threading.getprofile()
    threading.setprofile(lambda frame, event, arg: None)
    try:
        worker.start()
    finally:
        threading.setprofile(previous)
    worker.join(10)
    return not worker.is_alive()


def test_a_fired_deadline_stops_the_run_and_leaves_other_threads_running():
    with Deadline(0.05) as deadline:
        with pytest.raises(RunTimeout):
            _spin()
    assert deadline.fired
    assert _profiled_thread_finishes()


def test_a_deadline_that_did_not_fire_leaves_nothing_pending():
    with Deadline(60) as deadline:
        pass
    assert not deadline.fired
    for _ in range(1000):       # a stray exception would land at one of these jumps
        pass
    assert _profiled_thread_finishes()
