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

A Dask worker keeps the same table, one row per worker thread, in a file its nanny maps too
(``table_file``): the nanny is the process outside the stuck one there (nanny_watch.py). A row
names its task's thread too (``TID``): in a worker of several threads the nanny tells a task stuck
in C from one only waiting for the GIL that C code holds (``wakes``).
In any other process (the sweep's own, a worker without a nanny) the calls here do nothing.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

GRACE_S = 2.0
"""How long past its limit a task may run before the watchdog kills its process."""
POLL_S = 0.05

PID, JOB, STARTED, LIMIT, STEP, BORN, TID = range(7)
WIDTH = 7

_table = None        # the table this process's rows are in (a pool's, or a Dask worker's file)
_free: list[int] = []    # those rows not held by a running task
_mine = threading.local()      # .row, .job: the row and task number of the task this thread runs


# -- in a pool process or a Dask worker ----------------------------------------------------

def join(table, counter) -> None:
    """A pool process's initializer: take the next free row of ``table``."""
    with counter.get_lock():
        row = counter.value
        counter.value += 1
    if row < len(table) // WIDTH:
        use(table, [row])


def use(table, rows) -> None:
    """This process's tasks report in ``rows`` of ``table``, one running task to a row."""
    global _table, _free
    _table, _free = table, list(rows)


def watched() -> bool:
    """Whether this process's tasks report to a watchdog (``join`` or ``use`` gave it a table)."""
    return _table is not None


def guarded(function: Callable, job: int, *args):
    """A task: ``function(*args)`` as task number ``job`` (what ``begin`` reports), in a row of its own
    while it runs (a Dask worker runs one task in each of its threads); none where all are held."""
    row = _take_row()
    _mine.row, _mine.job = row, float(job)
    try:
        return function(*args)
    finally:
        _mine.row, _mine.job = None, -1.0
        if row is not None:
            _table[row * WIDTH + STARTED] = 0.0
            _table[row * WIDTH + JOB] = -1.0        # the task is over: ``still_running`` says so
            _free.append(row)


def _take_row() -> int | None:
    try:
        return _free.pop() if _table is not None else None
    except IndexError:          # more threads than rows: this task goes unwatched
        return None


def begin(limit_s: float | None) -> None:
    """The current task (or a new phase of it) starts now, to end within ``limit_s`` (None: no limit)."""
    row = getattr(_mine, "row", None)
    if row is None:
        return
    base = row * WIDTH
    _table[base + STARTED] = 0.0
    _table[base + STEP] = 0.0
    _table[base + JOB] = _mine.job
    _table[base + LIMIT] = -1.0 if limit_s is None else float(limit_s)
    _table[base + PID] = float(os.getpid())
    _table[base + BORN] = float(started_at(os.getpid()) or 0)
    _table[base + TID] = float(threading.get_native_id())      # its thread, which a nanny may look at (``wakes``)
    _table[base + STARTED] = time.monotonic()


def step(number: int) -> None:
    """The current task is about to apply operation ``number`` (1-based)."""
    row = getattr(_mine, "row", None)
    if row is not None:
        _table[row * WIDTH + STEP] = float(number)


def table_file(path: Path, rows: int | None = None):
    """The table in the file at ``path``, mapped into this process: made anew with ``rows`` rows, or
    (None) as found; None where it cannot be. Every process that maps it shares it: a Dask worker's
    tasks write their rows, its nanny reads them. Times are ``time.monotonic()``, one clock for the
    whole machine on Linux."""
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | (os.O_CREAT | os.O_EXCL if rows is not None else 0)
    try:
        if rows is not None:
            path.unlink(missing_ok=True)        # a worker's that had this pid before
        descriptor = os.open(path, flags, 0o600)
    except OSError:
        return None
    try:
        if rows is not None:
            os.ftruncate(descriptor, rows * WIDTH * 8)
        found = os.fstat(descriptor)
        if not found.st_size or found.st_size % (WIDTH * 8) or found.st_uid != os.getuid():
            return None                         # still being made, or not one of ours
        return memoryview(mmap.mmap(descriptor, found.st_size)).cast("d")
    except OSError:
        return None
    finally:
        os.close(descriptor)


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
        found = overdue(self.table, base)
        if found is None:
            return
        job, pid, at = found
        self.stuck[job] = at
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def late(table, base: int) -> bool:
    """Whether the task in the row at ``base`` still runs ``GRACE_S`` past its limit (``overdue`` without
    judging it: the row is left as it is)."""
    started, limit = table[base + STARTED], table[base + LIMIT]
    return bool(started) and limit >= 0 and time.monotonic() - started > limit + GRACE_S


def wakes(pid: int, tid: int) -> int | None:
    """How many times thread ``tid`` of process ``pid`` has given up the CPU of its own accord
    (``voluntary_ctxt_switches``, Linux; None elsewhere or where it is gone). A thread waiting for the GIL
    wakes every switch interval (5 ms) to ask for it, however long another thread holds it; one blocked
    in C (a sleep, a read) or spinning there does not."""
    try:
        with open(f"/proc/{pid}/task/{tid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def overdue(table, base: int) -> tuple[int, int, int] | None:
    """(task number, pid, step) of the task in the row at ``base`` where it still runs ``GRACE_S`` past
    its limit, its row cleared so that it is judged once; else None. Who reads it ends that process."""
    started, limit = table[base + STARTED], table[base + LIMIT]
    if not started or limit < 0 or time.monotonic() - started <= limit + GRACE_S:
        return None
    job, pid, at = int(table[base + JOB]), int(table[base + PID]), int(table[base + STEP])
    if table[base + STARTED] != started or int(table[base + JOB]) != job:
        return None         # it moved on meanwhile
    if not alive(pid, int(table[base + BORN])):
        # Its process died (a crash) and left the row started: that is a ``ProcessDied``, not a
        # task stuck, and the pid, reaped, may be another process's by now. The row is cleared.
        if table[base + STARTED] == started:
            table[base + STARTED] = 0.0
        return None
    table[base + STARTED] = 0.0
    return job, pid, at


def still_running(table, base: int, job: int, pid: int) -> bool:
    """Whether task ``job``, which ``overdue`` found in the row at ``base``, still runs there in process
    ``pid``: it has not returned (``guarded`` clears the row's task) and its process is the one it was."""
    return (int(table[base + JOB]) == job and int(table[base + PID]) == pid
            and alive(pid, int(table[base + BORN])))


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
