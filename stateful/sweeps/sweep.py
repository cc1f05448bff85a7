"""Nightly sweeps: many seeds x configurations through the lockstep checks, in parallel.

Each (seed, configuration) run is ``steps`` operations from ``generate.Generator(seed)``,
applied by ``Lockstep`` with every invariant checked after every step. A failing
run is shrunk (shrink.py) and saved as a replay file (replay.py), and printed as
a ready-to-paste pytest test.

Parallelism is a ``ProcessPoolExecutor`` rather than pytest-xdist: a sweep is a
command, not a test session; it needs its own progress line, its own report
and a shrink phase that runs after the runs, and each task is one small
picklable (backend path, config, seed). Under xdist all of that would go
through pytest's collection, fixtures and plugins. One worker is a pool of one
process too: a run that crashes its process or hangs in C is a finding of its
seed there, where in the sweep's own process it ended or held the whole sweep.

The pool is any ``concurrent.futures.Executor``: a ``ProcessPoolExecutor`` here, or Dask's
``ClientExecutor`` over a cluster (cluster.py). Everything else is one code path: the runs
and the shrinks are the same tasks (runs.py), their results come back to this process, and this
process alone writes the journal (journal.py), the replay files and the reports, in the
folder the user ran the command in.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import shlex
import signal
import stat
import sys
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import BrokenExecutor, CancelledError, Executor, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from queue import SimpleQueue
from typing import Callable, Iterable, Iterator, Sequence, TextIO

try:
    import fcntl
except ImportError:          # not POSIX: sweeps run, without the folder lock
    fcntl = None  # type: ignore[assignment]

from kvstate.spec.errors import BackendMismatchError, ClusterLostError, ResumeError, RunTimeout, SweepError
from kvstate.spec.protocol import Config

from . import journal as J
from . import runs
from .fingerprint import describe, differences, fingerprint
from ..backends import backend_option, canonical_backend
from ..configs import config_label, configs_for, configs_named, page_sizes
from ..data_files import open_own_file
from ..exits import ended_how
from ..printable import one_line
from ..replay import FINDINGS, as_pytest, failure_to_json, load
from . import watchdog
from .redraw import crashed
from .runs import (RunResult, factory_for, result_from_json, result_to_json, run_seed, save_replay, shrink_cut,
                   shrink_result, to_shrink)

DEFAULT_BACKEND = "kvstate.impl.numpy"
MAX_SEEDS = 10_000_000     # the plan line lists every seed: this many keep the journal under J.MAX_BYTES


# -- which runs ------------------------------------------------------------------------

def parse_seed_range(text: str) -> range:
    """``A:B`` is seeds A..B-1."""
    start, sep, stop = text.partition(":")
    if not sep or not start.strip().isdigit() or not stop.strip().isdigit() or int(stop) <= int(start):
        raise ValueError(f"--seed-range wants A:B with 0 <= A < B, got {text!r}")
    if int(stop) - int(start) > MAX_SEEDS:
        raise ValueError(f"--seed-range {text!r} holds more than MAX_SEEDS={MAX_SEEDS} seeds")
    return range(int(start), int(stop))


def parse_shard(text: str) -> tuple[int, int]:
    """``K/N``: the K-th (1-based) of N shards."""
    k, sep, n = text.partition("/")
    if not sep or not k.isdigit() or not n.isdigit() or not 1 <= int(k) <= int(n):
        raise ValueError(f"--shard wants K/N with 1 <= K <= N, got {text!r}")
    return int(k), int(n)


def shard(seeds: Sequence[int], k: int, n: int) -> list[int]:
    """Every N-th seed from the K-th: N shards cover the seeds once, with no overlap, in sizes
    that differ by at most one."""
    return list(seeds)[k - 1::n]


# -- progress --------------------------------------------------------------------------

class Progress:
    """One line on stderr: runs done, steps/s, ETA, failures. Redrawn in place on a terminal,
    printed every ``every_s`` seconds elsewhere (CI logs)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, every_s: float = 10.0, already: int = 0,
                 failures: int = 0):
        self.total, self.stream, self.every_s = total, stream, every_s
        self.done, self.failures = already, failures     # a resumed sweep starts where it stopped
        self.fresh = self.steps = 0                      # rates count only this session's runs
        self.started = self.last = time.monotonic()
        self.tty = stream.isatty()
        self.closed = False

    def update(self, result: RunResult) -> None:
        self.done += 1
        self.fresh += 1
        self.steps += result.steps
        self.failures += not result.passed
        now = time.monotonic()
        if self.tty or now - self.last >= self.every_s or self.done == self.total:
            self.last = now
            self.stream.write(("\r" if self.tty else "") + self.line(now) + ("" if self.tty else "\n"))
            self.stream.flush()

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = self.fresh / elapsed
        eta = (self.total - self.done) / rate if rate else 0.0
        filled = int(30 * self.done / max(self.total, 1))
        return (f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} runs  "
                f"{self.steps / elapsed:,.0f} steps/s  elapsed {_clock(elapsed)}  ETA {_clock(eta)}  "
                f"failures {self.failures}")

    def close(self) -> None:
        if self.tty and not self.closed:
            self.stream.write("\n")
        self.closed = True


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# -- the sweep -------------------------------------------------------------------------

