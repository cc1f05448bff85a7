"""``snapshot`` and ``restore`` as lockstep operations.

The engine writes real files into a temporary folder owned by the run; the
reference keeps a copy of what it read (``RefContext.snapshot``). Restoring
yields a new context handle on both sides, which every later check compares
position by position like any other context.
"""

from __future__ import annotations

import atexit
import io
import itertools
import multiprocessing.util
import os
import re
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from . import ops as O
from .lockstep import Lockstep


# What a snapshot may be called: the names runs give (s1, s2, ..., hit). Operations also come
# from data (a replay file, a sweep's journal), and the engine's snapshot is written to the run's
# folder under this name: a name that is a path ("/home/u/session", "../x") would write, or
# read, a file outside it.
SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _check_name(name) -> None:
    if not isinstance(name, str) or not SNAPSHOT_NAME.fullmatch(name):
        raise ValueError(f"snapshot name {name!r} is not 1 to 64 letters, digits, '_' or '-'")


@O.register
@dataclass(frozen=True)
class Snapshot(O.Op):
    ctx: str
    name: str
    kind = "snapshot"

    def __post_init__(self):
        _check_name(self.name)


@O.register
@dataclass(frozen=True)
class Restore(O.Op):
    name: str
    kind = "restore"
    creates = True

    def __post_init__(self):
        _check_name(self.name)


def _never_taken(lockstep: Lockstep, op: Restore) -> str | None:
    """A restore of a name this run has not snapshotted is the sequence's fault, not the backend's."""
    taken = lockstep.__dict__.get("_reference_snapshots", {})
    return None if op.name in taken else f"restores {op.name!r}, which this run has not snapshotted (taken: {sorted(taken)})"


