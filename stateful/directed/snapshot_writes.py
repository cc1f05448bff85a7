"""Directed check: how a snapshot is written, not only what it holds.

- Into a stream that already holds bytes (a ``BytesIO``, a file opened for append,
  a stream that cannot seek): the bytes before it stay as they were, and restoring
  from that offset gives back what the reference holds.
- In the format: the spec's own reader (``spec/snapshot_format.py``) takes the bytes for
  the context's tokens and values. A round trip through the engine alone cannot tell a body
  written and read back in another order.
- To a path: durably. The check records the ``os`` calls the write makes
  (``fsync``/``fdatasync``, ``replace``/``rename``; what each synced descriptor is,
  by ``fstat``) and requires the README's protocol: the bytes are written to a
  temporary file that is synced, at its full size, before it is renamed over the
  target, and the folder is synced after the rename. A writer that skips either sync
  is not durable across a crash, and no read can tell: only the record can.

Calls are recorded where Python code makes them: through the ``os`` module, and through the
names a loaded module bound to those functions (``from os import fsync, replace``; a module
first imported during the write binds the recording ones, put back after it); a backend
that syncs through another route (C code) is not seen and fails the durability part.

n/a for a backend without ``snapshot``/``restore``; the path part is n/a for one whose
``snapshot`` takes no path.
"""

from __future__ import annotations

import io
import os
import stat
import sys
import tempfile
import threading
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from kvstate.spec import precision as precisions
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.errors import SnapshotError, SnapshotVersionError
from kvstate.spec.protocol import Config, Factory
from kvstate.spec.semantics import may_refuse

from .. import ops as O
from .common import BrokenPromise, NotApplicable, filled, keeping, record
from ..lockstep import Lockstep

AT_OFFSET = ("a snapshot written into a stream that already holds bytes leaves those bytes as they were, "
             "and restoring from that offset gives back the context")
IN_FORMAT = ("a snapshot's bytes are spec/snapshot_format.py's format: the spec's own reader takes them for the "
             "context's tokens and values, positions first, in the cache's precision")
DURABLE = ("a snapshot written to a path goes to a temporary file that is synced, at its full size, before "
           "it is renamed over the target, and the folder is synced after the rename")

_PREFIX = b"KVS\x00 not a snapshot: bytes a caller wrote first\n" * 3
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
_recording = threading.Lock()      # one recorder patches the os module at a time


def snapshot_writes(factory: Factory, config: Config) -> None:
    """Snapshots into streams that already hold bytes round-trip; a snapshot to a path is durable."""
    run, n = filled(factory, config, _pages_that_leave_room(config))
    if not (hasattr(run.engine, "restore") and hasattr(run.live["c1"][0], "snapshot")):
        raise NotApplicable("the cache has no snapshot/restore")
    run.apply(O.Fork("c1"))
    run.apply(O.Overwrite("c2", n - 1, (2,), seed=4))          # c2: shares all but its last page
    empty = run.apply(O.Allocate())
    with tempfile.TemporaryDirectory(prefix="kvstate-directed-", dir=_SCRATCH) as folder:
        # The path first: a failure there reports the few operations that built c2, not the stream
        # writes too (an audit's in-place writer got a counterexample of 24 operations, 22 unrelated).
        path_form = _to_path(run, "c2", Path(folder) / "durable.kvs")
        for handle in ("c2", empty):
            _into_bytesio(run, handle)
            _into_appended_file(run, handle, Path(folder) / f"append-{handle}.bin")
            _into_unseekable(run, handle)
    run.finish()
    if not path_form:
        raise NotApplicable("streams pass; the backend's snapshot takes no path")


