"""Ending the ``kvstate`` command when C code holds the interpreter past a stage's limit.

The command waits for a backend's import, its first cache and each conformance check in a daemon
thread (``deadline.in_daemon_thread``), so a backend that hangs in Python is reported after the
stage's limit and the command goes on. Where the backend is stuck in C code that holds the GIL (a
``ctypes.PyDLL`` call that blocks, a lock taken in an extension that never lets the GIL go), no
thread of the command's process runs again: not the waiting one, not a timer, not a SIGTERM
handler, and the command hung for good, printing nothing.

So the command's own process (``enable``, from ``cli.main``; never a library caller's, a test's or
a pool worker's) has a small watcher process outside it, started at the first stage it guards
(``guarding``). Each stage tells it "this stage, this limit" and "done" over a pipe; a stage still
not done by twice its limit (``grace``) means the process could not even report its own timeout, and
the watcher prints which stage held it and ends the command (SIGTERM, then SIGKILL: a Python SIGTERM
handler does not run either). The watcher ends with the command: its pipe closes, or its parent
is gone (checked every second, since a forked child may hold the pipe open).
"""

from __future__ import annotations

import atexit
import itertools
import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

GRACE_S = 30.0
"""A stage is ended once it has run past its limit by its limit again, and by at least this: a C call
that holds the interpreter for seconds and then returns (an extension's start-up) is a slow check,
for the stage's own timeout to report, not one stuck for good (a grace of 5 s ended correct runs)."""


def grace(seconds: float) -> float:
    return max(GRACE_S, seconds)

# Run as ``python -I -S -c WATCHER <parent pid> report|quiet``: no site, no kvstate import, started in milliseconds.
WATCHER = r"""
import os, select, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)     # a terminal's Ctrl-C reaches the whole group: the command's to handle
parent, armed, pending, done = int(sys.argv[1]), {}, b"", False


def stopped():      # the command paused (SIGSTOP, a debugger's attach): no time of its stages runs out
    try:
        with open("/proc/%d/stat" % parent, "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


last = time.monotonic()
while not done:     # what the pipe holds is read first: a command that ended at once still told its stage
    soonest = min((entry[0] for entry in armed.values()), default=None)
    wait = 1.0 if soonest is None else min(1.0, max(0.0, soonest - time.monotonic()))
    if select.select([0], [], [], wait)[0]:
        chunk = os.read(0, 4096)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            verb, key, *rest = line.decode("utf-8", "replace").split(" ", 4)
            if verb == "arm":
                armed[key] = (time.monotonic() + float(rest[0]), rest[1], rest[2])
            elif verb == "exit":        # the command is leaving: a forked child of it may keep the pipe open
                done = True
            else:
                armed.pop(key, None)
        continue
    if os.getppid() != parent:      # gone, though a forked child of it may hold the pipe open
        break
    now = time.monotonic()
    if stopped():       # every deadline moves on by the time it stood still
        armed = {key: (due + now - last, limit, what) for key, (due, limit, what) in armed.items()}
    last = now
    late = [(limit, what) for due, limit, what in armed.values() if due <= time.monotonic()]
    if late:
        ended = "the command is ended" if sys.argv[2] == "report" else "this worker process is ended"
        os.write(2, ("kvstate: %s did not finish within %s s; C code holds the interpreter (the GIL), so nothing "
                     "in the process can report it or stop it: %s\n" % (late[0][1], late[0][0], ended)
                     ).encode("utf-8", "replace"))
        armed.clear()
        for sig, then in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 0.0)):
            try:
                os.kill(parent, sig)
            except ProcessLookupError:
                break
            time.sleep(then)
            if os.getppid() != parent:
                break
        break
for _due, _limit, what in list(armed.values())[:1] if sys.argv[2] == "report" else ():     # gone mid-stage
    os.write(2, ("kvstate: the command's process ended during %s, before it could report (an os._exit or a "
                 "crash in the backend, or a kill from outside): no verdict was reached\n" % what
                 ).encode("utf-8", "replace"))
"""