@dataclass
class SweepReport:
    backend: str
    steps: int
    seeds: list[int]
    configs: list[str]
    workers: int
    shard: str | None
    wall_seconds: float
    results: list[RunResult]
    scheduler: str | None = None     # the Dask scheduler's address; None for the local pool
    partial: bool = False            # stopped before every run (and shrink) had finished
    resumed: int = 0                 # runs taken from the journal of an earlier, stopped sweep
    resumed_steps: int = 0           # their steps: run before ``wall_seconds`` began, so left out of its rate

    @property
    def failures(self) -> list[RunResult]:
        return [r for r in self.results if not r.passed]

    @property
    def expected(self) -> int:
        return len(self.seeds) * len(self.configs)


MAX_LOCAL_WORKERS = 256     # --workers past it: each one a process importing the backend


def resolve_workers(workers: str | int) -> int:
    if workers == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        workers = int(workers)
    except ValueError:
        raise ValueError(f"--workers wants a positive number or 'auto', got {workers!r}") from None
    if workers < 1:
        raise ValueError(f"--workers wants a positive number or 'auto', got {workers}")
    if workers > MAX_LOCAL_WORKERS:     # each one a process importing the backend: 1,000 was accepted
        raise ValueError(f"--workers {workers} is more than {MAX_LOCAL_WORKERS} local processes; runs are "
                         f"CPU-bound, so more workers than cores only slow them (this machine has "
                         f"{resolve_workers('auto')}): for more, run the sweep on Dask (--scheduler)")
    return workers


def scheduler_option(scheduler: str | None) -> str:
    """`` --scheduler ADDRESS`` for a resume command, where the sweep ran on one (without it, the printed
    command resumed on the local pool); a scheduler taken from $KVSTATE_SCHEDULER is taken from it again."""
    if not scheduler or scheduler.startswith("inproc://"):     # an in-process cluster's: no other process reaches it
        return ""
    if scheduler == os.environ.get("KVSTATE_SCHEDULER"):
        return ' --scheduler "$KVSTATE_SCHEDULER"'
    return f" --scheduler {shlex.quote(scheduler)}"


def sweep(seeds: Iterable[int], steps: int, configs: Sequence[Config], backend: str = DEFAULT_BACKEND,
          workers: int = 1, out_dir: Path = Path("sweep-out"), shrink_limit: int = 5,
          shrink_budget_s: float = J.DEFAULT_SHRINK_BUDGET, progress: TextIO | None = sys.stderr,
          shard_label: str | None = None, *, executor: Executor | None = None,
          run_timeout: float | None = None, resume: bool = False, scheduler: str | None = None,
          window: Callable[[], int] | None = None, in_process: bool = False,
          shrink_tries: int = J.DEFAULT_SHRINK_TRIES) -> SweepReport:
    """Run every (seed, configuration), then shrink up to ``shrink_limit`` failures (the first of
    each configuration and failure kind) and save every failure as a replay file.

    The report is a function of the seeds, steps, configurations, backend and ``shrink_tries`` (each
    shrink's bound), whatever the load, the executor or the number of workers, except where a
    wall-clock limit cut a stage of a failing run short (``run_timeout``; ``shrink_budget_s``, a
    backstop): that failure's ``clock`` names the stage (``runs.RUN``, ``PIN``, ``SHRINK``), as it
    names a shrink whose task came back without a result (``SHRINK_LOST``).

    ``executor`` runs the tasks (a Dask ``ClientExecutor``; ``scheduler`` names it in the
    report, ``window()`` says how many tasks to keep submitted, see ``_map``); without one, a
    local pool of ``workers`` processes does (``LocalPool``), one worker included: a run that
    ends its process (``os._exit``, a crash in C) is a ``ProcessDied`` failure of its seed, and one
    still blocked in C ``watchdog.GRACE_S`` past ``run_timeout`` a ``RunTimeout`` (this process's
    watchdog ends its pool process), each saved with the operations it ran, and the sweep
    goes on. Where processes start by ``fork`` (Linux, up to Python 3.13) a pool process is a copy of
    this one, so in-process patches (``planted.PLANTED``) reach its runs; under ``spawn`` or
    ``forkserver`` (macOS; Python 3.14 on Linux) they do not: pass ``in_process``.

    The runs go in this process instead, one after another, with ``in_process`` (``workers`` must
    be 1: a debugger sees them) or where the tasks cannot be sent to a process (``run_seed`` or
    ``shrink_result`` replaced by a function pickle cannot name, as tests do): there a run that
    ends its process ends the sweep, and one blocked in C holds it past any ``run_timeout``.

    Each finished run is journaled in ``out_dir`` as it arrives; ``resume`` runs only what the
    journal there lacks. When the pool or scheduler goes away (``ClusterLostError``) or on
    Ctrl-C, a partial report of what finished is written to ``out_dir`` before the error
    propagates. A full disk (``ENOSPC``) is a ``SweepError`` naming the ``--resume`` command
    that finishes the sweep once there is room.
    """
    if in_process and (workers > 1 or executor is not None):
        raise ValueError("in_process runs the sweep in this process: it takes workers=1 and no executor")
    seeds, out_dir = list(seeds), Path(out_dir)
    declared = configs_for(factory_for(backend))     # a bad backend path fails here, before any pool starts
    by_name = config_labels(configs, declared)
    plan = J.Plan(backend, steps, tuple(seeds), tuple(by_name), shard_label, fingerprint(backend),
                  None if executor is not None else workers, run_timeout, shrink_limit, shrink_budget_s, shrink_tries)
    with _only_sweep_in(out_dir):
        return _run_plan(plan, by_name, out_dir, resume, run_timeout, shrink_limit, shrink_budget_s, workers,
                         executor, progress, scheduler, window, in_process)