# RAM-backed where there is one: thousands of snapshots per run, each fsynced twice,
# would otherwise spend the run waiting on the disk. KVSTATE_SCRATCH names another folder.
_SCRATCH = os.environ.get("KVSTATE_SCRATCH") or (
    "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None)
_PREFIX = "kvstate-lockstep-"
_own: tuple[int, Path, object] | None = None     # this process's (pid, scratch folder, held lock file)
_run_numbers = itertools.count()
_collected_prefixes: list[str] = []     # URL prefixes of collected runs (list.append: safe in a finalizer)
_forgetting = threading.Lock()
_making = threading.Lock()      # one folder a process, whichever of its threads (a Dask worker's) asks first
os.register_at_fork(after_in_child=lambda: globals().update(_making=threading.Lock()))   # never a held copy


def scratch_problem() -> str | None:
    """Why ``KVSTATE_SCRATCH`` cannot hold the checks' snapshot files, or None. Checked by the commands
    before any run: found at a run's first snapshot, inside the backend's step, it was reported as the
    backend raising (FileNotFoundError) and saved as the backend's failure."""
    named = os.environ.get("KVSTATE_SCRATCH")
    if not named:
        return None
    if not os.path.isdir(named) or not os.access(named, os.W_OK | os.X_OK):
        return f"KVSTATE_SCRATCH={named!r} is not a folder this process can write in"
    return None


def _folder(lockstep: Lockstep) -> Path:
    """The run's folder for snapshot files, inside this process's (``_process_folder``). It goes
    when the run's Lockstep is collected; a run still alive at exit goes with the process's."""
    path = lockstep.__dict__.get("_snapshot_path")
    if path is None:
        # Cleanup errors ignored: a check abandoned past its time limit may still be writing here while
        # the process exits, and its finalizer then printed a raw OSError ("Directory not empty").
        lockstep._snapshot_folder = tempfile.TemporaryDirectory(prefix="run-", dir=_process_folder(),
                                                                ignore_cleanup_errors=True)
        path = lockstep._snapshot_path = Path(lockstep._snapshot_folder.name)
    return path


def remove_files(lockstep: Lockstep) -> None:
    """Remove the run's snapshot files now, in this thread, for a caller done with the run (a shrink's
    try). Left to its ``TemporaryDirectory``'s finalizer, a run that is part of a reference cycle (a
    fifth of a shrink's tries) is removed by whichever allocation sets off the next collection, in
    whichever thread: on a Dask worker of CPython 3.11, once inside the profiler's
    ``sys._current_frames()``, whose thread-list lock the rmtree then held while it gave up the GIL,
    which deadlocked the worker (python/cpython#106883; ``worker_gate.stop_sampling_profiler``)."""
    folder = lockstep.__dict__.pop("_snapshot_folder", None)
    if folder is not None:
        del lockstep.__dict__["_snapshot_path"]     # a later snapshot of the run makes a new folder
        folder.cleanup()                            # and detaches the finalizer


def _url(lockstep: Lockstep, name: str) -> str:
    """A ``memory://`` URL for snapshot ``name``. A run's URLs go after its Lockstep is collected,
    at the next run's first URL (``_forget_collected_runs``)."""
    prefix = lockstep.__dict__.get("_url_prefix")
    if prefix is None:
        _forget_collected_runs()
        # A number, not id(lockstep): an id comes back once its run is collected, and a new run
        # under a collected run's prefix would lose its snapshots when that prefix is forgotten.
        prefix = lockstep._url_prefix = f"/kvstate-lockstep/{os.getpid()}-{next(_run_numbers)}"
        # Kept on the run, as before: a run holding URLs still refuses to be pickled, so no copy
        # of it can outlive the run under the same prefix.
        lockstep._urls_finalizer = weakref.finalize(lockstep, _collected_prefixes.append, prefix)
    return f"memory:/{prefix}/{name}.kvs"


def _process_folder() -> Path:
    """This process's scratch folder, made at its first snapshot file and removed when the process
    exits. Not at garbage collection: a pool worker leaves through ``os._exit``, which runs no
    finalizer and no ``atexit`` (only multiprocessing's exit hook), so runs still referenced then
    (a check's last run) used to leave their folders behind. A process killed outright removes
    nothing: it holds a lock on its folder's ``owner`` file while it lives, and each new folder's
    maker first removes the folders whose lock is free. Made under a lock: two threads of a Dask
    worker of several threads each made one at their first snapshot, and the first, its lock file
    dropped with the second's ``_own``, was removed as an orphan by the next process to make one
    while its run still wrote there (an ``errors`` invariant failure of a seed that runs clean)."""
    global _own
    pid = os.getpid()
    if _own is None or _own[0] != pid:          # a forked child makes its own
        with _making:
            if _own is None or _own[0] != pid:      # not made by another thread meanwhile
                _remove_orphans()
                making = Path(tempfile.mkdtemp(prefix=".making-", dir=_SCRATCH))
                lock = open(making / "owner", "w")
                if fcntl is not None:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                folder = making.with_name(f"{_PREFIX}{pid}-{making.name[len('.making-'):]}")
                making.rename(folder)                   # only locked folders ever carry the prefix
                _own = (pid, folder, lock)
                atexit.register(_remove, pid, folder)
                multiprocessing.util.Finalize(None, _remove, args=(pid, folder), exitpriority=0)
    return _own[1]


def _remove(pid: int, folder: Path) -> None:
    if os.getpid() == pid:                      # never a parent's folder, from a forked child's exit
        shutil.rmtree(folder, ignore_errors=True)


def _remove_orphans() -> None:
    """Remove the scratch folders of processes that are gone (their ``owner`` lock is free)."""
    if fcntl is None:
        return
    for folder in Path(_SCRATCH or tempfile.gettempdir()).glob(f"{_PREFIX}*"):
        try:
            with open(folder / "owner") as owner:
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except FileNotFoundError:       # a prefixed folder had its owner file from the start: a removal
            pass                        # cut short after deleting it (a kill mid-rmtree), left empty for good
        except OSError:                         # held (its process lives), or not ours
            continue
        shutil.rmtree(folder, ignore_errors=True)


def _forget_collected_runs() -> None:
    """Remove the URLs of the runs collected so far. Never from the finalizer itself: a collection
    can run it while fsspec walks the memory store (its ``find`` copies ``store.items()``, and
    each item it copies can set off a collection), and removing keys there made that walk raise
    "dictionary changed size during iteration" in whichever code was walking."""
    if not _collected_prefixes:
        return
    memory = fsspec.filesystem("memory")
    with _forgetting:
        while _collected_prefixes:
            prefix = _collected_prefixes.pop()
            if memory.exists(prefix):
                memory.rm(prefix, recursive=True)


def _target(lockstep: Lockstep, name: str):
    """Where the engine writes snapshot ``name`` (and later restores it from). A foreign engine:
    a file. Ours, in turn: a file; a ``memory://`` URL where fsspec is installed (``kvstate[remote]``,
    else a file); a file; an in-memory stream. Files keep half the snapshots, as before streams
    joined, and the stream reader keeps the other half (a URL is restored through it too), so the
    file, URL and stream writers and readers all run the machine's and the seeded runs' sequences;
    a quarter skip fsspec's machinery, the dearest of the three. Durability is the directed
    ``snapshot writes`` check's, not these sequences'."""
    targets = lockstep.__dict__.setdefault("_snapshot_targets", {})
    if name not in targets:
        turn = len(targets) % 4 if _speaks_urls(lockstep.engine) else 0
        if turn == 3:
            targets[name] = io.BytesIO()
        elif turn == 1 and _URLS:
            targets[name] = _url(lockstep, name)
        else:
            targets[name] = _folder(lockstep) / f"{name}.kvs"
    target = targets[name]
    if isinstance(target, io.BytesIO):
        target.seek(0)          # written from its start; restored from its start, as often as asked
    return target


def _speaks_urls(engine) -> bool:
    return type(engine).__module__.startswith("kvstate.impl")


class BackendHasNoSnapshots(Exception):
    """A snapshot or restore replayed on a backend without them: random runs never draw one there, so
    only a replay file written against another backend meets it (``kvstate replay`` exits 2 on it)."""


def _snapshot(lockstep: Lockstep, op: Snapshot, side: int, cache, ctx):
    if side == 0:
        if not (supports_snapshots(cache) and hasattr(ctx, "snapshot")):
            raise BackendHasNoSnapshots(f"{op}: the backend has no snapshot()/restore()")
        target = _target(lockstep, op.name)
        if isinstance(target, io.BytesIO):
            target.truncate()       # a name a refused snapshot left unused is written afresh
        return ctx.snapshot(target)
    lockstep.__dict__.setdefault("_reference_snapshots", {})[op.name] = ctx.snapshot()
    return None


def _restore(lockstep: Lockstep, op: Restore, side: int, cache, ctx):
    if side == 0:
        if not supports_snapshots(cache):
            raise BackendHasNoSnapshots(f"{op}: the backend has no snapshot()/restore()")
        return cache.restore(_target(lockstep, op.name))
    return cache.restore(lockstep.__dict__.get("_reference_snapshots", {})[op.name])


try:
    import fcntl
except ImportError:         # not on Windows: folders of killed processes stay there
    fcntl = None

try:
    import fsspec  # noqa: F401   (only whether it is there)
    _URLS = True
except ImportError:
    _URLS = False


def supports_snapshots(engine) -> bool:
    """Foreign engines without snapshots still run the rest of the machine."""
    return hasattr(engine, "restore")


Lockstep.extra_ops.update(snapshot=_snapshot, restore=_restore)
Lockstep.sequence_faults.update(restore=_never_taken)
