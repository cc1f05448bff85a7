"""A sweep's runs on a Dask cluster: connect, check every worker, hand out an executor.

``connect(address, backend)`` gives what ``sweep.sweep`` takes as its ``executor``: Dask's
own ``concurrent.futures`` executor (``Client.get_executor``), so the runs, the shrinks, the
journal and the reports go through the same code as with the local process pool. What
this module adds is the check that every worker runs the same code as this machine:

* before any run, one call on every worker (``Client.run``) imports the backend and reports
  its fingerprint (fingerprint.py); any difference is ``BackendMismatchError`` naming the
  workers and what differs, and nothing runs;
* workers that join later are checked by a worker plugin (worker_gate.py) before the
  scheduler may give them a run; one that differs gets none and is named on stderr;
* each worker's nanny ends a run stuck in C past its time limit (nanny_watch.py), and the
  executor (``WatchedExecutor``, Dask's tasks as ``concurrent.futures`` futures, as
  ``Client.get_executor`` gives them) records it as ``Stuck`` at once; a worker without a
  nanny cannot be watched, and is named on stderr.

Dask does the rest: a task whose worker dies is run again on another worker (the sweep
keeps the first result of each (configuration, seed)), and a lost scheduler cancels the
futures, which the sweep turns into ``ClusterLostError`` and a partial report.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import sys
import time
from concurrent.futures import CancelledError, Executor, Future, InvalidStateError, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Callable, Iterator, TextIO

from kvstate.impl.remote_io import has_credentials, redact
from kvstate.spec.errors import BackendMismatchError, ClusterLostError, SweepError

from . import watchdog
from .fingerprint import describe, differences, fingerprint
from .sweep import Stuck

EXTRA = "kvstate[cluster]"


class WatchedExecutor(Executor):
    """The sweep's tasks on Dask as ``concurrent.futures`` futures, each run under ``watchdog.guarded``
    with a number of its own, so that a nanny that ends a run stuck in C can name it (``stuck``).
    ``Client.get_executor`` gave no way from its futures to their Dask tasks, which ``stuck`` cancels."""

    def __init__(self, client, resources: dict):
        self.client, self.resources = client, resources
        self._open: dict[int, tuple] = {}       # task number -> (Dask future, the future handed out)

    def submit(self, function: Callable, /, *args) -> Future:
        number = secrets.randbits(52)           # none alike among the sweeps sharing a worker; exact as a float
        task = self.client.submit(watchdog.guarded, function, number, *args, pure=False, resources=self.resources,
                                  key=f"{getattr(function, '__name__', 'task')}-{secrets.token_hex(16)}")
        future: Future = Future()
        # A future the caller cancels (``_map`` letting go of it) cancels its task; not one cancelled below.
        future.add_done_callback(lambda done: done.cancelled() and task.status != "cancelled" and task.cancel())
        self._open[number] = (task, future)
        self.client.loop.add_callback(self._settle, number, task, future)
        return future

    async def _settle(self, number: int, task, future: Future) -> None:
        """``task``'s outcome to ``future``, unless ``stuck`` ended it first (on the client's event loop)."""
        try:
            result = await self.client.gather(task, asynchronous=True)
        except (CancelledError, asyncio.CancelledError):        # cancelled, or the scheduler lost
            if self._open.pop(number, None):
                future.cancel()
        except BaseException as error:      # noqa: BLE001 -- the run's own, or Dask's KilledWorker: a finding
            if self._open.pop(number, None):
                _hand(future.set_exception, error)
        else:
            if self._open.pop(number, None):
                _hand(future.set_result, result)

    async def stuck(self, number: int, step: int, worker: str) -> None:
        """Task ``number`` ran past its limit, stuck at ``step``: its nanny is ending ``worker``. Its future
        ends now as ``Stuck``; its Dask task is cancelled, or Dask would run it again on another worker,
        stuck again, until ``allowed-failures``. A number not open here is another sweep's."""
        entry = self._open.pop(number, None)
        if entry is None:
            return
        task, future = entry
        _hand(future.set_exception, Stuck.past_limit(step, f"the nanny of worker {worker} ended that worker "
                                                           "process and starts it again"))
        await self.client.cancel([task], asynchronous=True)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            for _, future in list(self._open.values()):
                future.cancel()


