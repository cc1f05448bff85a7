"""A total deadline for one remote operation (a restore, a snapshot, a store's lookup), over every attempt.

Socket timeouts bound one wait and retries multiply them: against an S3 endpoint that
accepts connections and never answers, 4 attempts x s3fs's retries x botocore's retries x
15 s read timeouts took 27 minutes. A ``Deadline`` bounds the whole operation instead. Each
blocking call of the operation (opening, a ranged read, an upload, a HEAD) runs on the
operation's own daemon thread (``Worker``) and the caller waits for it at most the time
left; past it the caller gets ``SnapshotDeadlineError`` naming the deadline that ran out.

Giving up on a call is safe because the calls only move bytes: a restore parses and adopts
in the caller's thread, after everything was read and checked, so an abandoned read changes
no cache; an abandoned upload is aborted (or its temporary key removed) once the stuck call
returns, and it never completed, except the final publishing call itself, whose outcome the
error then says is unknown.

Which deadline applies, most specific first: one passed to the call (``deadline_s=``), the
cache's (``Cache(remote_deadline_s=...)``: its restores from and snapshots to URLs, and its
second tier), the ``SnapshotStore``'s own (``SnapshotStore(deadline_s=...)``), the innermost
``within(seconds)`` block around the call (``kvstate.remote.deadline``; never past an enclosing
block's end), else ``DEFAULT_DEADLINE_S``.
"""

from __future__ import annotations

import contextvars
import math
import os
import queue
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from kvstate.spec.errors import InvalidInputError, SnapshotDeadlineError

T = TypeVar("T")

DEFAULT_DEADLINE_S = 30.0
"""Seconds one remote operation may take in all, retries included, when nothing else is said."""

LONGEST_WAIT = 365 * 86400.0

# The names by which an error says which deadline ran out.
CALL = "deadline_s of this call"
CACHE = "cache's deadline (Cache remote_deadline_s)"
STORE = "store's deadline (SnapshotStore deadline_s)"

_BLOCK: contextvars.ContextVar["Deadline | None"] = contextvars.ContextVar("kvstate_remote_deadline", default=None)


class Deadline:
    """An end time, and the name by which an error says which deadline ran out."""

    def __init__(self, seconds: float, name: str):
        check_seconds(seconds, name)
        self.seconds, self.name = float(seconds), name
        self.ends = time.monotonic() + self.seconds

    def left(self) -> float:
        """Seconds left, at most ``LONGEST_WAIT``: any wait longer overflows the platform's time_t
        (``Event.wait(2**70)`` raises ``OverflowError``), and a year is no deadline in practice."""
        return min(max(0.0, self.ends - time.monotonic()), LONGEST_WAIT)

    def error(self, doing: str) -> SnapshotDeadlineError:
        return SnapshotDeadlineError(f"{doing}: the {self.name} of {self.seconds:g} s ran out; nothing was "
                                     f"changed here", deadline=self.name)


def check_seconds(seconds, name: str, error: type[InvalidInputError] = InvalidInputError) -> None:
    # Compared as the float ``Deadline`` keeps: an int past float's range (2**1100) passed ``< inf`` and then
    # made every remote call raise a bare OverflowError (an outside audit, s70).
    try:
        finite = not isinstance(seconds, bool) and isinstance(seconds, (int, float)) and 0 < float(seconds) < math.inf
    except OverflowError:
        finite = False
    if not finite:
        raise error(f"{name} must be a positive number of seconds, got {seconds!r}")


def resolve(deadline: "Deadline | float | None", name: str = CALL) -> Deadline:
    """The deadline an operation runs under: ``deadline`` (a ``Deadline`` or seconds), else the
    innermost ``within`` block's, else ``DEFAULT_DEADLINE_S``."""
    if isinstance(deadline, Deadline):
        return deadline
    if deadline is not None:
        return Deadline(deadline, name)
    block = _BLOCK.get()
    if block is not None:
        return block
    return Deadline(DEFAULT_DEADLINE_S, "default deadline (kvstate.impl.remote_deadline.DEFAULT_DEADLINE_S)")


def first_set(*choices: tuple[float | None, str]) -> Deadline | None:
    """The first ``(seconds, name)`` whose seconds are set, as a ``Deadline``, most specific first;
    ``None`` when none is (``resolve`` then takes the block's or the default, when the operation runs)."""
    for seconds, name in choices:
        if seconds is not None:
            return Deadline(seconds, name)
    return None


@contextmanager
def within(seconds: float) -> Iterator[Deadline]:
    """Every remote operation in this block (of this thread or task) shares one deadline of
    ``seconds``, unless the call or its store names its own. A block inside another never outlasts
    it: where the enclosing block ends first, its deadline goes on applying (a library's own
    ``deadline(30)`` cannot stretch a caller's ``deadline(2)``)."""
    deadline = Deadline(seconds, "deadline of the enclosing kvstate.remote.deadline() block")
    enclosing = _BLOCK.get()
    if enclosing is not None and enclosing.ends < deadline.ends:
        deadline = enclosing
    token = _BLOCK.set(deadline)
    try:
        yield deadline
    finally:
        _BLOCK.reset(token)


