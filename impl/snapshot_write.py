"""Writing a context as a snapshot (``spec/snapshot_format.py``): to a path atomically
(``impl/snapshot_files.py``), to a URL through ``impl/remote_io.py``, or to an open stream.

A seekable stream gets a placeholder header, the body, then the real header (one pass over the
pages); pipelined (``tuning.pipelined``), a worker thread copies each page out and hashes it
while the previous piece is written (``_PiecesAhead``). Other streams are hashed first, then
written header first (two passes)."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import math
import os
import queue
import threading
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from kvstate.spec import snapshot_format as fmt
from kvstate.spec.arithmetic import pages_touched, span_in_page
from kvstate.spec.errors import SnapshotWriteError

try:
    import fcntl
except ImportError:      # not POSIX: no append-mode detection
    fcntl = None

from . import remote_io
from . import snapshot_tuning as tuning
from .snapshot_files import write_atomic
from .snapshot_read import seekable

if TYPE_CHECKING:
    from .context import Context

# Compressing writers say they can seek, but only forward while writing ("Negative seek in write
# mode"): they get the header-first order, as a stream that cannot seek does.
_FORWARD_ONLY = (gzip.GzipFile, bz2.BZ2File, lzma.LZMAFile)


def body_chunks(ctx: "Context") -> Iterator[np.ndarray]:
    """The body in file order, one page's rows of one section at a time, each contiguous.

    Page-sized pieces keep the checksum and the write on cache-hot bytes and the
    writer's extra memory at one page. Each piece is valid until the next one is asked
    for: the pieces of a section share one staging array, faulted in once and reused (a
    fresh array per page cost a first touch of every byte written). Called while the
    caller owns ``ctx``.
    """
    staging: dict[int, np.ndarray] = {}

    def staging_for(part: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if part not in staging:
            staging[part] = np.empty(shape, dtype)
        return staging[part]
    return _body_pieces(ctx, staging_for)


def _body_pieces(ctx: "Context", staging_for: Callable) -> Iterator[np.ndarray]:
    """``body_chunks``' pieces, each copied into ``staging_for(part, page rows shape, dtype)``."""
    cache, n = ctx._cache, ctx._length
    yield ctx._tokens().astype(fmt.TOKEN_DTYPE)
    for part, (_, dtype, shape) in enumerate(fmt.body_sections(cache.layout, cache.precision, n)[1:]):
        for index in range(*pages_touched(0, n, ctx.page_tokens)) if n else ():
            lo, hi = span_in_page(index, 0, n, ctx.page_tokens)
            piece = staging_for(part, (min(n, ctx.page_tokens), *shape[1:]), dtype)[:hi - lo]
            np.copyto(piece, cache.store.read_encoded(ctx._pages[index].buffer, lo, hi)[part], casting="same_kind")
            yield piece


def _largest_piece(ctx: "Context") -> int:
    """Bytes of the largest of ``_body_pieces``' pieces (one page's rows of a section, or the tokens)."""
    cache, n = ctx._cache, ctx._length
    return max(dtype.itemsize * math.prod(shape[1:]) * min(n, ctx.page_tokens)
               for _, dtype, shape in fmt.body_sections(cache.layout, cache.precision, n))