def _pages_that_leave_room(config: Config) -> float:
    """Pages of the check's first context: 2.5, or fewer where a pool that refuses could not hold it, c2's
    copy of its last page and a restore of c2 beside them (c1's pages twice, and one)."""
    if not (config.pool_limit and may_refuse(config.on_full)):
        return 2.5
    return min(2.5, max(0.5, (config.pool_limit - 1) // 2))


def _restore_and_compare(run: Lockstep, handle: str, stream, call: str) -> None:
    with keeping(AT_OFFSET, run, call):
        twin = run.restore_beside(call, lambda: run.engine.restore(stream), handle)
        if twin is None:
            raise NotApplicable(f"{call} was refused for room on both sides: the declared pool cannot hold "
                                "the check's contexts and a restore of them (the writes themselves passed)")
        run.check()
    # Compared: let it go, so a fixed pool (on_full="refuse") has room for the next restore.
    run.apply(O.Close(twin))


def _into_bytesio(run: Lockstep, handle: str) -> None:
    stream = io.BytesIO()
    stream.write(_PREFIX)
    call = f"{handle}.snapshot(a BytesIO holding {len(_PREFIX)} bytes, positioned at its end)"
    record(run, call)
    run.live[handle][0].snapshot(stream)
    _prefix_intact(call, stream.getvalue())
    _as_the_spec_reads_it(run, handle, stream.getvalue()[len(_PREFIX):], call)
    stream.seek(len(_PREFIX))
    _restore_and_compare(run, handle, stream, f"restore(that BytesIO, from offset {len(_PREFIX)})")


def _into_appended_file(run: Lockstep, handle: str, path: Path) -> None:
    path.write_bytes(_PREFIX)
    call = f"{handle}.snapshot(a file opened 'ab' that holds {len(_PREFIX)} bytes)"
    record(run, call)
    with open(path, "ab") as file:
        run.live[handle][0].snapshot(file)
    _prefix_intact(call, path.read_bytes())
    with open(path, "rb") as file:
        file.seek(len(_PREFIX))
        _restore_and_compare(run, handle, file, f"restore(that file, from offset {len(_PREFIX)})")


class _Unseekable(io.RawIOBase):
    """A write-only stream that cannot seek or tell (a pipe, a socket)."""

    def __init__(self, held: bytes):
        self.data = bytearray(held)

    def writable(self) -> bool:
        return True

    def write(self, chunk) -> int:
        self.data += bytes(chunk)
        return len(chunk)


def _into_unseekable(run: Lockstep, handle: str) -> None:
    stream = _Unseekable(_PREFIX)
    call = f"{handle}.snapshot(an unseekable stream that already took {len(_PREFIX)} bytes)"
    record(run, call)
    run.live[handle][0].snapshot(stream)
    data = bytes(stream.data)
    _prefix_intact(call, data)
    _restore_and_compare(run, handle, io.BytesIO(data[len(_PREFIX):]), "restore(the bytes it wrote)")


def _as_the_spec_reads_it(run: Lockstep, handle: str, data: bytes, call: str) -> None:
    """The engine's snapshot read by the spec's own reader equals the reference's context: a body in
    another order (layers first, say) that the engine's own restore reads back the same way passes
    every round trip, and no other engine or kvstate release could read it."""
    try:
        header = fmt.parse_header(data)
        arrays = fmt.check_body(header, memoryview(data)[header.size:header.size + header.body_bytes])
    except SnapshotVersionError as error:
        if "xxhash" in str(error):
            return          # an XXH3 body this installation cannot check: not the engine's fault
        raise BrokenPromise(IN_FORMAT, call, f"the spec's reader refuses it: {type(error).__name__}: {error}") from None
    except SnapshotError as error:
        raise BrokenPromise(IN_FORMAT, call, f"the spec's reader refuses it: {type(error).__name__}: {error}") from None
    config = run.config
    if header.precision != config.precision or header.layout != config.layout:
        raise BrokenPromise(IN_FORMAT, call, f"its header says {header.precision} {header.layout}, the cache is "
                                             f"{config.precision} {config.layout}")
    want_values, want_tokens = run.live[handle][1].read()
    tokens = arrays["tokens"].astype(np.int64)
    if not np.array_equal(tokens, want_tokens):
        at = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b),
                  min(len(tokens), len(want_tokens)))
        raise BrokenPromise(IN_FORMAT, call, f"the spec's reader finds {len(tokens)} tokens, the context holds "
                                             f"{len(want_tokens)}; they differ from position {at}")
    parts = (arrays["values"], arrays["scales"]) if header.precision == "q8" else (arrays["values"],)
    values = precisions.decode(header.precision, parts)
    differs = values.view(np.uint32) != want_values.view(np.uint32)
    if differs.any():
        index = tuple(int(i) for i in np.argwhere(differs)[0])
        raise BrokenPromise(IN_FORMAT, call, f"the spec's reader finds {values[index]!r} at {index} (position, layer, "
                                             f"k/v, head, dim), the context holds {want_values[index]!r}: the body "
                                             "is position-major, each position's (layers, 2, kv_heads, head_dim) "
                                             "values in turn")


def _prefix_intact(call: str, data: bytes) -> None:
    if data[:len(_PREFIX)] != _PREFIX:
        first = next(i for i, (a, b) in enumerate(zip(data + bytes(len(_PREFIX)), _PREFIX)) if a != b)
        raise BrokenPromise(AT_OFFSET, call, f"the bytes before the snapshot changed, from offset {first}")
    if len(data) == len(_PREFIX):
        raise BrokenPromise(AT_OFFSET, call, "nothing was written after the bytes already there")


# -- durability ----------------------------------------------------------------------------