# Calls abandoned at their deadline whose threads still wait on a server, in this process. Past this
# many, no new call is sent until one returns: a server that stays hung would otherwise collect a
# thread and a socket for every lookup made against it (an audit counted 40 after five lookups).
# Each server has a cap of its own below the process's, so one that stays hung (a second tier's)
# cannot stop every call to healthy ones (an audit's parking on a healthy bucket was refused for
# minutes once a hung tier had filled one shared cap). Only calls already abandoned count: those sent
# before the first one ran out are not held back (32 lookups at once left 256 threads waiting).
MAX_STUCK_CALLS = 64
MAX_STUCK_PER_SERVER = 16
_stuck = {"calls": 0}
_stuck_by_server: dict[str, int] = {}
_stuck_lock = threading.Lock()


def stuck_calls() -> int:
    """How many abandoned calls are still waiting on a server."""
    return _stuck["calls"]


def _forget_parents_calls() -> None:
    """In a forked child: the parent's abandoned calls wait on threads the child does not have, so
    nothing would ever uncount them (a child forked while 16 waited was refused by that server for
    good). A lock another thread held at the fork would never be released either."""
    global _stuck_lock
    _stuck_lock = threading.Lock()
    _stuck["calls"] = 0
    _stuck_by_server.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parents_calls)


class Worker:
    """A daemon thread running one operation's blocking calls in order; the caller waits for each at
    most the deadline's time left. Once a call overran, the worker is stuck: further ``call``\\s fail
    at once and ``later`` queues clean-up to run if the stuck call ever returns. While
    ``MAX_STUCK_CALLS`` abandoned calls still wait, a new operation's first call fails at once,
    sending nothing; the calls of one under way (its reads, its publishing call, its clean-up) go
    on. A stuck worker counts as one abandoned call until its queue is done, not only until the
    call that overran returns: clean-up queued behind it with ``later`` may hang on the same server.
    (Clean-up queued after that call has already returned runs uncounted: by then the server answered.)"""

    def __init__(self, deadline: Deadline, doing: str, server: str = ""):
        self.deadline, self.doing, self.server = deadline, doing, server
        self.stuck = False
        self._counted = False            # this worker's abandoned call is in its tally
        self._tally = _stuck             # the tally it counts in, and uncounts from
        self._by_server = _stuck_by_server      # and its server's
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def call(self, function: Callable[..., T], *args, **kwargs) -> T:
        if self.stuck or self.deadline.left() <= 0:
            raise self.deadline.error(self.doing)
        waiting, here = self._tally["calls"], self._by_server.get(self.server, 0)
        if self._thread is None and (waiting >= MAX_STUCK_CALLS or here >= MAX_STUCK_PER_SERVER):    # a new operation
            where = (f"{here} earlier calls still wait on this server (at most {MAX_STUCK_PER_SERVER} a server)"
                     if here >= MAX_STUCK_PER_SERVER else
                     f"{waiting} earlier calls still wait on servers that have not answered (at most {MAX_STUCK_CALLS})")
            raise SnapshotDeadlineError(f"{self.doing}: {where}; nothing was sent and nothing was changed here",
                                        deadline=self.deadline.name)
        box: dict = {}
        done = threading.Event()
        self._put((function, args, kwargs, box, done))
        if not done.wait(self.deadline.left()):
            with _stuck_lock:           # against the call finishing now: counted once, uncounted once
                if not done.is_set():
                    self.stuck = self._counted = True
                    self._tally["calls"] += 1
                    self._by_server[self.server] = self._by_server.get(self.server, 0) + 1
            if self.stuck:
                raise self.deadline.error(self.doing)
        if "error" in box:
            raise box["error"]
        return box["result"]

    def later(self, function: Callable, *args) -> None:
        """Run ``function`` when the calls before it are done, without waiting for it."""
        self._put((function, args, {}, {}, threading.Event()))

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)

    def _put(self, job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvstate-remote-io", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            function, args, kwargs, box, done = job
            try:
                box["result"] = function(*args, **kwargs)
            except BaseException as error:      # handed to the waiting caller, whatever it is
                box["error"] = error
            with _stuck_lock:
                done.set()
                if self._jobs.empty():          # nothing queued behind it: an abandoned call is over
                    self._uncount()
        with _stuck_lock:                       # closed: whatever ran last has returned
            self._uncount()

    def _uncount(self) -> None:
        """This worker's abandoned call out of the tally, once (under ``_stuck_lock``)."""
        if self._counted:
            self._counted = False
            self._tally["calls"] -= 1
            left = self._by_server[self.server] - 1
            if left:
                self._by_server[self.server] = left
            else:
                del self._by_server[self.server]        # servers that answered leave no entry behind


class Bounded:
    """A file object whose blocking methods run on ``worker``, so each is bounded by its deadline."""

    def __init__(self, file, worker: Worker):
        self._file, self._worker = file, worker

    def read(self, *args):
        return self._worker.call(self._file.read, *args)

    def readinto(self, buffer):
        return self._worker.call(self._file.readinto, buffer)

    def write(self, data):
        return self._worker.call(self._file.write, data)

    def flush(self):
        return self._worker.call(self._file.flush)

    def seek(self, *args):
        return self._worker.call(self._file.seek, *args)

    def tell(self):
        return self._file.tell()

    def seekable(self):
        return self._file.seekable()

    def fileno(self):
        import io
        raise io.UnsupportedOperation("a remote object has no file descriptor")

    def __getattr__(self, name):
        return getattr(self._file, name)