def _sendable(*objects: object) -> bool:
    """Whether a pool process can be sent ``objects`` (a task function is sent by its module and name)."""
    try:
        pickle.dumps(objects)
    except Exception:       # noqa: BLE001 -- PicklingError, or the AttributeError/TypeError of a local function
        return False
    return True


def _run_plan(plan: J.Plan, by_name: dict[str, Config], out_dir: Path, resume: bool, run_timeout: float | None,
              shrink_limit: int, shrink_budget_s: float, workers: int, executor: Executor | None,
              progress: TextIO | None, scheduler: str | None, window: Callable[[], int] | None,
              in_process: bool = False) -> SweepReport:
    """``sweep``'s runs and shrinks, ``out_dir`` locked to it: the journal opened (or started), the runs it
    lacks, the shrinks, the reports written."""
    backend, steps, seeds = plan.backend, plan.steps, list(plan.seeds)
    label_of = {config: label for label, config in by_name.items()}
    try:
        runs, shrunk, log = _open_journal(out_dir, plan, by_name, resume)
    except OSError as error:
        if error.errno not in DISK_FULL:
            raise
        raise SweepError(f"no space left on the disk of {out_dir} ({error.strerror}) for the sweep's journal: "
                         "free some space, then run the same command again") from error
    resumed, resumed_steps = len(runs), sum(r.steps for r in runs.values())
    order = [(label, seed) for label in by_name for seed in seeds]
    todo = [(backend, by_name[name], seed, steps, run_timeout) for name, seed in order if (name, seed) not in runs]
    meter = (Progress(len(order), progress, already=resumed, failures=sum(not r.passed for r in runs.values()))
             if progress is not None else None)
    started = time.perf_counter()
    pool = executor
    completed = False

    def report(partial: bool) -> SweepReport:
        results = [shrunk.get(key, runs[key]) for key in order if key in runs]
        for r in results:
            if not r.passed:
                save_replay(backend, by_name[r.config], r, out_dir / REPLAYS)
        return SweepReport(backend, steps, seeds, list(by_name), workers, plan.shard,
                           time.perf_counter() - started, results, scheduler, partial, resumed, resumed_steps)

    # From the old reports' removal to the new ones written, an interrupt or SIGTERM (``Terminated``)
    # anywhere leaves the partial report the handlers below write, never none.
    try:
        for name in REPORTS:        # an earlier sweep's: stale from now on, whatever stops this one
            (out_dir / name).unlink(missing_ok=True)
        if pool is None and (workers > 1 or not in_process and _sendable(run_seed, shrink_result, backend,
                                                                         list(by_name.values()))):
            pool = LocalPool(workers)       # one worker too: a run that crashes or hangs in C is its seed's finding
        for job, result in _map(pool, run_seed, todo, window):
            if isinstance(result, FINDINGS):
                result = crashed(backend, job[1], job[2], steps, result, run_timeout)
            result.config = label_of[job[1]]        # the name, or the name and page size where it is declared twice
            key = (result.config, result.seed)
            if key in runs:
                continue        # counted once, whatever the executor delivers twice
            log.record_run(result_to_json(result))      # first: ``runs`` holds what a resume will find
            runs[key] = result
            if meter:
                meter.update(result)
        if meter:
            meter.close()
        jobs = [(backend, by_name[r.config], r, shrink_budget_s, plan.shrink_tries)
                for r in to_shrink(runs.values(), shrink_limit) if (r.config, r.seed) not in shrunk]
        for job, result in _map(pool, shrink_result, jobs, window):
            if isinstance(result, Exception):     # ended past its budget, or lost: unshrunk, and said so
                result = shrink_cut(job[2], result)
            log.record_shrunk(result_to_json(result))
            shrunk[(result.config, result.seed)] = result
        completed = True
        final = report(partial=False)
        write_reports(final, out_dir)
    except ClusterLostError:
        if meter:
            meter.close()
        write_reports(report(partial=True), out_dir)
        where = f"the Dask scheduler {scheduler}" if scheduler else "the local process pool"
        raise ClusterLostError(f"lost {where} after {len(runs)} of {len(order)} runs; partial report in "
                               f"{out_dir / 'report.json'}; finish with: kvstate sweep --resume {shlex.quote(str(out_dir))}"
                               f"{backend_option(backend)}{scheduler_option(scheduler)}") from None
    except KeyboardInterrupt:
        if meter:
            meter.close()
        write_reports(report(partial=True), out_dir)
        raise
    except OSError as error:
        if error.errno not in DISK_FULL:
            raise
        if meter:
            meter.close()
        try:        # most likely there is no room for it either
            write_reports(report(partial=True), out_dir)
            written = f"partial report in {out_dir / 'report.json'}"
        except OSError:
            written = "no report written"
        raise SweepError(f"no space left on the disk of {out_dir} ({error.strerror}) after {len(runs)} of "
                         f"{len(order)} runs; {written}; free some space, then finish with: "
                         f"kvstate sweep --resume {shlex.quote(str(out_dir))}{backend_option(backend)}"
                         f"{scheduler_option(scheduler)}") from error
    finally:
        try:
            log.close()     # flushes nothing new: each line was flushed as written, or failed to be
        except OSError:
            if completed:
                raise
        if executor is None and isinstance(pool, LocalPool) and not completed:
            pool.stop()     # stopped part way: its processes ended now, not after the runs they hold
        elif executor is None and pool is not None:
            pool.shutdown(wait=completed, cancel_futures=True)
    return final


