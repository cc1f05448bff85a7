"""The streamed restore: a local file of the cache's own precision into a store that prepares
page arrays (``store.prepare``), read, checked and copied a piece at a time, the cache touched
only once everything passed."""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from kvstate.spec import snapshot_format as fmt
from kvstate.spec.arithmetic import pages_needed, pages_touched, span_in_page
from kvstate.spec.errors import SnapshotCorruptError, SnapshotError, SnapshotTruncatedError

from . import snapshot_tuning as tuning
from .snapshot_read import checked_read, checked_readinto

if TYPE_CHECKING:
    from .cache import Cache
    from .context import Context


def _stream_restore(cache: "Cache", header: fmt.Header, file, keep: "Callable[[Context], None]",
                    check_tokens=None) -> "Context":
    """Restore a file of the cache's own precision at about the speed of reading it.

    Pipelined (``pipelined``: a large body, or ``IO_THREADS = 2``), a reader thread reads the
    body a piece at a time into a few reused staging buffers and checksums each piece while it
    is cache-hot (file reads and the checksum release the GIL); meanwhile this thread checks the
    previous piece (token signs, finite values, q8 ranges) and copies it into page arrays
    prepared for it (``store.prepare``: reused freed pages, or fresh ones whose copy is each
    byte's first touch). Otherwise the same steps run inline, a piece at a time. The cache is
    touched only after the checksum and every check have passed (``check_tokens(tokens)``, where
    given, among them); a refused file leaves the prepared arrays to the garbage collector and
    changes nothing observable.
    """
    n, page_tokens, store = header.positions, cache.page_tokens, cache.store
    count = pages_needed(n, page_tokens)
    prepared = store.prepare(count, n - (count - 1) * page_tokens if count else 0)
    tokens = np.empty(n, fmt.TOKEN_DTYPE)
    content_error: SnapshotError | None = None
    with _PieceReader(file, header, threaded=tuning.pipelined(header.body_bytes)) as reader:
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
    if check_tokens is not None:
        check_tokens(tokens)
    return _adopt_prepared(cache, tokens, prepared, n, keep)


def _adopt_prepared(cache: "Cache", tokens: np.ndarray, prepared: list, n: int,
                    keep: "Callable[[Context], None]") -> "Context":
    """Pages made of ``prepared``'s filled arrays (``store.adopting``) for ``n`` validated positions,
    as a new context, in one critical section: the full-pool policy is consulted first, as for any
    allocation, and nothing else can be refused. The context holds the pages from the moment they
    are made: an interrupt while their token ids go in closes it (no caller holds it yet), as does
    one landing as the store's ``adopting`` ends (the ``try`` holds the making too)."""
    page_tokens = cache.page_tokens
    ctx = None
    with cache.lock:
        try:
            with cache.store.adopting(prepared):
                ctx = cache._new_pages_context(pages_needed(n, page_tokens))
            for index, page in enumerate(ctx._pages):
                lo, hi = span_in_page(index, 0, n, page_tokens)
                page.tokens[lo:hi] = tokens[index * page_tokens:index * page_tokens + hi - lo]
                page.filled = hi
            ctx._holding = ctx._holding.with_length(n)
            keep(ctx)           # whole: from here the caller's ``restore_snapshot`` closes it on an error
            return ctx
        except BaseException:
            if ctx is not None and not ctx.closed:
                ctx.close()
            raise


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
        self._buffers = [tuning.staging.take(largest) for _ in range(min(self.DEPTH if threaded else 1, len(self._pieces)))]
        for buffer in self._buffers:
            self._free.put(buffer)
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._hash = fmt.BodyHash(header.version, header.checksum)
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
        tuning.staging.give_back(self._buffers)  # the worker is gone and the pages hold copies: free to reuse

    def _read(self) -> Iterator[tuple]:
        """The pieces in file order, each read into a free staging buffer and checksummed, with the buffer."""
        offset = self._header.size
        for name, part, dtype, row_shape, first, stop in self._pieces:
            staging = self._free.get()
            if staging is None or self._stop.is_set():
                return
            nbytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64)) * (stop - first)
            view = memoryview(staging)[:nbytes]
            filled = 0
            while filled < nbytes:
                got = checked_readinto(self._file, view[filled:])
                if not got:
                    raise SnapshotTruncatedError(
                        f"file ended at offset {offset + filled} while reading the body; "
                        f"expected {self._header.size + self._header.body_bytes} bytes")
                filled += got
            self._hash.update(view)
            offset += nbytes
            rows = staging[:nbytes].view(dtype).reshape((stop - first, *row_shape))
            yield (name, part, first, rows), staging
        if checked_read(self._file, 1):
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
