"""Writing a context to a snapshot file and restoring one into a cache.

The format is ``spec/snapshot_format.py``. Writing to a path is atomic: a
temporary file in the target's folder, flushed and fsynced, renamed over the
target, then the folder fsynced, so a reader (or a crash) sees the old complete
file or the new complete one. Restoring validates the whole file (header,
sizes against the real file size, checksums, every token and value) before the
cache is touched: a refused restore changes no page, slot, context or counter.
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import threading
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from kvstate.spec import precision as precisions
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.arithmetic import pages_needed, pages_touched, span_in_page
from kvstate.spec.errors import (SnapshotCorruptError, SnapshotError, SnapshotLayoutError, SnapshotNotFoundError,
                                 SnapshotTruncatedError, SnapshotWriteError)

from . import remote_io

if TYPE_CHECKING:
    from .cache import Cache
    from .context import Context

_CHUNK = 1 << 20         # reads from streams of unknown size grow by at most this much at a time
_READ_CHUNK = 4 << 20    # reads of known size: checksummed piece by piece while cache-hot
_THREADED_CRC_BYTES = 8 << 20   # from this body size the checksum runs beside the reads


# -- writing ---------------------------------------------------------------------------

def body_chunks(ctx: "Context") -> Iterator[np.ndarray]:
    """The body in file order, one page's rows of one section at a time, each contiguous.

    Page-sized pieces keep the checksum and the write on cache-hot bytes and the
    writer's extra memory at one page. Called while the caller owns ``ctx``.
    """
    cache, n = ctx._cache, ctx._length
    yield ctx._tokens().astype(fmt.TOKEN_DTYPE)
    for part, (_, dtype, _) in enumerate(fmt.body_sections(cache.layout, cache.precision, n)[1:]):
        for index in range(*pages_touched(0, n, ctx.page_tokens)) if n else ():
            lo, hi = span_in_page(index, 0, n, ctx.page_tokens)
            yield np.ascontiguousarray(cache.store.read_encoded(ctx._pages[index].buffer, lo, hi)[part], dtype=dtype)


def _header(ctx: "Context", body_crc: int) -> bytes:
    return fmt.pack_header(ctx._cache.precision, ctx._cache.layout, ctx._length, body_crc)


def _write_to(file, ctx: "Context") -> None:
    """Header and body into ``file``. A seekable file gets one pass (header patched last), others two."""
    if _seekable(file) and "a" not in getattr(file, "mode", ""):     # appends ignore seeks
        start = file.tell()
        file.write(bytes(fmt.HEADER_SIZE))     # zeros: a file cut short here fails the magic check
        crc = 0
        for chunk in body_chunks(ctx):
            crc = fmt.crc32(chunk, crc)
            file.write(chunk)
        end = file.tell()
        file.seek(start)
        file.write(_header(ctx, crc))
        file.seek(end)
        return
    crc = 0
    for chunk in body_chunks(ctx):
        crc = fmt.crc32(chunk, crc)
    file.write(_header(ctx, crc))
    for chunk in body_chunks(ctx):
        file.write(chunk)


def write_snapshot(ctx: "Context", target) -> None:
    """Write ``ctx`` to a path (atomically) or to an open binary stream (as is, then flushed)."""
    if remote_io.is_remote(target):     # an fsspec URL: published atomically, with retries (impl/remote_io.py)
        return remote_io.publish(target, lambda file: _write_to(file, ctx))
    target = remote_io.local_path(target)
    if hasattr(target, "write"):
        try:
            _write_to(target, ctx)
            if hasattr(target, "flush"):
                target.flush()
        except OSError as error:
            raise SnapshotWriteError(f"writing the snapshot to {target!r} failed: {error}") from error
        return
    write_atomic(os.fspath(target), lambda file: _write_to(file, ctx))


def write_atomic(path: str, fill: Callable) -> None:
    """Replace ``path`` with what ``fill(file)`` writes: temp file, fsync, rename, fsync of the folder.

    On any failure the temporary file is removed, whatever was at ``path`` is
    untouched, and ``SnapshotWriteError`` says what failed.
    """
    folder = os.path.dirname(os.path.abspath(path))
    prefix = fmt.TEMP_PREFIX + os.path.basename(path) + "."
    try:
        fd, temp = tempfile.mkstemp(prefix=prefix, suffix=fmt.TEMP_SUFFIX, dir=folder)
    except OSError as error:
        raise SnapshotWriteError(f"cannot create a temporary file in {folder!r} for {path!r}: {error}") from error
    try:
        with open(fd, "wb") as file:
            fill(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException as error:
        try:
            os.unlink(temp)
        except OSError:
            pass
        if isinstance(error, OSError):
            raise SnapshotWriteError(
                f"writing snapshot {path!r} failed ({error}); the previous file there is intact") from error
        raise
    try:
        _fsync_folder(folder)
    except OSError as error:
        raise SnapshotWriteError(f"snapshot {path!r} was written but its folder could not be synced: {error}") from error


def _fsync_folder(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- restoring -------------------------------------------------------------------------

def restore_snapshot(cache: "Cache", source) -> "Context":
    """A new context of ``cache`` holding the snapshot at ``source`` (a path or binary stream)."""
    if remote_io.is_remote(source):     # an fsspec URL: streamed into this same reader, with retries
        return remote_io.read(source, lambda file: restore_snapshot(cache, file))
    source = remote_io.local_path(source)
    if hasattr(source, "read"):
        header, body, crc = read_snapshot(source, cache.layout, _remaining(source))
    else:
        try:
            file = open(os.fspath(source), "rb")
        except FileNotFoundError as error:
            raise SnapshotNotFoundError(f"no snapshot at {os.fspath(source)!r}") from error
        with file:
            header, body, crc = read_snapshot(file, cache.layout, os.fstat(file.fileno()).st_size)
    # The content checks run while the checksum thread finishes; a checksum mismatch is still
    # the error reported first, and nothing is allocated until both have passed.
    try:
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
        encoded = cache.store.encode(precisions.decode(header.precision, parts))
    return _adopt(cache, arrays["tokens"], encoded, header.positions)


def read_snapshot(file, layout, size: int | None) -> tuple[fmt.Header, memoryview, "BodyChecksum"]:
    """Header, body bytes and the body's checksum (``.result()``), every length checked before the body is allocated.

    ``size`` is the number of bytes left in ``file`` when known (files, seekable
    streams); otherwise the body is read in bounded chunks so a lying header
    cannot make the reader allocate more than the stream really holds.
    """
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
    crc = BodyChecksum(threaded=size is not None and header.body_bytes >= _THREADED_CRC_BYTES)
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
                chunk = file.read(min(_CHUNK, header.body_bytes - len(body)))
                if not chunk:
                    raise SnapshotTruncatedError(
                        f"stream ended at offset {fmt.HEADER_SIZE + len(body)} while reading the body; "
                        f"expected {total} bytes")
                crc.feed(chunk)
                body += chunk
        if file.read(1):
            raise SnapshotCorruptError(f"unexpected bytes after the body, from offset {total}")
    return header, memoryview(body), crc


class BodyChecksum:
    """CRC-32 of the body, fed piece by piece in file order.

    For large bodies a worker thread computes it (``zlib.crc32`` releases the GIL), so
    reading the next piece, and then the content checks, overlap the checksum. Used as a
    context manager: the worker always stops, also when reading fails halfway.
    """

    def __init__(self, threaded: bool):
        self.value = 0
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
            self.value = fmt.crc32(piece, self.value)
        else:
            self._pieces.put(piece)

    def result(self) -> int:
        if self._worker is not None:
            self._worker.join()
        return self.value

    def _run(self) -> None:
        while (piece := self._pieces.get()) is not None:
            self.value = fmt.crc32(piece, self.value)


def _read_exactly_or_less(file, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = file.read(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


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