# The errors of a write that found the disk full: the sweep stops and says how to finish it.
DISK_FULL = frozenset(code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if code is not None)


def config_labels(configs: Sequence[Config], declared: Sequence[Config] = ()) -> dict[str, Config]:
    """Each configuration under the label its runs, journal lines and replay files carry: its name,
    or, where the backend declares one name at several page sizes (``declared``: all it declares;
    ``configs_named`` gives them all), the name and ``-pageN``, so that no two are run, counted or
    saved as one, and one of them swept alone keeps the label its ``--resume`` names."""
    among = [*declared, *configs]
    return {config_label(c, among): c for c in configs}


def configs_labelled(names: Sequence[str], declared: Sequence[Config]) -> list[Config]:
    """The configurations ``--configs`` (or a journal's plan) names, each once, in order: a name
    (``configs_named``: every page size a backend declares it at) or a label ``config_labels`` made
    (``NAME-pageN``, one of them). A sweep of such a backend journals its labels, so its own
    ``--resume`` command names them."""
    labelled = config_labels(declared)
    chosen: list[Config] = []
    for name in names:
        chosen += [labelled[name]] if name in labelled else configs_named([name], declared)
    return list(dict.fromkeys(chosen))


LOCK = ".sweep.lock"
REPLAYS = "replays"


@contextmanager
def _only_sweep_in(out_dir: Path) -> Iterator[None]:
    """``out_dir`` held by this sweep alone while it runs: a second sweep or resume there (another
    process, another terminal) is refused at once, naming the folder. Two writers interleaved
    their journal lines and lost each other's runs. The lock is a POSIX record lock (``lockf`` on
    ``OUT/.sweep.lock``): it goes with the process, however it ends, and a pool's forked workers do
    not inherit it (an ``flock`` they shared outlived a killed sweep in its orphaned workers). Where
    ``fcntl`` is missing (Windows) there is none."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with _lock_file(out_dir / LOCK) as lock:
        if fcntl is not None:
            try:
                fcntl.lockf(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                raise SweepError(f"another sweep is running in {out_dir} (it holds {out_dir / LOCK}): wait for "
                                 "it to end, or pick another --out") from None
        yield


def _lock_file(path: Path):
    """``path`` opened to append, made if missing, refused unless it is a regular file of its own:
    through a symlink (a folder from elsewhere) the sweep made a file wherever it led, and a FIFO
    there blocked the open for good."""
    try:
        return open_own_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "a")
    except ValueError:
        raise SweepError(f"{path} is not a regular file (a symlink, FIFO or folder): a sweep locks its folder "
                         "only through a file of its own there; remove it, or pick another --out") from None


def _open_journal(out_dir: Path, plan: J.Plan, by_name: dict[str, Config], resume: bool):
    """The runs and shrinks already done (none for a new sweep) and the journal to add to; a journal
    line a resume could not save as a replay file refused with the rest, before anything is written."""
    _refuse_foreign_replays(out_dir)
    if not resume:
        J.refuse_foreign(out_dir)       # before it is read, and before a replay file beside it is removed
        earlier = _finished_sweep_in(out_dir)
        if earlier is not None:         # its failures' replay files, and only those: the folder holds this sweep's
            for label in earlier.configs:
                for seed in earlier.seeds:
                    (out_dir / REPLAYS / f"{label}-seed{seed}.json").unlink(missing_ok=True)
        return {}, {}, J.Journal.start(out_dir, plan)
    recorded = J.read(out_dir, by_name)
    mine, theirs = asdict(plan), asdict(recorded.plan)
    for side in (mine, theirs):     # the same file however it was named (journals from before paths were absolute)
        side["backend"] = canonical_backend(side["backend"])
    how = ("fingerprint", "workers", "run_timeout", "shrink_limit", "shrink_budget", "shrink_tries")    # a resume may change these
    changed = [key for key in mine if key not in how and mine[key] != theirs[key]]
    if changed:
        raise ResumeError(f"{out_dir} holds a sweep with other {', '.join(changed)}: "
                          + "; ".join(f"{key} {theirs[key]!r}, not {mine[key]!r}" for key in changed))
    differs = differences(plan.fingerprint, recorded.plan.fingerprint)      # here first: this machine's code
    if differs:
        raise BackendMismatchError(f"{out_dir} was swept with other code than this machine has: {describe(differs)}",
                                   {"this machine": differs})
    runs = {key: result_from_json(entry) for key, entry in recorded.runs.items()}
    shrunk = {key: result_from_json(entry) for key, entry in recorded.shrunk.items()}
    return runs, shrunk, J.Journal.reopen(out_dir)


def _refuse_foreign_replays(out_dir: Path) -> None:
    """``OUT/replays`` missing or a folder of its own, checked before a replay file there is written or
    removed: through a symlinked one (a folder from a CI artifact) a sweep wrote its replay files, and
    a new sweep removed the old ones, wherever the link led."""
    folder = out_dir / REPLAYS
    try:
        mode = folder.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise SweepError(f"{folder} is not a folder (a symlink or a file): a sweep writes its replay files only "
                         "into a folder of its own; remove it, or pick another --out")


def _finished_sweep_in(out_dir: Path) -> "J.Plan | None":
    """The plan of the finished sweep whose journal is in ``out_dir`` (a new sweep there replaces it),
    or None where there is none, or one stopped before its plan line was whole (``J.begun``: nothing
    of it ran). One that stopped part way is refused, naming ``--resume``: a new sweep would throw
    away the runs it finished. So is one that cannot be read (a damaged line), naming what is wrong
    where: whether it finished is not known (a CI retry of the sweep command replaced such a journal,
    and its runs, without a word)."""
    path = out_dir / J.FILE
    if not path.is_file():
        return None
    try:
        recorded = J.read(out_dir)
    except ResumeError as error:
        if not J.begun(out_dir):
            return None
        way_out = (f"mend the journal and finish it with kvstate sweep --resume {shlex.quote(str(out_dir))}, "
                   f"or move {path} aside to start over, or pick another --out")
        raise SweepError(f"{out_dir} holds a sweep whose journal cannot be read ({error}): a new sweep would "
                         f"throw away the runs it holds; {way_out}") from None
    planned = len(recorded.plan.seeds) * len(recorded.plan.configs)
    if len(recorded.runs) < planned:
        raise SweepError(f"{out_dir} holds a sweep that stopped after {len(recorded.runs)} of its {planned} runs: "
                         f"finish it with kvstate sweep --resume {shlex.quote(str(out_dir))}"
                         f"{backend_option(recorded.plan.backend)}, or pick another --out")
    return recorded.plan


def _leave_interrupts_to_parent() -> None:
    """Pool processes ignore Ctrl-C: the sweep process stops them, after writing what finished. A
    SIGTERM sent to one of them ends it (not the handler it inherited from ``terminated_as_interrupt``).
    A sweep killed outright (SIGKILL) stops nobody: each process then ends itself once its parent is
    gone (``_end_with``), where it used to live on, holding the sweep's output open (a CI step
    piping it waited for good)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sweep = multiprocessing.parent_process()
    if sweep is not None:
        threading.Thread(target=_end_with, args=(sweep.sentinel,), name="kvstate-sweep-watch", daemon=True).start()


