"""A Dask worker plugin: a worker gets sweep runs only once it has shown the same fingerprint.

Registered with the scheduler, the plugin's ``setup`` runs on every worker there now and on
every worker that joins later (a replacement for a dead one, a machine added mid-sweep)
before the scheduler knows it as able to run a sweep task. The sweep's tasks ask for a
Dask *resource* named after the submitting machine's fingerprint; ``setup`` grants that
resource (one unit per worker thread) only when the worker's own fingerprint matches. A
worker that differs never holds the resource, so the scheduler never gives it a run; the
plugin says so on an event topic, which the submitting client prints.

A resource rather than a list of worker addresses: restrictions to addresses are fixed at
submission, so the runs of a worker that dies could only wait for it, while any worker
holding the resource (the dead one's replacement included) can take them.

Dask looks again at runs waiting for a worker ("no-worker") when a worker registers or its
status becomes running, not when a worker gains a resource; and a plugin's ``setup`` runs
only after its worker has registered and started running. So a grant is followed by a
pause and resume of the worker (``offer_waiting_runs``): without it, the runs of a worker
that died before any other held the resource would wait for ever, its replacement idle.

Before the grant, the worker's tasks are set to report to its nanny's watch (nanny_watch.py), which
ends a run stuck in C: the worker hands its table to its nanny and waits for the nanny's answer. The
plugin's word says whether the worker is watched, and if not why (one without a nanny is not, nor one
whose nanny could not map its table).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

from distributed import WorkerPlugin
from distributed.core import Status

from .fingerprint import differences, fingerprint
from .nanny_watch import watch_worker


def gate_name(expected: dict) -> str:
    """One name per fingerprint, for the resource, the plugin and the event topic: sweeps of
    the same code share a gate; sweeps of different code never take each other's workers."""
    digest = hashlib.sha256(json.dumps(expected, sort_keys=True).encode()).hexdigest()[:12]
    return f"kvstate-sweep-{digest}"


class BackendGate(WorkerPlugin):
    def __init__(self, backend: str, expected: dict):
        self.backend = backend
        self.expected = expected
        self.name = gate_name(expected)

    async def setup(self, worker) -> None:
        # Importing the backend may take a while: off the worker's event loop.
        found = await asyncio.get_running_loop().run_in_executor(None, fingerprint, self.backend)
        differs = differences(self.expected, found)
        if differs:
            worker.log_event(self.name, {"worker": worker.address, "accepted": False,
                                         "differs": {key: list(pair) for key, pair in differs.items()}})
            return
        unwatched = await watch_worker(worker)      # before any run can come: its nanny has its table
        stop_sampling_profiler(worker)
        await worker.set_resources(**{self.name: worker.state.nthreads})      # awaited: the scheduler holds it now
        offer_waiting_runs(worker)
        worker.log_event(self.name, {"worker": worker.address, "accepted": True, "watched": unwatched is None,
                                     "unwatched": unwatched})


def stop_sampling_profiler(worker) -> None:
    """Stop the worker's statistical profiler (``Worker.trigger_profile``, every 10 ms while a task runs)
    on CPython before 3.12, where it can deadlock the worker process for good (python/cpython#106883,
    #116969; dask/distributed#8616). It calls ``sys._current_frames()``, which holds the interpreter's
    thread-list lock while it makes frame objects; an allocation there may start a collection, whose
    finalizers may give up the GIL (a ``TemporaryDirectory``'s rmtree). A thread that then takes the
    GIL and starts or ends a thread (a shrink try's ``Deadline`` timer) waits for that lock while
    holding the GIL: no thread of the worker runs again, its event loop included, until its nanny
    kills it. A sweep's shrink stalled its worker so until the nanny's kill (300-480 s), rarely: 2 of
    about 300 sweeps on a loaded local cluster. The profile only feeds Dask's dashboard."""
    if sys.version_info >= (3, 12):         # collections run only at the eval breaker there
        return
    callback = worker.periodic_callbacks.pop("profile", None)     # out of the table: a later
    if callback is not None:                                        # start_periodic_callbacks would restart it
        callback.stop()


def offer_waiting_runs(worker) -> None:
    """Have the scheduler send ``worker`` the waiting runs it can now take: a status change to
    running is what makes Dask look at them (``handle_worker_status_change``). Both changes go, in
    order, on the worker's stream, with nothing between them on this event loop. A worker paused
    for memory is left alone: Dask looks again when it resumes."""
    if worker.status == Status.running:
        worker.status = Status.paused
        worker.status = Status.running
