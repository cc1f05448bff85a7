"""The guard over a local pool's processes, kept outside them: in the sweep's own process.

A run stuck in C code that holds the GIL (a ``ctypes.PyDLL`` call that sleeps, a catastrophic
regular expression) stops every thread of its process, so no timer there can end it: the
``RunTimeout`` a ``Deadline`` raises and any "end this process" fallback are threads of the
stuck process too. So each pool process reports, in a row of a shared table, which task it
runs, since when, under which limit and which step it has reached (``begin``, ``step``); a
thread of the sweep's own process (``Watchdog``) reads the table and kills (SIGKILL) a process
``GRACE_S`` past its limit. Its pool then breaks, as for a crash, and ``stuck`` tells which task
was killed at which step: a ``RunTimeout`` of that seed (or a shrink cut short), not a crash.
The row also says at which step a process that died was (``last_step``).

In a process that is not a pool process of the sweep (the sweep's own, a Dask worker) the
calls here do nothing.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Callable

GRACE_S = 2.0
"""How long past its limit a task may run before the watchdog kills its process."""
POLL_S = 0.05

PID, JOB, STARTED, LIMIT, STEP, BORN = range(6)
WIDTH = 6

_table = None        # this pool process's pool's table, and this process's row in it
_row = -1
_job = -1.0


# -- in a pool process -------------------------------------------------------------------

def join(table, counter) -> None:
    """A pool process's initializer: take the next free row of ``table``."""
    global _table, _row
    with counter.get_lock():
        _row = counter.value
        counter.value += 1
    _table = table if _row < len(table) // WIDTH else None


def guarded(function: Callable, job: int, *args):
    """A pool task: ``function(*args)`` as task number ``job`` (what ``begin`` reports)."""
    global _job
    _job = float(job)
    try:
        return function(*args)
    finally:
        if _table is not None:
            _table[_row * WIDTH + STARTED] = 0.0
        _job = -1.0


def begin(limit_s: float | None) -> None:
    """The current task (or a new phase of it) starts now, to end within ``limit_s`` (None: no limit)."""
    if _table is None or _job < 0:
        return
    base = _row * WIDTH
    _table[base + STARTED] = 0.0
    _table[base + STEP] = 0.0
    _table[base + JOB] = _job
    _table[base + LIMIT] = -1.0 if limit_s is None else float(limit_s)
    _table[base + PID] = float(os.getpid())
    _table[base + BORN] = float(started_at(os.getpid()) or 0)
    _table[base + STARTED] = time.monotonic()


def step(number: int) -> None:
    """The current task is about to apply operation ``number`` (1-based)."""
    if _table is not None:
        _table[_row * WIDTH + STEP] = float(number)


# -- in the sweep's process --------------------------------------------------------------

class Watchdog:
    """The table of one executor's ``rows`` processes, and the thread that reads it."""

    def __init__(self, rows: int, stuck: dict[int, int]):
        self.rows = rows
        self.table = multiprocessing.RawArray("d", rows * WIDTH)
        self.counter = multiprocessing.Value("i", 0)
        self.stuck = stuck          # job -> the step its process was killed at (shared by a pool's watchdogs)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvstate-sweep-watchdog", daemon=True)
        self._thread.start()

    @property
    def initargs(self) -> tuple:
        return (self.table, self.counter)

    def last_step(self, job: int) -> int | None:
        """The step the process that ran task ``job`` last reported (None: no row names it)."""
        for row in range(self.rows):
            base = row * WIDTH
            if self.table[base + PID] and int(self.table[base + JOB]) == job:
                return int(self.table[base + STEP])
        return None

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_S):
            for row in range(self.rows):
                self._check(row * WIDTH)

    def _check(self, base: int) -> None:
        started, limit = self.table[base + STARTED], self.table[base + LIMIT]
        if not started or limit < 0 or time.monotonic() - started <= limit + GRACE_S:
            return
        job, pid, at = int(self.table[base + JOB]), int(self.table[base + PID]), int(self.table[base + STEP])
        if self.table[base + STARTED] != started or int(self.table[base + JOB]) != job:
            return          # it moved on meanwhile
        if not alive(pid, int(self.table[base + BORN])):
            # Its process died (a crash) and left the row started: that is a ``ProcessDied``, not a
            # task stuck, and the pid, reaped, may be another process's by now. The row is cleared.
            if self.table[base + STARTED] == started:
                self.table[base + STARTED] = 0.0
            return
        self.stuck[job] = at
        self.table[base + STARTED] = 0.0
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the process's name (state first); None where it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()     # the name, before it, may hold anything
    except OSError:
        return None


def started_at(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux; None elsewhere or where it is gone):
    with its pid, it names one process, whose pid a later one may reuse."""
    fields = _stat(pid) if os.path.isdir("/proc/self") else None
    return int(fields[19]) if fields else None


def alive(pid: int, born: int = 0) -> bool:
    """Whether the process ``pid``, started at ``born`` (``started_at``; 0: not known), still runs: on
    Linux, ``/proc/<pid>/stat`` is there, not a zombie's (dead, not yet reaped), and, where ``born`` is
    known, of a process started then (not another one that reuses the pid). Elsewhere, whether some
    process has that pid and this one may signal it. A pool process may be this process's child (fork)
    or the fork server's (forkserver): its parent is not checked."""
    if pid <= 0:
        return False
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):    # gone, or not ours to signal
            return False
        return True
    fields = _stat(pid)
    return fields is not None and fields[0] != b"Z" and (not born or int(fields[19]) == born)
