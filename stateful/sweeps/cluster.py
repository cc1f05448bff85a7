"""A sweep's runs on a Dask cluster: connect, check every worker, hand out an executor.

``connect(address, backend)`` gives what ``sweep.sweep`` takes as its ``executor``: Dask's
own ``concurrent.futures`` executor (``Client.get_executor``), so the runs, the shrinks, the
journal and the reports go through the same code as with the local process pool. What
this module adds is the check that every worker runs the same code as this machine:

* before any run, one call on every worker (``Client.run``) imports the backend and reports
  its fingerprint (fingerprint.py); any difference is ``BackendMismatchError`` naming the
  workers and what differs, and nothing runs;
* workers that join later are checked by a worker plugin (worker_gate.py) before the
  scheduler may give them a run; one that differs gets none and is named on stderr.

Dask does the rest: a task whose worker dies is run again on another worker (the sweep
keeps the first result of each (configuration, seed)), and a lost scheduler cancels the
futures, which the sweep turns into ``ClusterLostError`` and a partial report.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, TextIO

from kvstate.spec.errors import BackendMismatchError, ClusterLostError, SweepError

from .fingerprint import describe, differences, fingerprint

EXTRA = "kvstate[cluster]"


@dataclass
class ClusterSession:
    address: str
    client: object                   # distributed.Client
    executor: object                 # distributed.cfexecutor.ClientExecutor
    resource: str                    # what the sweep's tasks ask for; admitted workers hold it
    workers: int                     # worker threads that passed the check at the start
    accepted: list[str] = field(default_factory=list)     # workers the gate let in (late joiners too)
    refused: dict[str, dict] = field(default_factory=dict)
    out: TextIO | None = None        # where refused late joiners are named
    _window: int = 0
    _window_at: float = float("-inf")

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
            return
        differs = {key: tuple(pair) for key, pair in message["differs"].items()}
        self.refused[message["worker"]] = differs
        if self.out is not None:
            self.out.write(f"\nkvstate sweep: worker {message['worker']} joined with other code and gets no runs: "
                           f"{describe(differs)}\n")
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
    try:
        host, port = get_address_host_port(address)
        if not host or not 0 < int(port) < 65536:
            raise ValueError(f"host {host!r}, port {port}")
    except (ValueError, TypeError) as error:
        raise SweepError(f"--scheduler {address!r} is not a Dask scheduler address (tcp://HOST:PORT): "
                         f"{error}") from None
    return address


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
    from .worker_gate import BackendGate

    check_address(address)
    here = fingerprint(backend)
    with quiet_dask_client():
        try:
            client = distributed.Client(address, timeout=timeout_s, set_as_default=False)
        except (OSError, TimeoutError, ValueError) as error:
            raise SweepError(f"cannot reach the Dask scheduler at {address}: {error}") from None
        lost = False
        try:
            try:
                client.wait_for_workers(1, timeout=timeout_s)
                checked = check_workers(client, backend, here)
                gate = BackendGate(backend, here)
                session = ClusterSession(address, client,
                                         client.get_executor(pure=False, resources={gate.name: 1}), gate.name,
                                         workers=sum(client.nthreads().values()), out=out, accepted=checked)
                # Events only name workers (the resource is what keeps work away): a subscription that
                # reaches the scheduler after the gate's first words misses nothing that matters.
                client.subscribe_topic(gate.name, session.note)
                client.register_plugin(gate, name=gate.name)
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


def _close(client, lost: bool) -> None:
    if lost:
        # The client's reconnection attempts log tracebacks; the sweep has already said it in one line.
        logging.getLogger("distributed").setLevel(logging.CRITICAL)
    try:
        client.close(timeout=2 if lost else 10)
    except Exception:               # closing a client whose scheduler is gone may time out: nothing to keep
        pass