_lock = threading.Lock()
_keys = itertools.count()
_owner: int | None = None        # the pid of the process ``enable`` was called in
_report_an_end = True            # say so where the process ends inside a stage (see ``enable``)
_watcher: subprocess.Popen | None = None
_stages: dict[int, tuple[str, int | None]] = {}     # the stages running here: what, and the watcher's key
_stage_numbers = itertools.count()
_status: int | None = None       # the command's exit status, once it has one (``settled``)
ENDED_BEFORE_A_VERDICT = 1       # the status an ``os._exit(0)`` gets before the command has its own
_os_exit = os._exit


def enable(report_an_end: bool = True) -> None:
    """Guard this process's stages from here on: for the ``kvstate`` command's own process, and for
    conform's worker processes, whose end inside a stage their pool reports itself (``report_an_end``
    False: a Ctrl-C that ended them read as the backend's crash). In the command's own process,
    ``os._exit(0)`` no longer passes for success (``_exit_with_the_verdict``)."""
    global _owner, _report_an_end
    if os.name == "posix":       # (``select`` on a pipe; elsewhere the stages are guarded as before)
        _owner, _report_an_end = os.getpid(), report_an_end
        if report_an_end:
            os._exit = _exit_with_the_verdict


def settled(status: int) -> None:
    """The command's exit status is ``status``: an ``os._exit(0)`` from here on (a thread the backend
    left running, an exit hook) ends the process with it."""
    global _status
    _status = status


def _exit_with_the_verdict(status: int) -> None:
    """``os._exit`` in the command's own process. A backend that called ``os._exit(0)`` part way
    through a check ended ``kvstate conform`` with status 0, a pass to any CI job, though no verdict
    was reached. So a 0 asked for before the command has its status is ``ENDED_BEFORE_A_VERDICT``,
    said in one line naming the stage it ended (the watcher is told, so it says nothing more); after,
    the command's own status. Any other status, and any other process (a child forked from here ends
    through this function too), go through unchanged."""
    if status == 0 and os.getpid() == _owner:
        if _status is not None:
            status = _status
        else:
            status = ENDED_BEFORE_A_VERDICT
            stages = list(_stages.values())
            during = f" during {stages[0][0]}" if stages else " (by the backend, or code it ran)"
            for _what, key in stages:
                if key is not None:
                    _send(f"off {key}")
            try:
                os.write(2, (f"kvstate: os._exit(0) was called{during}, so the command ended before a verdict "
                             f"was reached: exit status {status}\n").encode("utf-8", "replace"))
            except OSError:
                pass
    _os_exit(status)


@contextmanager
def guarding(seconds: float, what: str) -> Iterator[None]:
    """The block is a stage that should end within ``seconds``: past ``seconds + grace(seconds)`` with the
    interpreter held, the watcher ends the command, naming ``what``. Does nothing unless ``enable``d
    in this very process."""
    if _owner != os.getpid():
        yield
        return
    key, number = _arm(seconds, what), next(_stage_numbers)
    _stages[number] = (" ".join(str(what).split()), key)
    try:
        yield
    finally:
        del _stages[number]
        if key is not None:
            _send(f"off {key}")


def _arm(seconds: float, what: str) -> int | None:
    global _watcher
    with _lock:
        if _watcher is None or _watcher.poll() is not None:
            try:
                _watcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", WATCHER, str(os.getpid()),
                                             "report" if _report_an_end else "quiet"],
                                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
            except OSError:      # no watcher (no processes left, say): the stage runs unguarded, as before
                return None
            atexit.register(_stop, _watcher)
    key = next(_keys)
    what = " ".join(str(what).split())      # one line
    return key if _send(f"arm {key} {seconds + grace(seconds)!r} {seconds:g} {what}") else None


def _stop(watcher: subprocess.Popen) -> None:
    """At exit: the watcher told (its pipe closed) and waited for, not left for init to reap."""
    try:
        _send("exit 0", watcher)    # not only the pipe's end: a process the backend forked may hold it open
        watcher.stdin.close()
        watcher.wait(1)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass


def _send(line: str, watcher: subprocess.Popen | None = None) -> bool:
    """One line to the watcher (this process's, by default), in one write (shorter than a pipe's atomic
    size): False if it is gone."""
    watcher = watcher or _watcher
    try:
        os.write(watcher.stdin.fileno(), (line[:1000] + "\n").encode("utf-8", "replace"))
        return True
    except (OSError, ValueError, AttributeError):      # it ended, or its pipe was closed
        return False
