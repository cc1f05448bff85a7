"""Writing a context to a snapshot file and restoring one into a cache.

The format is ``spec/snapshot_format.py``. Writing to a path is atomic
(``impl/snapshot_files.py``: a temporary file in the target's folder, flushed and
fsynced, renamed over the target, then the folder fsynced, so a reader or a crash
sees the old complete file or the new complete one); a worker thread copies each page out and hashes it
while the previous piece is written (``_PiecesAhead``). Restoring validates the
whole file (header, sizes against the real file size, checksums, every token and
value) before the cache is touched: a refused restore changes no page, slot,
context or counter.

A local file of the cache's own precision into the NumPy store is streamed
(``_stream_restore``): header and sizes first, then a reader thread reads 4 MiB
pieces and hashes each while it is cache-hot, and this thread checks it and copies
it into page arrays prepared outside the cache (reused freed pages, or fresh ones on
huge-page boundaries); the pages join the cache only once everything has passed.
Bodies under ``PIPELINED_FROM_BYTES`` (or any, with ``IO_THREADS = 1``) run both pipelines
inline, without their worker thread (``pipelined``). Staging buffers are recycled between
calls (``StagingPool``), so they are not faulted in anew.
Other sources (in-memory and remote streams, other stores, another precision)
read the body whole, check it, then fill pages (``_adopt_body``).
"""

from __future__ import annotations

import io
import math
import os
import queue
import stat
import threading
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from kvstate.spec import precision as precisions
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.arithmetic import pages_needed, pages_touched, span_in_page
from kvstate.spec.errors import (KVStateError, SnapshotCorruptError, SnapshotError, SnapshotLayoutError, SnapshotNotFoundError,
                                 PrecisionRangeError, SnapshotPrecisionError, SnapshotReadError,
                                 SnapshotTooLargeError, SnapshotTruncatedError, SnapshotWriteError)

try:
    import fcntl
except ImportError:      # not POSIX: no append-mode detection, no partial-file locks
    fcntl = None

from .memory import physical_memory
from .snapshot_files import STALE_PARTIAL_SECONDS, clean_stale_partials, hold_partial, write_atomic  # noqa: F401
from .snapshot_files import fsync_folder as _fsync_folder  # noqa: F401  (callers and tests use these names here)

from . import remote_io

if TYPE_CHECKING:
    from .cache import Cache
    from .context import Context

_CHUNK = 1 << 20         # reads from streams of unknown size grow by at most this much at a time
_READ_CHUNK = 4 << 20    # reads of known size: checksummed piece by piece while cache-hot
_THREADED_CRC_BYTES = 8 << 20   # from this body size the checksum runs beside the reads
PAGE_OVERHEAD_BYTES = 1024      # Python objects per page (Page, token array, views): counted by ``max_bytes``
IO_THREADS: int | None = None   # 1: the restore and write pipelines run inline; 2: with their worker; None: ``pipelined``
PIPELINED_FROM_BYTES = 32 << 20  # automatic (IO_THREADS None): smaller bodies run inline


def pipelined(body_bytes: int) -> bool:
    """Whether a write or a streamed restore of a ``body_bytes`` body runs its worker thread.

    ``IO_THREADS`` decides when set. Otherwise the worker runs where there are two cores and the
    body is ``PIPELINED_FROM_BYTES`` or more: below that, starting the thread and handing pieces
    over cost more than the overlap bought. Measured on 2 cores, GPT-2-small f32, inline against
    threaded: a restore of 16 positions 0.23 against 0.51 ms alone (0.66 against 1.08 in
    ``bench.restore --worker always``), within noise of each other from 128 to 384 positions
    (9-28 MB), the worker ahead from 512 (38 MB); writes alike (16 positions 1.3 against
    1.7 ms, 512: 21 against 19 ms).
    """
    if IO_THREADS is not None:
        return IO_THREADS > 1
    return (os.cpu_count() or 1) > 1 and body_bytes >= PIPELINED_FROM_BYTES


# -- staging buffers -------------------------------------------------------------------

