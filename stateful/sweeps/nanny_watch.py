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
  and then, if one of them still runs, kills the worker process, which it starts again. A worker
  of several threads runs several tasks at once, each in a row of its own: every one of them overdue
  by the time of the kill is told (the first found, and those overdue by the end of the pause that
  lets the sweep cancel it), since the kill ends them all and one left untold is run again elsewhere,
  stuck there too. Except a task whose thread only waits for the GIL (Linux shows it waking every
  5 ms, ``watchdog.wakes``), held by C code of another thread: stopped, not stuck, it was told as a
  RunTimeout of a seed that runs clean; untold, it ends with the worker and runs again elsewhere.
  A task stopped then in a wait of another kind (a lock or event that a thread waiting for the GIL
  would release, as ``Thread.start`` of its Deadline's timer) shows no such wakes, and is still told;
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
import time
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
WAKE_SAMPLE_S = 0.05
"""How long the nanny watches the threads of its worker's late tasks, to tell one only waiting for the GIL."""
GIL_WAITER_WAKES = 2
"""A thread waiting for the GIL wakes every 5 ms (about 10 times in ``WAKE_SAMPLE_S``); one stuck in C, never."""
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
        stuck = await self._stuck(pid)
        if stuck:
            await self._end(pid, stuck)

    async def _stuck(self, pid: int, culprit_told: bool = False) -> list[tuple[int, int, int]]:
        """The row, task number and step of each task of worker ``pid`` past its limit and grace, each found once
        (``watchdog.overdue``); not those whose thread only waits for the GIL (``_waiting``). C code of one thread
        that holds the GIL stops every other thread of its worker, and a run of another thread, stopped at its
        step past its own limit, is not stuck itself: told, it was recorded as a RunTimeout of its seed, which
        runs clean. Left untold, it ends with the worker and Dask runs it again elsewhere, as any run of a
        worker that died. Where every late task waits for the GIL, none of them holds it (C code not yet past
        its limit does, or code not a sweep's): they are left alone until twice as late as they may be, then
        told all the same, unless the nanny has just told of the one that holds it (``culprit_told``)."""
        if self.table is None:          # the plugin removed meanwhile
            return []
        late = [base for base in range(0, len(self.table), watchdog.WIDTH)
                if watchdog.late(self.table, base) and int(self.table[base + watchdog.PID]) == pid]
        if not late:
            return []
        waiting = await self._waiting(pid, late)
        if waiting == set(late) and not culprit_told:
            now = time.monotonic()
            waiting = {base for base in waiting if now - self.table[base + watchdog.STARTED]
                       <= 2 * (self.table[base + watchdog.LIMIT] + watchdog.GRACE_S)}
        stuck = []
        for base in late:
            found = None if base in waiting else watchdog.overdue(self.table, base)
            if found is not None and found[1] == pid:       # only ever its own worker process
                stuck.append((base, found[0], found[2]))
        return stuck

    async def _waiting(self, pid: int, late: list[int]) -> set[int]:
        """Those rows of ``late`` whose task's thread waits for the GIL: it wakes again and again (``watchdog.wakes``)
        and its task has not moved on. None where threads cannot be seen (not Linux): every late task is stuck."""
        table = self.table
        threads = {base: (int(table[base + watchdog.TID]), table[base + watchdog.STEP]) for base in late}
        before = {base: watchdog.wakes(pid, tid) for base, (tid, _) in threads.items()}
        if all(count is None for count in before.values()):
            return set()
        await asyncio.sleep(WAKE_SAMPLE_S)
        waiting = set()
        for base, (tid, step) in threads.items():
            after = watchdog.wakes(pid, tid)
            if (before[base] is not None and after is not None and after - before[base] >= GIL_WAITER_WAKES
                    and table[base + watchdog.STEP] == step and int(table[base + watchdog.TID]) == tid):
                waiting.add(base)
        return waiting

    async def _end(self, pid: int, stuck: list[tuple[int, int, int]]) -> None:
        """Tell the sweep that each task of ``stuck`` (its row, number and step) is stuck, then kill worker ``pid``
        (restarted by this nanny) if one of them still runs there: tasks that all returned while the sweep was
        told (each recorded as stuck all the same, past its limit) leave the worker to the tasks it runs now,
        another sweep's perhaps. A task of another thread of the worker that is overdue by then is told too
        before the kill (and the pause begins again for it): the kill ends it as well."""
        told: list[tuple[int, int, int]] = []
        try:
            while stuck:
                for _, job, step in stuck:
                    await asyncio.wait_for(self.nanny.scheduler.log_event(
                        topic=TOPIC, msg={"worker": self.nanny.worker_address, "job": job, "step": step}),
                        REPORT_TIMEOUT_S)
                told += stuck
                await asyncio.sleep(SETTLE_S)
                stuck = await self._stuck(pid, culprit_told=True) if self.nanny.pid == pid else []
        except Exception:       # noqa: BLE001 -- a scheduler that cannot be told: the worker is freed all the same
            told += stuck
        if self.nanny.pid != pid or self.table is None or not any(watchdog.still_running(self.table, base, job, pid)
                                                                  for base, job, _ in told):
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
