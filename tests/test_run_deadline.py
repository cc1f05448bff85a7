"""``stateful.deadline.Deadline`` (the sweep's and replay's time limit on one run) leaves nothing
behind in the process once its block ends, fired or not: other threads, profiled ones included,
run as before. It used to take a fired exception back with ``PyThreadState_SetAsyncExc(id, NULL)``,
which on CPython 3.11 leaves the interpreter's "asynchronous exception pending" flag up for good:
a thread started afterwards under a profile hook (the race tests' ``yielding_calls``) then looped
at its first call forever."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time

import pytest

from kvstate.spec.errors import RunTimeout
from kvstate.stateful import deadline as deadline_module
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


def test_a_timeout_dropped_where_it_landed_is_raised_again(monkeypatch):
    """The exception lands wherever the thread is: in a finalizer (a weakref callback, a ``__del__``)
    it is printed as "Exception ignored in ..." and dropped, as a Dask worker once showed for
    ``WeakSet._remove``, and the run went on past its deadline. Here the first one is dropped as a
    finalizer drops it; the block must still end in ``RunTimeout``, well before the loop gives up."""
    monkeypatch.setattr(deadline_module, "REFIRE_S", 0.05)
    dropped = []
    give_up = time.monotonic() + 10         # a bound on the loop where nothing stops it (the bug)
    with pytest.raises(RunTimeout):
        with Deadline(0.05) as deadline:
            while time.monotonic() < give_up:
                try:
                    while time.monotonic() < give_up:
                        pass
                except RunTimeout:
                    if dropped:
                        raise
                    dropped.append(time.monotonic())
    assert deadline.fired and len(dropped) == 1 and time.monotonic() < give_up
    assert _profiled_thread_finishes()      # and nothing is left pending


def test_a_deadline_fires_twice_at_most(monkeypatch):
    """A second exception can land at the entry of ``__exit__`` and escape the block (a review of the
    re-fire found it); a timer re-firing until the block was marked left then raised into the
    caller's code every second, forever. A block that drops every one it gets sees two."""
    monkeypatch.setattr(deadline_module, "REFIRE_S", 0.02)
    dropped = 0
    give_up = time.monotonic() + 0.5
    with Deadline(0.02) as deadline:
        while time.monotonic() < give_up:
            try:
                while time.monotonic() < give_up:
                    pass
            except RunTimeout:
                dropped += 1
    assert deadline.fired and dropped == 2


def test_every_deadline_of_a_process_shares_one_timer_thread():
    """A thread a deadline (``threading.Timer``) started and ended one for each of a shrink's
    hundreds of tries; a thread's start and end take the interpreter's thread-list lock, one of the
    three things a Dask worker's stall needed on CPython 3.11 (python/cpython#106883)."""
    before = set(threading.enumerate())
    with contextlib.ExitStack() as armed:
        for _ in range(20):
            armed.enter_context(Deadline(60))
        started = set(threading.enumerate()) - before
    assert len(started) <= 1        # the clock's thread, where no deadline had started it before


def test_a_deadline_armed_inside_a_longer_one_fires_at_its_own_time():
    # The clock's thread waits for the earliest deadline: a nearer one armed after must wake it.
    give_up = time.monotonic() + 10
    with Deadline(600) as outer:
        with pytest.raises(RunTimeout):
            with Deadline(0.05) as inner:
                while time.monotonic() < give_up:
                    pass
    assert inner.fired and not outer.fired and time.monotonic() < give_up
    assert _profiled_thread_finishes()


def _fires_in_a_forked_child() -> None:
    give_up = time.monotonic() + 10
    try:
        with Deadline(0.05):
            while time.monotonic() < give_up:
                pass
    except RunTimeout:
        os._exit(0)
    os._exit(1)


def test_a_deadline_fires_in_a_process_forked_after_the_clock_started():
    # The child has no copy of the parent's clock thread: it starts its own.
    with Deadline(60):
        pass        # the parent's clock is running
    child = multiprocessing.get_context("fork").Process(target=_fires_in_a_forked_child)
    child.start()
    child.join(30)
    assert child.exitcode == 0


@pytest.mark.parametrize("far", [1e10, float("inf")])
def test_a_deadline_past_the_longest_wait_leaves_the_clock_firing_the_next(far):
    """From a review: a deadline past ``threading.TIMEOUT_MAX`` (``--shrink-budget 1e10``, a journal's
    huge ``run_timeout``, ``inf`` from the API) made the clock's ``wait`` raise ``OverflowError`` outside
    any guard: its one thread died, still recorded as started, so no later deadline in the process
    fired again and a run looping in Python was never stopped. A clock of its own, not the process's."""
    clock = deadline_module._Clock()
    fired = threading.Event()
    clock.arm(far, lambda: None)
    time.sleep(0.05)        # the thread is now waiting for the far deadline
    clock.arm(0.05, fired.set)
    assert fired.wait(10) and clock._thread.is_alive()