def _to_path(run: Lockstep, handle: str, path: Path) -> bool:
    """Write ``handle`` to ``path`` twice (a new file, then over it), recording the os calls each
    time, and restore the file. False where the backend's snapshot takes no path."""
    for attempt in ("a new file", "over the file written before"):
        call = f"{handle}.snapshot({str(path)!r})    # {attempt}"
        record(run, call)
        before = set(os.listdir(path.parent))
        with _recorder() as events:
            try:
                run.live[handle][0].snapshot(path)
            except (TypeError, AttributeError, NotImplementedError):
                if attempt == "a new file" and not path.exists():
                    return False
                raise
        _durable(call, path, events)
        left = set(os.listdir(path.parent)) - before - {path.name}
        if left:
            raise BrokenPromise(DURABLE, call, f"left {sorted(left)} beside the target")
        if attempt == "a new file":
            run.apply(O.Overwrite(handle, 0, (1,), seed=12))    # the second write replaces other bytes
    call = f"restore({str(path)!r})"
    with keeping(DURABLE, run, call):
        twin = run.restore_beside(call, lambda: run.engine.restore(path), handle)
        if twin is not None:
            run.check()
            run.apply(O.Close(twin))        # room for the stream writes' restores after it, in a fixed pool
    return True


@contextmanager
def _recorder() -> Iterator[list[tuple]]:
    """Record fsync/fdatasync (what each descriptor is: a folder or a file, its inode and size) and
    replace/rename (the inode and size of what is renamed, and where to) while the block runs."""
    events: list[tuple] = []
    real = {name: getattr(os, name) for name in ("fsync", "fdatasync", "replace", "rename") if hasattr(os, name)}

    def syncing(name):
        def sync(fd):
            info = os.fstat(fd)
            events.append(("sync", "folder" if stat.S_ISDIR(info.st_mode) else "file",
                           (info.st_dev, info.st_ino), info.st_size, name))
            return real[name](fd)
        return sync

    def renaming(name):
        def rename(src, dst, *args, **kwargs):
            info = os.stat(src, dir_fd=kwargs.get("src_dir_fd"))
            events.append(("rename", "file", (info.st_dev, info.st_ino), info.st_size, os.fspath(dst)))
            return real[name](src, dst, *args, **kwargs)
        return rename

    wrappers = {name: syncing(name) if name in ("fsync", "fdatasync") else renaming(name) for name in real}
    with _recording:
        # ``os.fsync`` and the names a module bound before (``from os import fsync, replace``), whatever
        # it called them: a correct writer calling through those was reported as renaming nothing (s68).
        patched = [(os.__dict__, name, wrappers[name]) for name in real]
        patched += [(namespace, key, wrappers[name]) for namespace in _module_namespaces()
                    for key, value in list(namespace.items()) for name, function in real.items() if value is function]
        try:
            for namespace, key, wrapper in patched:
                namespace[key] = wrapper
            yield events
        finally:
            # Put back every wrapper found, not only those put: a module first imported during the record
            # (``from os import fsync`` in a lazy import) bound a wrapper, and kept it for good (s68/final F4).
            unwrapped = {id(wrapper): real[name] for name, wrapper in wrappers.items()}
            for namespace in [os.__dict__, *_module_namespaces()]:
                for key, value in list(namespace.items()):
                    if id(value) in unwrapped:      # by identity (the wrappers are alive here: ids unique)
                        namespace[key] = unwrapped[id(value)]


def _module_namespaces() -> list[dict]:
    """The writable globals of every loaded module but ``os`` itself (``posix`` holds the same functions):
    modules only, whose ``__dict__`` is a dict; a class or a lazy proxy registered in ``sys.modules`` is
    left alone (writing into a mappingproxy raised, blamed on the backend: s68/final F3)."""
    return [vars(module) for module in list(sys.modules.values())
            if isinstance(module, types.ModuleType) and module.__name__ not in ("os", "posix", "nt")
            and type(vars(module)) is dict]


def _durable(call: str, path: Path, events: list[tuple]) -> None:
    said = "; ".join(f"{e[4] if e[0] == 'sync' else 'rename'} {e[1]} inode {e[2][1]} ({e[3]} bytes)"
                     for e in events) or "none"
    renames = [i for i, e in enumerate(events) if e[0] == "rename" and _same(e[4], path)]
    if not renames:
        raise BrokenPromise(DURABLE, call, f"nothing was renamed over the target (os calls seen: {said})")
    at = renames[-1]
    _, _, inode, size, _ = events[at]
    if not any(e[0] == "sync" and e[1] == "file" and e[2] == inode and e[3] == size for e in events[:at]):
        raise BrokenPromise(DURABLE, call, f"the file renamed over the target was not synced at its full size "
                                           f"({size} bytes) before the rename (os calls seen: {said})")
    folder = os.stat(path.parent)
    if not any(e[0] == "sync" and e[1] == "folder" and e[2] == (folder.st_dev, folder.st_ino)
               for e in events[at + 1:]):
        raise BrokenPromise(DURABLE, call, f"the folder was not synced after the rename (os calls seen: {said})")


def _same(target: str, path: Path) -> bool:
    return os.path.abspath(target) == os.path.abspath(path)