def _hand(settle: Callable, value) -> None:
    with suppress(InvalidStateError):       # cancelled by the caller meanwhile: nobody waits for it
        settle(value)


@dataclass
class ClusterSession:
    address: str
    client: object                   # distributed.Client
    executor: WatchedExecutor
    resource: str                    # what the sweep's tasks ask for; admitted workers hold it
    workers: int                     # worker threads that passed the check at the start
    accepted: list[str] = field(default_factory=list)     # workers the gate let in (late joiners too)
    refused: dict[str, dict] = field(default_factory=dict)
    out: TextIO | None = None        # where refused late joiners are named
    _window: int = 0
    _window_at: float = float("-inf")
    _unwatched: set = field(default_factory=set)

    def window(self) -> int:
        """Runs to keep submitted: two per thread of the workers holding the sweep's resource
        (one running, one ready), so that workers that join get runs and workers that die
        held few. Asks the scheduler at most once a second; keeps the last answer if it fails."""
        now = time.monotonic()
        if now - self._window_at >= 1.0:
            self._window_at = now
            try:
                workers = self.client.scheduler_info(n_workers=-1)["workers"].values()
                threads = sum(w.get("nthreads", 1) for w in workers if w.get("resources", {}).get(self.resource))
                self._window = 2 * max(threads, 1)
            except Exception:       # a scheduler going away shows in the futures, not here
                self._window = self._window or 2 * max(self.workers, 1)
        return self._window

    def note(self, event: tuple) -> None:
        """The gate's word on a worker (called on the client's event loop)."""
        _, message = event
        if message.get("accepted"):
            self.accepted.append(message["worker"])
            if not message.get("watched", True):
                self.unwatched(message["worker"], message.get("unwatched") or "has no nanny")
            return
        differs = {key: tuple(pair) for key, pair in message["differs"].items()}
        self.refused[message["worker"]] = differs
        self._say(f"worker {message['worker']} joined with other code and gets no runs: {describe(differs)}")

    def unwatched(self, worker: str, why: str = "has no nanny") -> None:
        """Name, once, a worker whose runs nothing can end when they are stuck in C, and ``why`` (said of it:
        it has no nanny, or its nanny cannot read its table)."""
        if worker not in self._unwatched:
            self._unwatched.add(worker)
            advice = " (start workers with their nanny, dask worker's default)" if why == "has no nanny" else ""
            self._say(f"worker {worker} {why}: a run stuck there in C past --run-timeout cannot be ended, "
                      f"and holds its worker thread and this sweep until it returns{advice}")

    async def stuck(self, event: tuple) -> None:
        """A nanny's word that it is ending its worker, stuck in a run of ours or another sweep's."""
        _, message = event
        await self.executor.stuck(message["job"], message["step"], message["worker"])

    def _say(self, line: str) -> None:
        if self.out is not None:
            self.out.write(f"\nkvstate sweep: {line}\n")
            self.out.flush()


def require_distributed():
    """Dask distributed, or a ``SweepError`` that names the extra to install."""
    try:
        import distributed
    except ImportError as error:
        raise SweepError(f"--scheduler runs the sweep on Dask, and Dask distributed is not installed "
                         f"({error}); install it with: pip install '{EXTRA}'") from None
    return distributed


