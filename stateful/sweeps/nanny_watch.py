"""The watchdog of a sweep on Dask: each worker's nanny ends its worker's run stuck in C.

A run's ``--run-timeout`` interrupts Python code on a worker, but nothing reaches a thread blocked
in C, and Dask cannot cancel a running task: the worker thread stayed taken and the sweep waited
for good. C code that holds the GIL stops every thread of the worker process, so the watch must
live outside it, as the local pool's does (watchdog.py); on Dask that process is the worker's
nanny, which started the worker and starts it again when it dies. So:

- the worker (``watch_worker``, called by the sweep's gate before the worker may get a run) keeps
  the watchdog's table in a file named after its pid, one row per thread: each sweep task
  (``watchdog.guarded``) reports there, as in a pool process, which task it runs, since when
  (measured on the worker, where it starts: a run queued behind a stuck one is not charged for it),
  under which limit, and the step it has reached;
- the nanny (``StuckRunWatch``, a Dask nanny plugin) reads its own worker's table and, for the tasks
  ``watchdog.GRACE_S`` past their limit, tells the sweep (an event naming each task and its step)
  and then, if one of them still runs, kills the worker process, which it starts again;
- the sweep (cluster.WatchedExecutor) ends that run's future as ``Stuck``, a ``RunTimeout`` of its
  seed saved at its step, and cancels the Dask task: Dask would run it again on another worker,
  stuck again each time, until ``allowed-failures``.

A worker without a nanny has nobody outside it to end it, nor to start it again: it is not
watched, and the sweep says so when it joins.
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
from pathlib import Path

from distributed import NannyPlugin
from tornado.ioloop import PeriodicCallback

from . import watchdog

TOPIC = "kvstate-sweep-watch-1"
"""The plugin's name and the topic of its events: one watch per nanny, whatever code sweeps. The
number is the table's format (``watchdog``'s rows): the plugin is idempotent and stays registered on
the scheduler, so a kvstate whose table differs must register under another name, beside the old
watch, or the old one would go on reading tables it does not understand."""
SETTLE_S = 0.5
"""How long the nanny waits between telling the sweep and killing the worker: the sweep cancels the
stuck task first, so that Dask does not hand it, on the worker's death, to another worker."""
REPORT_TIMEOUT_S = 5.0


def table_path(pid: int) -> Path:
    """Where the worker process ``pid`` keeps its table: known to it and to its nanny."""
    return Path(tempfile.gettempdir()) / f"{TOPIC}-{pid}"


# -- in a worker process -------------------------------------------------------------------

def watch_worker(worker) -> str | None:
    """This worker's tasks reported where its nanny reads them: None; or why they cannot be, said of the
    worker (``has no nanny``, or the table its nanny would read could not be made)."""
    if not worker.nanny:
        return "has no nanny"
    if not watchdog.watched():          # once a process: the gates of sweeps of other code share it
        path = table_path(os.getpid())
        table = watchdog.table_file(path, worker.state.nthreads)
        if table is None:
            return (f"cannot be watched by its nanny: the table it would read, {path}, could not be made "
                    "(a temporary folder it cannot write, or a file of that name another user's)")
        watchdog.use(table, range(worker.state.nthreads))
    return None


# -- in a nanny ----------------------------------------------------------------------------

class StuckRunWatch(NannyPlugin):
    name = TOPIC
    idempotent = True           # a second sweep's registration leaves the running watch alone

    def setup(self, nanny) -> None:
        self.nanny = nanny
        self.pid: int | None = None         # the worker process whose table is open
        self.table = None
        self.callback = PeriodicCallback(self.check, watchdog.POLL_S * 1000)
        self.callback.start()

    def teardown(self, nanny) -> None:
        self.callback.stop()
        self.pid, self.table = None, None

    async def check(self) -> None:
        pid = self.nanny.pid
        if pid != self.pid:
            self._follow(pid)
        if self.table is None:
            return
        # Every overdue run of the worker, told before the one kill that ends them all: one left untold was
        # run again by Dask on another worker, stuck there too, and took that worker down in turn.
        stuck = []
        for base in range(0, len(self.table), watchdog.WIDTH):
            found = watchdog.overdue(self.table, base)
            if found is not None and found[1] == pid:       # only ever its own worker process
                stuck.append((base, found[0], found[2]))
        if stuck:
            await self._end(pid, stuck)

    def _follow(self, pid: int | None) -> None:
        """The worker process is now ``pid`` (None: none runs): its table, once its gate has made it."""
        self.table = watchdog.table_file(table_path(pid)) if pid else None
        self.pid = pid if self.table is not None else None
        if self.pid is not None:
            # Both processes have it mapped: the name was only where they meet, and a worker or nanny
            # killed outright leaves no file behind.
            table_path(pid).unlink(missing_ok=True)

    async def _end(self, pid: int, stuck: list[tuple[int, int, int]]) -> None:
        """Tell the sweep that each task of ``stuck`` (its row, number and step) is stuck, then kill worker ``pid``
        (restarted by this nanny) if one of them still runs there: tasks that all returned while the sweep was
        told (each recorded as stuck all the same, past its limit) leave the worker to the tasks it runs now,
        another sweep's perhaps."""
        try:
            for _, job, step in stuck:
                await asyncio.wait_for(self.nanny.scheduler.log_event(
                    topic=TOPIC, msg={"worker": self.nanny.worker_address, "job": job, "step": step}),
                    REPORT_TIMEOUT_S)
            await asyncio.sleep(SETTLE_S)
        except Exception:       # noqa: BLE001 -- a scheduler that cannot be told: the worker is freed all the same
            pass
        if self.nanny.pid != pid or not any(watchdog.still_running(self.table, base, job, pid)
                                            for base, job, _ in stuck):
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