def _pool_process(table, counter) -> None:
    """A pool process's initializer: interrupts left to the sweep, a row in its watchdog's table."""
    _leave_interrupts_to_parent()
    watchdog.join(table, counter)


def _end_with(sentinel) -> None:
    """Exit this pool process once the sweep that started it is gone: ``sentinel`` (the sweep process's,
    ``multiprocessing.parent_process``) becomes ready when it ends, however pool processes are
    started (under ``forkserver``, Python 3.14's default on Linux, ``getppid`` is the fork server, not
    the sweep). A pool process has nothing to save."""
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


class Terminated(KeyboardInterrupt):
    """A SIGTERM (a CI job's timeout, ``kill``), taken as Ctrl-C is: the partial report written, the
    pool's processes stopped, the journal left to resume. Killed outright, the sweep left last
    night's reports in place and its pool processes running with nobody to stop them."""


@contextmanager
def terminated_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` in this (the main) thread while the block runs; elsewhere a no-op.
    Only the first one raises: the block is stopping from then on, and a second SIGTERM (a CI runner
    that repeats it) raised inside the handlers that write the partial report and print the last line
    cut them short, ending the command by an uncaught interrupt instead of with status 143."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping = False

    def terminate(signum, frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise Terminated()
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:        # None: a handler installed from C, which Python cannot put back; the default instead
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


class ProcessDied(RuntimeError):
    """A run ended the process it ran in without a result (``os._exit``, a fatal signal, a crash in C
    code): a finding about its seed, recorded as a crash, its exit status or signal in the message,
    ``step`` the step it had begun (None: not known). Every local sweep runs in pool processes, one
    worker's too; only ``sweep(..., in_process=True)`` (or tasks no process can be sent) runs in the
    sweep's own process, which such a run ends with it."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


class Stuck(RunTimeout):
    """A task the watchdog killed, held in C past its limit: ``step``, the step it was in."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step

    @classmethod
    def past_limit(cls, step: int | None, ended: str = "the sweep ended its process") -> "Stuck":
        return cls(f"still running {watchdog.GRACE_S:g} s past its time limit (--run-timeout, or --shrink-budget for "
                   f"a shrink), in code no exception reaches (C code holding the GIL, a lock, a sleep); {ended}", step)


class LocalPool:
    """The sweep's local process pool, made anew when a run takes one down (``_map``): a dead pool
    process broke the whole pool, the sweep stopped as if the machine were lost, and every resume
    stopped at the same seed, which no report named. ``--workers 1`` is a pool of one process: the
    sweep's own process only reads results and writes files, so a run that crashes or hangs in C
    takes nothing of the sweep with it. Starting it costs about 30 ms (a fork); each run, no more
    than in the sweep's own process (the next job is already queued as one finishes)."""

    def __init__(self, workers: int):
        self.workers = workers
        self.stuck: dict[int, int] = {}         # task number -> step, for each task the watchdog killed
        self._numbers: dict[int, int] = {}      # id(job) -> its task number
        self.executor, self.guard = self._new(workers)

    def _new(self, workers: int) -> tuple[ProcessPoolExecutor, watchdog.Watchdog]:
        guard = watchdog.Watchdog(workers, self.stuck)
        return ProcessPoolExecutor(workers, initializer=_pool_process, initargs=guard.initargs), guard

    def number(self, job: tuple) -> int:
        return self._numbers.setdefault(id(job), len(self._numbers))

    def submit(self, executor: ProcessPoolExecutor, function: Callable, job: tuple):
        return executor.submit(watchdog.guarded, function, self.number(job), *job)

    def verdict(self, job: tuple) -> "Stuck | None":
        """``Stuck`` where the watchdog killed ``job``'s process; None otherwise."""
        number = self.number(job)
        return Stuck.past_limit(self.stuck[number]) if number in self.stuck else None

    def renew(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.guard.stop()
        self.executor, self.guard = self._new(self.workers)

    def window(self) -> int:
        """Jobs kept submitted: a few a process, so the jobs a dead process leaves in doubt (each run
        again alone) are those that could have been running, not every job of the sweep."""
        return 2 * self.workers

    def alone(self, function: Callable, job: tuple) -> object:
        """``function(*job)`` in a pool process of its own: its result, the exception it raised, or
        ``ProcessDied`` where it took that process down. An interrupt stops that process at once."""
        solo, guard = self._new(1)
        try:
            future = self.submit(solo, function, job)
            processes = _processes_of(solo)     # started by the submit: their exit codes are read below
            result = future.result()
        except BrokenExecutor:
            # Its exit status read once the pool's own thread has reaped it: read while that thread did,
            # it was lost now and then (both ``waitpid``, one gets ECHILD), and a timeout read as a crash.
            solo.shutdown(wait=True)
            codes = [process.exitcode for process in processes]
            result = self.verdict(job) or ProcessDied(
                "the run ended its process without a result (os._exit, a fatal signal or a crash in C code)"
                f"{_how_ended(codes)}", guard.last_step(self.number(job)))
        except FINDINGS as error:
            result = error
        except BaseException:           # Ctrl-C, SIGTERM: pool processes ignore SIGINT, so end it here
            _stop(solo)
            guard.stop()
            raise
        solo.shutdown(wait=True)
        guard.stop()
        return result

    def shutdown(self, wait: bool, cancel_futures: bool) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=cancel_futures)
        self.guard.stop()

    def stop(self) -> None:
        """Shut down without waiting, the runs in progress ended (SIGTERM): a sweep stopped by Ctrl-C
        otherwise waited, on its way out, for the runs its pool processes held (a stuck one for good)."""
        _stop(self.executor)
        self.guard.stop()


def _how_ended(codes: list) -> str:
    """``": exit status 3"``, ``": signal SIGSEGV"``, or nothing where no status is known."""
    how = ended_how(next((code for code in codes if code is not None), None))
    return f": {how}" if how else ""


def _processes_of(executor: ProcessPoolExecutor) -> list:
    """The executor's processes (CPython keeps them in ``_processes``; none where it does not)."""
    return list((getattr(executor, "_processes", None) or {}).values())


def _stop(executor: ProcessPoolExecutor) -> None:
    """Shut ``executor`` down without waiting for its runs: its processes are sent SIGTERM (their
    default action), then its manager thread, which sees them gone, is joined. Left running, that
    thread closed its wake-up pipe while CPython 3.11's exit hook wrote to it unlocked: now and then an
    ``OSError: Bad file descriptor`` traceback followed an interrupted command's one line."""
    for process in _processes_of(executor):
        try:
            process.terminate()
        except (OSError, ValueError):
            pass            # gone already
    executor.shutdown(wait=True, cancel_futures=True)


def _map(pool: "Executor | LocalPool | None", function: Callable, jobs: list[tuple],
         window: Callable[[], int] | None = None) -> Iterator[tuple[tuple, object]]:
    """(job, result) in completion order, in a pool or one by one here. A job whose task raised
    gets the exception as its result; a pool that went away (its futures cancelled under us,
    or broken) is ``ClusterLostError``, except a ``LocalPool`` broken by a process that died: each
    job it held runs again alone (``LocalPool.alone``), which names the one that takes its process
    down (``ProcessDied``), and the rest go on in a new pool.

    ``window()`` caps the jobs submitted and not yet read (None: submit them all at once).
    On a cluster, tasks the scheduler cannot hold back (ours ask for a resource) go to a
    worker as soon as they are submitted, and a worker that dies takes the blame for every
    task it held: enough deaths and Dask gives up on those tasks (``KilledWorker``) though
    they never ran there. A window of a few tasks per worker thread keeps that to the runs
    really in progress. Each future is let go once its result is read, too: a held
    future's result stays in a worker's memory, and is computed again if that worker dies.
    """
    if pool is None:
        for job in jobs:
            try:
                result = function(*job)
            except FINDINGS as error:       # as from a pool: the job's own failure, not the sweep's
                result = error
            yield job, result
        return
    finished: SimpleQueue = SimpleQueue()
    pending: dict = {}
    waiting = iter(jobs)

    if window is None and isinstance(pool, LocalPool):
        window = pool.window

    held_back: list[tuple] = []      # jobs a broken ``LocalPool`` refused: they never ran, and go first

    def top_up() -> None:
        limit = window() if window else len(jobs)
        while len(pending) < limit:
            job = held_back.pop() if held_back else next(waiting, None)
            if job is None:
                return
            try:
                future = (pool.submit(pool.executor, function, job) if isinstance(pool, LocalPool)
                          else pool.submit(function, *job))
            except BrokenExecutor:
                # A run took its process down between two submissions (with one process, a run that
                # dies at once did, now and then, and the sweep ended with BrokenProcessPool).
                if not isinstance(pool, LocalPool):
                    raise ClusterLostError() from None
                held_back.append(job)
                if pending:
                    return          # read below: its runs are run again alone, then the pool is made anew
                pool.renew()        # no run in flight to blame: a fresh pool (its first submission succeeds)
                continue
            pending[future] = job
            future.add_done_callback(finished.put)

    try:
        top_up()
        while pending:
            future = finished.get()
            job = pending.pop(future, None)
            if job is None:
                continue        # a future of a pool broken before: its job ran again alone
            try:
                result = future.result()
            except BrokenExecutor:
                if not isinstance(pool, LocalPool):
                    raise ClusterLostError() from None
                # One of the jobs in flight took its process down; those that finished keep their results.
                suspects = [job]
                for other, other_job in list(pending.items()):
                    if other.done() and not other.cancelled() and other.exception() is None:
                        yield other_job, other.result()
                    else:
                        suspects.append(other_job)
                pending.clear()
                pool.renew()
                for suspect in suspects:        # the one the watchdog killed is known: the others run again
                    yield suspect, pool.verdict(suspect) or pool.alone(function, suspect)
                top_up()
                continue
            except CancelledError:
                raise ClusterLostError() from None
            except FINDINGS as error:
                result = error
            del future
            yield job, result
            top_up()
    finally:
        for future in pending:
            future.cancel()


# -- reports ---------------------------------------------------------------------------

def summary_rows(report: SweepReport) -> list[dict]:
    """Per configuration: runs, steps, failures, summed run seconds, steps per second of one
    worker, and steps per CPU second (the figure that holds on a machine shared with others)."""
    rows = []
    for name in report.configs:
        mine = [r for r in report.results if r.config == name]
        seconds = sum(r.seconds for r in mine)
        cpu = sum(r.cpu_seconds for r in mine)
        steps = sum(r.steps for r in mine)
        rows.append({"config": name, "runs": len(mine), "steps": steps,
                     "failures": sum(not r.passed for r in mine), "run_seconds": round(seconds, 3),
                     "steps_per_second": round(steps / seconds, 1) if seconds else None,
                     "cpu_seconds": round(cpu, 3), "steps_per_cpu_second": round(steps / cpu, 1) if cpu else None})
    return rows


def format_summary(report: SweepReport) -> str:
    header = ("configuration", "runs", "steps", "failures", "run seconds", "steps/s per worker", "steps/CPU-s")
    rows = [header] + [(r["config"], str(r["runs"]), str(r["steps"]), str(r["failures"]),
                        f"{r['run_seconds']:.1f}", f"{r['steps_per_second'] or 0:,.0f}",
                        f"{r['steps_per_cpu_second'] or 0:,.0f}")
                       for r in summary_rows(report)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total_steps = sum(r.steps for r in report.results)
    where = f"{report.workers} worker{'s' if report.workers > 1 else ''}"
    if report.scheduler:
        where += f" of Dask scheduler {report.scheduler}"
    lines.append(f"\n{len(report.results)} runs, {total_steps} steps, {len(report.failures)} failures, "
                 f"wall {report.wall_seconds:.1f}s ({_session_rate(report)} on {where})")
    if report.resumed:
        lines.append(f"{report.resumed} of these runs were finished before the sweep was resumed")
    return "\n".join(lines)


def _session_rate(report: SweepReport) -> str:
    """Steps per second of wall time, this session's steps only: a resumed sweep's journal runs took none of
    its wall time, and counting them inflated the rate by as much as they were of the sweep."""
    steps = sum(r.steps for r in report.results) - report.resumed_steps
    rate = f"{steps / max(report.wall_seconds, 1e-9):,.0f} steps/s"
    return f"{rate} over this session's {steps} steps" if report.resumed else rate


def to_json(report: SweepReport) -> dict:
    return {
        "backend": report.backend, "steps": report.steps, "seeds": _compact(report.seeds),
        "configs": report.configs, "workers": report.workers, "shard": report.shard,
        "scheduler": report.scheduler, "partial": report.partial, "runs": len(report.results),
        "runs_expected": report.expected, "runs_resumed": report.resumed, "steps_resumed": report.resumed_steps,
        "wall_seconds": round(report.wall_seconds, 3), "summary": summary_rows(report),
        "clock_limited": clock_limited(report),
        "failures": [{"config": r.config, "seed": r.seed, "page_tokens": r.page_tokens, "steps": r.steps,
                      "failure": failure_to_json(r.failure), "replay_file": r.replay_file, "minimised": r.minimised,
                      "replay_steps": len(r.ops or []), "clock": r.clock} for r in report.failures],
    }


def clock_limited(report: SweepReport) -> list[str]:
    """``CONFIG seedN: STAGE`` for each stage of a failure that a wall-clock limit cut short, where two
    sweeps of the same plan may differ; empty: this report is the same on any machine, at any load."""
    return [f"{r.config} seed{r.seed}: {stage}" for r in report.failures for stage in r.clock]


def _compact(seeds: list[int]) -> str | list[int]:
    """A contiguous run of seeds as ``A:B``; anything else (a shard) as the list. Judged pairwise: a
    range from the first seed to the last of a sparse list (a shard of a wide range) took gigabytes."""
    if seeds and all(b == a + 1 for a, b in zip(seeds, seeds[1:])):
        return f"{seeds[0]}:{seeds[-1] + 1}"
    return seeds


# Characters XML 1.0 cannot hold, even escaped: a backend's message with a colour code (ESC) or a NUL made
# the file no XML at all, which CI parsers reject.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_text(text: str) -> str:
    """``text`` with every character XML cannot hold written as its escape, ``\\x1b``."""
    return _NOT_XML.sub(lambda found: f"\\x{ord(found.group()):02x}", text)


def to_junit(report: SweepReport) -> ET.ElementTree:
    """One testsuite per configuration, one testcase per seed: what CI systems list and count. A partial
    sweep (stopped, or its pool lost) has one more testsuite holding an error, so it never reads as green."""
    missing = report.expected - len(report.results)
    root = ET.Element("testsuites", name="kvstate sweep", tests=str(len(report.results) + bool(report.partial)),
                      failures=str(len(report.failures)), errors=str(int(report.partial)),
                      time=f"{report.wall_seconds:.3f}")
    if report.partial:
        suite = ET.SubElement(root, "testsuite", name="sweep.incomplete", tests="1", failures="0", errors="1")
        case = ET.SubElement(suite, "testcase", classname="kvstate.sweep", name="every planned run")
        ET.SubElement(case, "error", type="SweepIncomplete",
                      message=f"the sweep stopped with {missing} of its {report.expected} runs not run: "
                              "finish it with kvstate sweep --resume")
    for name in report.configs:
        mine = [r for r in report.results if r.config == name]
        suite = ET.SubElement(root, "testsuite", name=f"sweep.{name}", tests=str(len(mine)),
                              failures=str(sum(not r.passed for r in mine)),
                              time=f"{sum(r.seconds for r in mine):.3f}")
        for r in mine:
            case = ET.SubElement(suite, "testcase", classname=f"kvstate.sweep.{name}",
                                 name=f"seed {r.seed}", time=f"{r.seconds:.3f}")
            if not r.passed:
                failure = ET.SubElement(case, "failure", message=_xml_text(str(r.failure)),
                                        type=_xml_text(one_line(r.failure.error)))
                failure.text = _xml_text(f"replay: kvstate replay {r.replay_file}{backend_option(report.backend)}\n")
    return ET.ElementTree(root)


REPORTS = ("report.json", "junit.xml")


def report_paths(out_dir: Path) -> tuple[Path, Path]:
    """Where a sweep's reports are written: ``report.json`` and ``junit.xml`` in its folder."""
    return Path(out_dir) / REPORTS[0], Path(out_dir) / REPORTS[1]


def write_reports(report: SweepReport, out_dir: Path) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, junit_path = report_paths(out_dir)
    # each whole or not at all (written aside, then renamed over): an interrupt mid-write leaves no half file
    _write_whole(json_path, lambda path: path.write_text(json.dumps(to_json(report), indent=2) + "\n"))
    _write_whole(junit_path, lambda path: to_junit(report).write(path, encoding="unicode", xml_declaration=True))
    return json_path, junit_path


def _write_whole(path: Path, write: Callable[[Path], object]) -> None:
    aside = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(aside)
        os.replace(aside, path)
    finally:
        aside.unlink(missing_ok=True)


def failure_notes(report: SweepReport) -> str:
    """Each failure: where it is saved, how to replay it, and (for shrunk ones) a pytest test."""
    notes = []
    for r in report.failures:
        notes.append(f"FAIL {r.config} seed {r.seed}: {r.failure}\n"
                     f"  replay: kvstate replay {r.replay_file}{backend_option(report.backend)}")
        if r.clock:
            notes.append(f"  cut short ({', '.join(r.clock)}: a time limit, or a shrink lost): another machine "
                         "or load may report this failure otherwise")
        if r.minimised:
            notes.append(f"  minimised to {len(r.ops)} of {r.steps} steps; as a pytest test:\n")
            notes.append(as_pytest(load(Path(r.replay_file))))
    return "\n".join(notes)