def _block_view(block: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return block[:math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


class _PiecesAhead:
    """The body's pieces, copied out of the pages and hashed by a worker thread while the writer
    writes the previous one (NumPy's copy, the hash and file writes release the GIL); iterated
    in file order. Two staging blocks circulate, so the memory in flight is two pages."""

    DEPTH = 2

    def __init__(self, ctx: "Context", hasher: fmt.BodyHash):
        self._ctx, self._hash = ctx, hasher
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._taken: list[np.ndarray] = []
        self._block: np.ndarray | None = None
        self._worker = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "_PiecesAhead":
        self._worker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._free.put(None)          # wakes a worker waiting for a block; it stops there
        self._worker.join()
        tuning.staging.give_back(self._taken)     # written out, the worker gone: free for the next write

    def _staging_for(self, part: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if len(self._taken) < self.DEPTH:
            block = tuning.staging.take(_largest_piece(self._ctx))
            self._taken.append(block)
        else:
            block = self._free.get()
            if block is None:
                raise _Stopped
        self._block = block
        return _block_view(block, shape, dtype)

    def _run(self) -> None:
        try:
            for piece in _body_pieces(self._ctx, self._staging_for):
                self._hash.update(piece)
                self._ready.put((piece, self._block))
                self._block = None
            self._ready.put(None)
        except _Stopped:
            pass
        except BaseException as error:      # handed to the writer, raised there
            self._ready.put(error)

    def __iter__(self) -> Iterator[np.ndarray]:
        while (item := self._ready.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            piece, block = item
            yield piece
            if block is not None:
                self._free.put(block)       # written: the worker may fill it again


class _Stopped(Exception):
    """The writer left early (an error); the worker stops."""


def _version(producer: bytes | None) -> int:
    """The format version a snapshot is written in: version 3 where it names a producer, else the
    one earlier builds read too."""
    return fmt.FORMAT_VERSION if producer is None else fmt.PRODUCER_VERSION


def _checksum(producer: bytes | None) -> int:
    """The body checksum written: version 1's or 2's own, or version 3's choice (XXH3 where there is xxhash)."""
    return fmt.VERSION_CHECKSUM.get(_version(producer), fmt.WRITTEN_CHECKSUM)


def _header(ctx: "Context", body_crc: int, producer: bytes | None) -> bytes:
    return fmt.pack_header(ctx._cache.precision, ctx._cache.layout, ctx._length, body_crc,
                           version=_version(producer), producer=producer, checksum=_checksum(producer))


def _write_to(file, ctx: "Context", producer: bytes | None = None) -> None:
    """Header and body into ``file``. A seekable file gets one pass (header patched last), others two.

    A stream that appends (mode "a", or a descriptor opened with ``O_APPEND``) ignores
    seeks, and a compressing writer seeks only forward, so they get the two-pass order too: header
    first, then the body, in order.
    """
    if seekable(file) and not _appends(file) and not isinstance(file, _FORWARD_ONLY):
        start = file.tell()
        _put(file, bytes(fmt.header_size(_version(producer))))     # zeros: a file cut short here fails the magic check
        crc = fmt.BodyHash(_version(producer), _checksum(producer))
        if tuning.pipelined(fmt.body_size(ctx._cache.layout, ctx._cache.precision, ctx._length)):
            with _PiecesAhead(ctx, crc) as pieces:
                for chunk in pieces:
                    _put(file, chunk)
        else:
            block = tuning.staging.take(_largest_piece(ctx))
            try:
                for chunk in _body_pieces(ctx, lambda part, shape, dtype: _block_view(block, shape, dtype)):
                    crc.update(chunk)
                    _put(file, chunk)
            finally:
                tuning.staging.give_back([block])
        end = file.tell()
        file.seek(start)
        _put(file, _header(ctx, crc.value(), producer))
        file.seek(end)
        return
    crc = fmt.BodyHash(_version(producer), _checksum(producer))
    for chunk in body_chunks(ctx):
        crc.update(chunk)
    _put(file, _header(ctx, crc.value(), producer))
    for chunk in body_chunks(ctx):
        _put(file, chunk)


def _put(file, data) -> None:
    """All of ``data`` into ``file``: a raw stream may take less than it was given (a pipe, a
    socket), so what each write returns is checked and the rest written again."""
    view = memoryview(data).cast("B")
    while len(view):
        written = file.write(view)
        if written is None and isinstance(file, io.RawIOBase):     # a raw non-blocking stream that took nothing
            raise SnapshotWriteError(f"{file!r} would block: snapshots need a blocking stream")
        if isinstance(written, bool) or not isinstance(written, int):
            return                  # a duck-typed writer that reports no count (None, itself) took it all
        if not 0 < written <= len(view):
            raise SnapshotWriteError(f"{file!r} wrote {written} of {len(view)} bytes")
        view = view[written:]


def _appends(stream) -> bool:
    mode = getattr(stream, "mode", "")
    if isinstance(mode, str) and "a" in mode:
        return True
    if fcntl is None:
        return False
    try:
        return bool(fcntl.fcntl(stream.fileno(), fcntl.F_GETFL) & os.O_APPEND)
    except (AttributeError, OSError, ValueError, TypeError, io.UnsupportedOperation):
        return False


def write_snapshot(ctx: "Context", target, deadline=None, producer: bytes | None = None) -> None:
    """Write ``ctx`` to a path (atomically) or to an open binary stream (as is, then flushed).
    ``deadline`` (seconds or a ``Deadline``) bounds a write to a URL in all (``impl/remote_deadline.py``).
    ``producer`` (16 bytes: what computed the values) makes it a version-3 file that names it;
    anything else is refused (``InvalidInputError``) before the target is touched."""
    if producer is not None:
        fmt.check_producer(producer)        # refused by name before any file or server is touched
    fmt.check_fits(ctx.layout, ctx._length)     # so is a context no restore could take back
    if remote_io.is_remote(target):     # an fsspec URL: published atomically, with retries (impl/remote_io.py)
        return remote_io.publish(target, lambda file: _write_to(file, ctx, producer), deadline=deadline)
    target = remote_io.local_path(target, SnapshotWriteError)
    if hasattr(target, "write"):
        try:
            _write_to(target, ctx, producer)
            if hasattr(target, "flush"):
                target.flush()
        except (OSError, ValueError, TypeError) as error:    # ValueError: closed; TypeError: a text stream
            raise SnapshotWriteError(f"writing the snapshot to {target!r} failed: {error}") from error
        return
    try:
        path = os.fsdecode(os.fspath(target))     # str or bytes, as restore takes them
    except TypeError:
        raise SnapshotWriteError(
            f"a snapshot goes to a path or a binary stream, not {type(target).__name__}") from None
    if not os.path.basename(path):      # "" or a folder's path: the temporary file went to the wrong folder
        raise SnapshotWriteError(f"the snapshot path {path!r} names no file")
    write_atomic(path, lambda file: _write_to(file, ctx, producer))