def check_address(address: str) -> str:
    """``address`` if it can name a scheduler (``tcp://HOST:PORT`` and Dask's other schemes), else a
    one-line ``SweepError``. Checked before a ``Client`` exists: a Client whose constructor failed
    waits 60 s on its way out and prints a traceback."""
    require_distributed()
    from distributed.comm import get_address_host_port

    if isinstance(address, str) and address.startswith("inproc://"):      # an in-process cluster's
        return _check_inproc(address)
    if has_credentials(address):        # Dask takes no user:password@, and a message must not print it
        raise SweepError(f"--scheduler {redact(address)!r} is not a Dask scheduler address (tcp://HOST:PORT): "
                         f"it carries a user and password, which Dask addresses do not take (secure a "
                         f"scheduler with TLS: tls://HOST:PORT and Dask's security settings)")
    try:
        host, port = get_address_host_port(address)
        if not host or not 0 < int(port) < 65536:
            raise ValueError(f"host {host!r}, port {port}")
    except (ValueError, TypeError) as error:
        raise SweepError(f"--scheduler {address!r} is not a Dask scheduler address (tcp://HOST:PORT): "
                         f"{error}") from None
    return address


def answers_as_scheduler(address: str, timeout_s: float) -> None:
    """A ``SweepError`` unless the service at ``address`` answers Dask's identity request as a scheduler
    within ``timeout_s``. Asked before a ``Client`` exists: a Client's ``timeout`` bounds the connection,
    not the handshake after it, so a port that accepts and never answers (a dashboard's, another
    service's) held the sweep for good, and one answering in another protocol (HTTP) came out as a
    ``MemoryError`` for exabytes, each followed by the failed Client's 60 s close and its traceback."""
    from distributed.comm import connect as open_comm, get_address_host_port
    from distributed.security import Security

    _listening(address, get_address_host_port(address), timeout_s)

    async def identity():
        comm = await open_comm(address, timeout=timeout_s, **Security().get_connection_args("client"))
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    def ask():      # a loop of its own: the caller's thread may run one already (a notebook, async code)
        return asyncio.run(asyncio.wait_for(identity(), timeout_s))
    with ThreadPoolExecutor(1, thread_name_prefix="kvstate-scheduler-probe") as probe:
        try:
            reply = probe.submit(ask).result()
        except (asyncio.TimeoutError, TimeoutError, OSError):     # distributed's CommClosedError is an OSError
            raise SweepError(f"the service at {address} accepts connections but did not answer as a Dask "
                             f"scheduler within {timeout_s:g} s (a dashboard's port, or another service's?)") from None
        except Exception as error:      # noqa: BLE001 - another protocol's bytes read as Dask's: anything
            raise SweepError(f"the service at {address} is not a Dask scheduler (its answer could not be read "
                             f"as Dask's: {type(error).__name__})") from None
    if not isinstance(reply, dict) or reply.get("type") != "Scheduler":
        kind = reply.get("type") if isinstance(reply, dict) else type(reply).__name__
        raise SweepError(f"the service at {address} is not a Dask scheduler (it answered as {kind!r})")


def _listening(address: str, host_port: tuple, timeout_s: float) -> None:
    """Return once something accepts connections at ``host_port``, trying again (as a Client does) for
    ``timeout_s``: a scheduler started just before the sweep may not listen yet. Else "cannot reach"."""
    deadline, pause = time.monotonic() + timeout_s, 0.05
    while True:
        try:
            socket.create_connection(host_port, timeout=max(deadline - time.monotonic(), 0.01)).close()
            return
        except OSError as error:
            if time.monotonic() + pause > deadline:
                raise SweepError(f"cannot reach the Dask scheduler at {address} within {timeout_s:g} s: "
                                 f"{error}") from None
        time.sleep(pause)
        pause = min(2 * pause, 1.0)


def _check_inproc(address: str) -> str:
    """An ``inproc://`` address names a scheduler inside this process; one nobody listens on would
    leave the Client waiting out its 60 s close."""
    from distributed.comm.inproc import global_manager

    try:
        listening = global_manager.get_listener_for(address[len("inproc://"):]) is not None
    except Exception:              # a malformed address: validate_address's own assertion or error
        listening = False
    if not listening:
        raise SweepError(f"--scheduler {address!r}: no scheduler listens at that in-process address "
                         f"(inproc:// names a cluster started inside this same process)")
    return address