class StagingPool:
    """Staging buffers kept between snapshot writes and restores. A fresh buffer's first touch
    faults in every page of it, each time: about 0.6 ms for the 12 MiB a restore stages, as
    much as reading 10 MB (measured), and for a small file more than the write itself. Holds
    at most ``KEEP`` buffers of at most ``LARGEST`` bytes; safe from any thread."""

    KEEP = 4
    LARGEST = 16 << 20

    def __init__(self):
        self._spare: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least ``nbytes`` (contents arbitrary): the smallest spare that fits, else a new one."""
        with self._lock:
            for index, buffer in enumerate(self._spare):     # kept smallest first
                if buffer.size >= nbytes:
                    return self._spare.pop(index)
        return np.empty(nbytes, np.uint8)

    def give_back(self, buffers: list[np.ndarray]) -> None:
        with self._lock:
            for buffer in buffers:
                if buffer.size <= self.LARGEST and not any(buffer is spare for spare in self._spare):
                    self._spare.append(buffer)
            self._spare.sort(key=lambda b: b.size)
            del self._spare[:max(0, len(self._spare) - self.KEEP)]     # the largest are kept


_staging = StagingPool()


# -- writing ---------------------------------------------------------------------------

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
        _staging.give_back(self._taken)     # written out, the worker gone: free for the next write

    def _staging_for(self, part: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if len(self._taken) < self.DEPTH:
            block = _staging.take(_largest_piece(self._ctx))
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


def _header(ctx: "Context", body_crc: int) -> bytes:
    return fmt.pack_header(ctx._cache.precision, ctx._cache.layout, ctx._length, body_crc,
                           version=fmt.FORMAT_VERSION)


def _write_to(file, ctx: "Context") -> None:
    """Header and body into ``file``. A seekable file gets one pass (header patched last), others two.

    A stream that appends (mode "a", or a descriptor opened with ``O_APPEND``) ignores
    seeks, so it gets the two-pass order too: header first, then the body, in order.
    """
    if _seekable(file) and not _appends(file):
        start = file.tell()
        _put(file, bytes(fmt.HEADER_SIZE))     # zeros: a file cut short here fails the magic check
        crc = fmt.BodyHash(fmt.FORMAT_VERSION)
        if pipelined(fmt.body_size(ctx._cache.layout, ctx._cache.precision, ctx._length)):
            with _PiecesAhead(ctx, crc) as pieces:
                for chunk in pieces:
                    _put(file, chunk)
        else:
            block = _staging.take(_largest_piece(ctx))
            try:
                for chunk in _body_pieces(ctx, lambda part, shape, dtype: _block_view(block, shape, dtype)):
                    crc.update(chunk)
                    _put(file, chunk)
            finally:
                _staging.give_back([block])
        end = file.tell()
        file.seek(start)
        _put(file, _header(ctx, crc.value()))
        file.seek(end)
        return
    crc = fmt.BodyHash(fmt.FORMAT_VERSION)
    for chunk in body_chunks(ctx):
        crc.update(chunk)
    _put(file, _header(ctx, crc.value()))
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


def write_snapshot(ctx: "Context", target, deadline=None) -> None:
    """Write ``ctx`` to a path (atomically) or to an open binary stream (as is, then flushed).
    ``deadline`` (seconds) bounds a write to a URL in all (``impl/remote_deadline.py``)."""
    if remote_io.is_remote(target):     # an fsspec URL: published atomically, with retries (impl/remote_io.py)
        return remote_io.publish(target, lambda file: _write_to(file, ctx), deadline=deadline)
    target = remote_io.local_path(target)
    if hasattr(target, "write"):
        try:
            _write_to(target, ctx)
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
    write_atomic(path, lambda file: _write_to(file, ctx))


# -- restoring -------------------------------------------------------------------------

def restore_snapshot(cache: "Cache", source, max_bytes: int | None = None, deadline=None) -> "Context":
    """A new context of ``cache`` holding the snapshot at ``source`` (a path or binary stream).

    ``max_bytes`` caps what the restore may allocate (the body read plus the pages it
    fills, ``restore_cost``; default: the machine's physical memory); a file past it is
    ``SnapshotTooLargeError`` before anything is allocated. Every refusal of the source is
    a ``SnapshotError``. ``deadline`` (seconds) bounds a restore from a URL in all
    (``impl/remote_deadline.py``; past it ``SnapshotDeadlineError``).
    """
    if remote_io.is_remote(source):     # an fsspec URL: streamed into this same reader, with retries
        return remote_io.read(source, lambda file: restore_snapshot(cache, file, max_bytes), deadline=deadline)
    source = remote_io.local_path(source)
    limit = _cost_limit(cache, max_bytes)
    try:
        if hasattr(source, "read"):
            return _restore_from(cache, source, _remaining(source), limit)
        file, size = open_regular(source)
        with file:
            return _restore_from(cache, file, size, limit)
    except (OSError, ValueError, TypeError) as error:
        if isinstance(error, KVStateError):     # a named refusal (a snapshot's, or a precision's range)
            raise
        # An I/O error mid-read, a closed stream, a stream of the wrong kind.
        raise SnapshotReadError(f"cannot read a snapshot from {source!r}: {error!r}") from error


def _restore_from(cache: "Cache", file, size: int | None, limit) -> "Context":
    if size is not None and _local_file(file) and hasattr(cache.store, "prepare"):
        header = read_header(file, cache.layout, size, limit)
        if header.precision == cache.precision:
            return _stream_restore(cache, header, file)
        header, body, crc = _read_body(file, header, size)
    else:
        header, body, crc = read_snapshot(file, cache.layout, size, limit)
    return _adopt_body(cache, header, body, crc)


def _local_file(file) -> bool:
    """Whether ``file`` reads a local regular file: those are streamed into pages. Other streams
    (in memory, remote: a remote read retries whole on a transient failure, and fewer, larger
    reads leave a replaced object less room to fail one) are read whole first, as before."""
    try:
        return hasattr(file, "readinto") and stat.S_ISREG(os.fstat(file.fileno()).st_mode)
    except (AttributeError, OSError, ValueError, TypeError, io.UnsupportedOperation):
        return False


def _adopt_body(cache: "Cache", header: fmt.Header, body, crc: "BodyChecksum") -> "Context":
    """A body read whole (streams of unknown size, other stores, other precisions): checked, then adopted."""
    try:
        # The content checks run while the checksum thread finishes; a checksum mismatch is still
        # the error reported first, and nothing is allocated until both have passed.
        arrays, content_error = fmt.check_body_content(header, body), None
    except SnapshotError as error:
        arrays, content_error = None, error
    fmt.check_body_crc(header, crc.result())
    if content_error is not None:
        raise content_error
    parts = (arrays["values"], arrays["scales"]) if header.precision == "q8" else (arrays["values"],)
    if header.precision == cache.precision:
        encoded = cache.store.from_encoded(parts)
    else:
        # Another precision: what the file reads as, then the target's encoding (spec rules).
        try:
            encoded = cache.store.encode(precisions.decode(header.precision, parts))
        except PrecisionRangeError as error:
            raise SnapshotPrecisionError(f"the snapshot's {header.precision} values do not fit this "
                                         f"{cache.precision} cache: {error}") from None
    return _adopt(cache, arrays["tokens"], encoded, header.positions)


def _stream_restore(cache: "Cache", header: fmt.Header, file) -> "Context":
    """Restore a file of the cache's own precision at about the speed of reading it.

    Pipelined (``pipelined``: a large body, or ``IO_THREADS = 2``), a reader thread reads the
    body a piece at a time into a few reused staging buffers and checksums each piece while it
    is cache-hot (file reads and the checksum release the GIL); meanwhile this thread checks the
    previous piece (token signs, finite values, q8 ranges) and copies it into page arrays
    prepared for it (``store.prepare``: reused freed pages, or fresh ones whose copy is each
    byte's first touch). Otherwise the same steps run inline, a piece at a time. The cache is
    touched only after the checksum and every check have passed; a refused file leaves the
    prepared arrays to the garbage collector and changes nothing observable.
    """
    n, page_tokens, store = header.positions, cache.page_tokens, cache.store
    count = pages_needed(n, page_tokens)
    prepared = store.prepare(count, n - (count - 1) * page_tokens if count else 0)
    tokens = np.empty(n, fmt.TOKEN_DTYPE)
    content_error: SnapshotError | None = None
    with _PieceReader(file, header, threaded=pipelined(header.body_bytes)) as reader:
        for piece in reader:
            if content_error is not None:
                continue                    # the rest is still read: its checksum is reported first
            name, part, first, rows = piece
            try:
                fmt.check_section(header.precision, name, rows, first)
            except SnapshotError as error:
                content_error = error
                continue
            if part < 0:
                tokens[first:first + len(rows)] = rows
                continue
            stop = first + len(rows)
            for index in range(*pages_touched(first, stop, page_tokens)):
                lo, hi = span_in_page(index, first, stop, page_tokens)
                row = index * page_tokens + lo - first
                store.write_rows(prepared[index], part, lo, rows[row:row + hi - lo])
        actual = reader.checksum()
    fmt.check_body_crc(header, actual)     # a checksum mismatch is reported first
    if content_error is not None:
        raise content_error
    return _adopt_prepared(cache, tokens, prepared, n)


def _adopt_prepared(cache: "Cache", tokens: np.ndarray, prepared: list, n: int) -> "Context":
    """Pages made of ``prepared``'s filled arrays (``store.adopting``) for ``n`` validated positions,
    as a new context, in one critical section: the full-pool policy is consulted first, as for any
    allocation, and nothing else can be refused."""
    page_tokens = cache.page_tokens
    with cache.lock:
        with cache.store.adopting(prepared):
            pages = cache.pool.new_pages(pages_needed(n, page_tokens))
        for index, page in enumerate(pages):
            lo, hi = span_in_page(index, 0, n, page_tokens)
            page.tokens[lo:hi] = tokens[index * page_tokens:index * page_tokens + hi - lo]
            page.filled = hi
        ctx = cache._new_context(pages, 0)
        ctx._length = n
    return ctx


class _PieceReader:
    """The body of an open file, read in pieces of whole positions of one section, each
    checksummed in file order; iterated as ``(section, part, first row, rows)`` (``part`` -1
    for the tokens, else the page component the section fills; ``rows`` valid until the next
    piece is asked for).

    Threaded, a worker reads and checksums ahead while the caller uses the previous piece; a few
    staging buffers circulate between the threads, so the memory in flight stays at a few pieces
    whatever the file's size. Not threaded, the same runs inline with one staging buffer.
    Leaving the ``with`` stops the worker, also on error.

    Pieces of 4 MiB: each costs about 15 us of Python (queue, checks, page spans), so 1 MiB
    pieces cost 10-20% more at 512-2,048 tokens (measured); 4 MiB still stay in the L3 cache.
    Checking in the reader thread instead was slower (the threads then contend for the GIL).
    """

    PIECE_BYTES = 4 << 20
    DEPTH = 3

    def __init__(self, file, header: fmt.Header, threaded: bool = True):
        self._file = file
        self._header = header
        self._pieces: list[tuple[str, int, np.dtype, tuple[int, ...], int, int]] = []
        part = -1
        for name, dtype, shape in fmt.body_sections(header.layout, header.precision, header.positions):
            row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
            step = max(1, self.PIECE_BYTES // max(row_bytes, 1)) if name != "tokens" else max(1, header.positions)
            for first in range(0, header.positions, step):
                self._pieces.append((name, part, dtype, shape[1:], first, min(first + step, header.positions)))
            part += 1
        largest = max((np.dtype(d).itemsize * int(np.prod(r, dtype=np.int64)) * (b - a)
                       for _, _, d, r, a, b in self._pieces), default=0)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._buffers = [_staging.take(largest) for _ in range(min(self.DEPTH if threaded else 1, len(self._pieces)))]
        for buffer in self._buffers:
            self._free.put(buffer)
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._hash = fmt.BodyHash(header.version)
        self._worker = threading.Thread(target=self._run, daemon=True) if threaded else None

    def __enter__(self) -> "_PieceReader":
        if self._worker is not None:
            self._worker.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._worker is not None:
            self._stop.set()
            self._free.put(None)            # wakes a worker waiting for a buffer
            self._worker.join()
        _staging.give_back(self._buffers)  # the worker is gone and the pages hold copies: free to reuse

    def _read(self) -> Iterator[tuple]:
        """The pieces in file order, each read into a free staging buffer and checksummed, with the buffer."""
        offset = fmt.HEADER_SIZE
        for name, part, dtype, row_shape, first, stop in self._pieces:
            staging = self._free.get()
            if staging is None or self._stop.is_set():
                return
            nbytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64)) * (stop - first)
            view = memoryview(staging)[:nbytes]
            filled = 0
            while filled < nbytes:
                got = self._file.readinto(view[filled:])
                if not got:
                    raise SnapshotTruncatedError(
                        f"file ended at offset {offset + filled} while reading the body; "
                        f"expected {fmt.HEADER_SIZE + self._header.body_bytes} bytes")
                filled += got
            self._hash.update(view)
            offset += nbytes
            rows = staging[:nbytes].view(dtype).reshape((stop - first, *row_shape))
            yield (name, part, first, rows), staging
        if _checked_read(self._file, 1):
            raise SnapshotCorruptError(f"unexpected bytes after the body, from offset {offset}")

    def _run(self) -> None:
        try:
            for piece in self._read():
                self._ready.put(piece)
            self._ready.put(None)
        except BaseException as error:      # handed to the consumer, raised there
            self._ready.put(error)

    def __iter__(self) -> Iterator[tuple]:
        if self._worker is None:
            for piece, staging in self._read():
                yield piece
                self._free.put(staging)
            return
        while True:
            item = self._ready.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            piece, staging = item
            yield piece
            self._free.put(staging)         # the consumer is done with it

    def checksum(self) -> int:
        return self._hash.value()


def open_regular(source) -> tuple[io.BufferedReader, int]:
    """``source`` opened for reading, and its size, if it is a regular file; a ``SnapshotError`` if not.

    Opened with ``O_NONBLOCK`` and checked with ``fstat`` before any read: opening a FIFO
    with no writer would otherwise block forever, and a device (``/dev/zero``) or a
    directory is no snapshot. Blocking is switched back on for the reads.
    """
    try:
        path = os.fspath(source)
    except TypeError:
        raise SnapshotError(f"a snapshot comes from a path or a binary stream, not {type(source).__name__}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as error:
        raise SnapshotNotFoundError(f"no snapshot at {path!r}") from error
    except (OSError, ValueError) as error:     # permission, a symlink loop, a NUL in the path
        raise SnapshotError(f"cannot open snapshot {path!r}: {error}") from error
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SnapshotError(f"{path!r} is not a regular file ({_file_kind(info.st_mode)}); "
                                f"pass an open binary stream to restore from anything else")
        os.set_blocking(fd, True)
        return open(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def restore_cost(cache: "Cache", header: fmt.Header) -> int:
    """Bytes a restore of ``header``'s file allocates at its peak: the body read whole, and the pages
    it fills (their stored bytes, token ids and per-page objects)."""
    pages = pages_needed(header.positions, cache.page_tokens)
    page_bytes = getattr(cache.store, "page_bytes", 0) + cache.page_tokens * 8 + PAGE_OVERHEAD_BYTES
    return header.body_bytes + pages * page_bytes


def _cost_limit(cache: "Cache", max_bytes) -> "Callable[[fmt.Header], None] | None":
    if max_bytes is None:
        max_bytes = physical_memory()      # a file that cannot fit in RAM is refused, not swapped into
        if max_bytes is None:
            return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise SnapshotError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")

    def check(header: fmt.Header) -> None:
        cost = restore_cost(cache, header)
        if cost > max_bytes:
            raise SnapshotTooLargeError(
                f"restoring {header.positions} positions of {header.layout} at {header.precision} takes "
                f"about {cost} bytes, above max_bytes={max_bytes}")
    return check


def read_snapshot(file, layout, size: int | None,
                  limit: "Callable[[fmt.Header], None] | None" = None) -> tuple[fmt.Header, memoryview, "BodyChecksum"]:
    """Header, body bytes and the body's checksum (``.result()``), every length checked before the body is allocated.

    ``size`` is the number of bytes left in ``file`` when known (files, seekable
    streams); otherwise the body is read in bounded chunks so a lying header
    cannot make the reader allocate more than the stream really holds. ``limit(header)``
    raises when the restore would cost more than its caller allows: checked after the real
    size, before the body is allocated (for a stream of unknown size, once its body is read).
    """
    header = read_header(file, layout, size, limit)
    return _read_body(file, header, size, limit)


def read_header(file, layout, size: int | None, limit: "Callable[[fmt.Header], None] | None" = None) -> fmt.Header:
    """The header, checked against ``layout``, the real size (when known) and ``limit``; nothing allocated."""
    header = fmt.parse_header(_read_exactly_or_less(file, fmt.HEADER_SIZE))
    if header.layout != layout:
        raise SnapshotLayoutError(f"snapshot layout {header.layout} (offset 12) differs from the cache's {layout}")
    total = fmt.HEADER_SIZE + header.body_bytes
    if size is not None:
        if size < total:
            raise SnapshotTruncatedError(
                f"file holds {size} bytes; its header declares {total} ({header.positions} positions)")
        if size > total:
            raise SnapshotCorruptError(f"{size - total} unexpected bytes after the body, from offset {total}")
        if limit is not None:
            limit(header)
    return header


def _read_body(file, header: fmt.Header, size: int | None,
               limit: "Callable[[fmt.Header], None] | None" = None) -> tuple[fmt.Header, memoryview, "BodyChecksum"]:
    total = fmt.HEADER_SIZE + header.body_bytes
    crc = BodyChecksum(header.version, threaded=size is not None and header.body_bytes >= _THREADED_CRC_BYTES)
    with crc:
        if size is not None and hasattr(file, "readinto"):
            body = np.empty(header.body_bytes, np.uint8)     # sized from a checked header and the real file size
            view = memoryview(body)
            filled = 0
            while filled < len(body):
                got = file.readinto(view[filled:filled + _READ_CHUNK])
                if not got:
                    raise SnapshotTruncatedError(
                        f"file ended at offset {fmt.HEADER_SIZE + filled} while reading the body; "
                        f"expected {total} bytes")
                crc.feed(view[filled:filled + got])    # checksummed while the next piece is read
                filled += got
        else:
            body = bytearray()
            while len(body) < header.body_bytes:
                chunk = _checked_read(file, min(_CHUNK, header.body_bytes - len(body)))
                if not chunk:
                    raise SnapshotTruncatedError(
                        f"stream ended at offset {fmt.HEADER_SIZE + len(body)} while reading the body; "
                        f"expected {total} bytes")
                crc.feed(chunk)
                body += chunk
        if _checked_read(file, 1):
            raise SnapshotCorruptError(f"unexpected bytes after the body, from offset {total}")
    if size is None and limit is not None:
        limit(header)      # a stream of unknown size: its body is what it really held; the pages are next
    return header, memoryview(body), crc


class BodyChecksum:
    """The body's checksum (``fmt.BodyHash`` of its version), fed piece by piece in file order.

    For large bodies a worker thread computes it (``zlib.crc32`` and XXH3 release the GIL), so
    reading the next piece, and then the content checks, overlap the checksum. Used as a
    context manager: the worker always stops, also when reading fails halfway.
    """

    def __init__(self, version: int, threaded: bool):
        self._hash = fmt.BodyHash(version)
        self._pieces: queue.SimpleQueue | None = queue.SimpleQueue() if threaded else None
        self._worker = threading.Thread(target=self._run, daemon=True) if threaded else None

    def __enter__(self) -> "BodyChecksum":
        if self._worker is not None:
            self._worker.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._worker is not None and self._worker.is_alive():
            self._pieces.put(None)
            if exc[0] is not None:
                self._worker.join()

    def feed(self, piece) -> None:
        if self._pieces is None:
            self._hash.update(piece)
        else:
            self._pieces.put(piece)

    def result(self) -> int:
        if self._worker is not None:
            self._worker.join()
        return self._hash.value()

    def _run(self) -> None:
        while (piece := self._pieces.get()) is not None:
            self._hash.update(piece)


def _read_exactly_or_less(file, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = _checked_read(file, n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _checked_read(file, n: int) -> bytes:
    """``file.read(n)``, refusing a text stream and a non-blocking one that has nothing yet by name."""
    chunk = file.read(n)
    if chunk is None:
        raise SnapshotError(f"{file!r} would block: restore needs a blocking stream")
    if not isinstance(chunk, (bytes, bytearray, memoryview)):
        raise SnapshotError(f"{file!r} is not a binary stream (read returned {type(chunk).__name__})")
    return chunk


def _seekable(stream) -> bool:
    try:
        return bool(stream.seekable())
    except (AttributeError, OSError, ValueError):
        return False


def _remaining(stream) -> int | None:
    try:
        if not _seekable(stream):
            return None
        here = stream.tell()
        end = stream.seek(0, io.SEEK_END)
        stream.seek(here)
        return end - here
    except (AttributeError, OSError):
        return None


def _adopt(cache: "Cache", tokens: np.ndarray, encoded, n: int) -> "Context":
    """Pages for ``n`` validated positions, written, as a new context. Nothing can be refused here
    (running out of memory while allocating leaves no page behind: ``PagePool.new_pages``)."""
    with cache.lock:
        pages = cache.pool.new_pages(pages_needed(n, cache.page_tokens))
        ctx = cache._new_context(pages, 0)
    if n:
        ctx._write(0, n, tokens, encoded)
    with cache.lock:
        ctx._length = n
    return ctx
