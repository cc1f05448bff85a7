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
  under which limit, and the step it has reached. The worker hands the file's path to its nanny
  (``Nanny.run``, what ``Client.run(nanny=True)`` uses) and its tasks report there only once the
  nanny has answered that it has the table mapped. Neither side derives the other's path: a worker
  whose nanny gave it another TMPDIR (``env``, ``distributed.nanny.environ``) made its table where
  a nanny looking in its own temporary folder never found it, and a run stuck there hung the sweep
  without a word. A nanny that cannot map it (another file system at that path, no watch plugin)
  says why, and the sweep names the worker as unwatched;
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

TOPIC = "kvstate-sweep-watch-2"
"""The plugin's name and the topic of its events: one watch per nanny, whatever code sweeps. The
number is the format of the table (``watchdog``'s rows) and of the way worker and nanny meet (2: the
worker hands its nanny the table's path; 1: each side derived it from its own temporary folder): the
plugin is idempotent and stays registered on the scheduler, so a kvstate whose table or handshake
differs must register under another name, beside the old watch, or the old one would go on reading
tables it does not understand."""
SETTLE_S = 0.5
"""How long the nanny waits between telling the sweep and killing the worker: the sweep cancels the
stuck task first, so that Dask does not hand it, on the worker's death, to another worker."""
REPORT_TIMEOUT_S = 5.0
HANDOVER_TIMEOUT_S = 10.0
"""How long a worker waits for its nanny's answer that it has the worker's table mapped."""


def table_path(pid: int) -> Path:
    """Where the worker process ``pid`` makes its table: in its own temporary folder. Only the worker
    derives it; its nanny is told the path (``watch_worker``), whatever its own temporary folder."""
    return Path(tempfile.gettempdir()) / f"{TOPIC}-{pid}"


# -- in a worker process -------------------------------------------------------------------

_handover = None        # (event loop, the task of this process's first handover): later gates share its answer


async def watch_worker(worker) -> str | None:
    """This worker's tasks reported where its nanny reads them: None; or why they cannot be, said of the
    worker (``has no nanny``, or ``cannot be watched by its nanny: ...``: the table could not be made, or
    its nanny could not map it). Once a process: the gates of sweeps of other code share the answer."""
    global _handover
    if not worker.nanny:
        return "has no nanny"
    loop = asyncio.get_running_loop()
    if _handover is None or _handover[0] is not loop:
        _handover = (loop, asyncio.ensure_future(_hand_over(worker)))
    return await asyncio.shield(_handover[1])


async def _hand_over(worker) -> str | None:
    path = table_path(os.getpid())
    table = watchdog.table_file(path, worker.state.nthreads)
    if table is None:
        return (f"cannot be watched by its nanny: the table it would read, {path}, could not be made "
                "(a temporary folder it cannot write, or a file of that name another user's)")
    refused = await _ask_nanny(worker, path)
    if refused is not None:
        path.unlink(missing_ok=True)
        return f"cannot be watched by its nanny: {refused}"
    watchdog.use(table, range(worker.state.nthreads))
    return None


async def _ask_nanny(worker, path: Path) -> str | None:
    """Have ``worker``'s nanny map the table at ``path``: None once it has; else why not."""
    from distributed.protocol.pickle import dumps

    try:
        answer = await asyncio.wait_for(
            worker.rpc(worker.nanny).run(function=dumps(_adopt), args=dumps((os.getpid(), str(path)))),
            HANDOVER_TIMEOUT_S)
    except Exception as error:      # noqa: BLE001 -- no answer: unwatched, and said so
        return f"its nanny {worker.nanny} did not take the table {path}: {type(error).__name__}: {error}"
    if not isinstance(answer, dict) or answer.get("status") != "OK":
        error = answer.get("exception") if isinstance(answer, dict) else answer
        return f"its nanny {worker.nanny} did not take the table {path}: {error!r}"
    return answer["result"]


def _adopt(pid: int, path: str, dask_worker) -> str | None:
    """In the nanny (``dask_worker`` is the nanny): its watch maps the table of worker process ``pid``."""
    watch = dask_worker.plugins.get(TOPIC)
    if not isinstance(watch, StuckRunWatch):
        return f"its nanny does not run the watch {TOPIC} (the sweep registers it before the gate)"
    return watch.adopt(pid, Path(path))


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

    def adopt(self, pid: int, path: Path) -> str | None:
        """Watch the table at ``path`` of worker process ``pid`` (the worker's word): None once it is mapped
        here; else why not, said of the worker's nanny."""
        if pid != self.nanny.pid:
            return f"its nanny runs worker process {self.nanny.pid}, not {pid}"
        table = watchdog.table_file(path)
        if table is None:
            return (f"its nanny cannot map the table {path} (no such file where the nanny runs: another "
                    "file system or temporary folder there, or a file not of the nanny's user)")
        self.pid, self.table = pid, table
        # Both processes have it mapped: the name was only where they meet, and a worker or nanny
        # killed outright leaves no file behind.
        path.unlink(missing_ok=True)
        return None

    async def check(self) -> None:
        pid = self.nanny.pid
        if pid != self.pid:             # a worker process started since: watched once its gate hands its table over
            self.pid, self.table = None, None
            return
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
        if self.nanny.pid != pid or self.table is None or not any(watchdog.still_running(self.table, base, job, pid)
                                                                  for base, job, _ in stuck):
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