@contextmanager
def quiet_dask_client() -> Iterator[None]:
    """Dask's client logs each failed reconnection as an ERROR with a traceback (36 lines for a lost
    scheduler); the sweep says what happened in one line (``ClusterLostError``), so while a session
    is open those records are dropped. Restored on leaving."""
    logger = logging.getLogger("distributed.client")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextmanager
def connect(address: str, backend: str, out: TextIO | None = sys.stderr,
            timeout_s: float = 30.0) -> Iterator[ClusterSession]:
    """A checked session on the scheduler at ``address``; closed on leaving the block."""
    distributed = require_distributed()
    from .nanny_watch import TOPIC, StuckRunWatch
    from .worker_gate import BackendGate

    check_address(address)
    if not address.startswith("inproc://"):       # an in-process cluster was checked by its listener
        answers_as_scheduler(address, timeout_s)
    here = fingerprint(backend)
    with quiet_dask_client():
        try:
            client = distributed.Client(address, timeout=timeout_s, set_as_default=False)
        except (OSError, TimeoutError, ValueError, MemoryError) as error:
            raise SweepError(f"cannot reach the Dask scheduler at {address}: {error}") from None
        lost = False
        try:
            try:
                client.wait_for_workers(1, timeout=timeout_s)
                checked = check_workers(client, backend, here)
                gate = BackendGate(backend, here)
                session = ClusterSession(address, client, WatchedExecutor(client, {gate.name: 1}), gate.name,
                                         workers=sum(client.nthreads().values()), out=out, accepted=checked)
                # Events only name workers (the resource is what keeps work away): a subscription that
                # reaches the scheduler after the gate's first words misses nothing that matters.
                client.subscribe_topic(gate.name, session.note)
                client.subscribe_topic(TOPIC, session.stuck)
                client.register_plugin(StuckRunWatch(), name=TOPIC)     # the nannies watch before any run
                client.register_plugin(gate, name=gate.name)
                # The gate's word on the workers there now may reach the scheduler before the subscription.
                for worker in without_nanny(client):
                    session.unwatched(worker)
            except TimeoutError:
                raise SweepError(f"the Dask scheduler at {address} has no workers (waited {timeout_s:g} s)") from None
            except OSError as error:        # distributed's CommClosedError is one
                lost = True
                raise SweepError(f"lost the Dask scheduler at {address} while checking its workers: "
                                 f"{error}") from None
            yield session
        except ClusterLostError:
            lost = True
            raise
        finally:
            _close(client, lost)


def check_workers(client, backend: str, here: dict) -> list[str]:
    """The workers, all with fingerprint ``here``; ``BackendMismatchError`` if any differs."""
    found = client.run(fingerprint, backend, on_error="return")
    mismatched = {}
    for worker, theirs in sorted(found.items()):
        if isinstance(theirs, BaseException):      # it could not even load kvstate's fingerprint
            theirs = {"kvstate": f"cannot run kvstate: {type(theirs).__name__}: {theirs}"}
        differs = differences(here, theirs)
        if differs:
            mismatched[worker] = differs
    if mismatched:
        lines = "; ".join(f"{worker}: {describe(differs)}" for worker, differs in mismatched.items())
        raise BackendMismatchError(f"{len(mismatched)} of {len(found)} workers would run other code than this "
                                   f"machine, so no run started. {lines}", mismatched)
    return sorted(found)


def without_nanny(client) -> list[str]:
    """The workers the scheduler knows no nanny of."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return sorted(address for address, worker in workers.items() if not worker.get("nanny"))


def _close(client, lost: bool) -> None:
    if lost:
        # The client's reconnection attempts log tracebacks; the sweep has already said it in one line.
        logging.getLogger("distributed").setLevel(logging.CRITICAL)
    try:
        client.close(timeout=2 if lost else 10)
    except Exception:               # closing a client whose scheduler is gone may time out: nothing to keep
        pass
