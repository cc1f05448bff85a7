"""Reading a snapshot without touching a cache: the header and its size checks, a peek at the
precision it holds (``peek_precision``), the cost bound (``max_bytes``), and a body read whole
with its checksum (``BodyChecksum``, on a worker thread for large bodies)."""

from __future__ import annotations

import io
import math
import queue
import threading
from typing import TYPE_CHECKING, Callable

import numpy as np

from kvstate.spec import snapshot_format as fmt
from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.errors import (InvalidInputError, KVStateError, SnapshotCorruptError, SnapshotError, SnapshotLayoutError,
                                 SnapshotReadError, SnapshotTooLargeError,
                                 SnapshotTruncatedError)
from kvstate.spec.positions import as_position

from . import remote_io
from . import snapshot_tuning as tuning
from .snapshot_files import open_regular
from .memory import physical_memory

if TYPE_CHECKING:
    from .cache import Cache


def restore_cost(cache: "Cache", header: fmt.Header) -> int:
    """Bytes a restore of ``header``'s file allocates at its peak: the body read whole, and the pages
    it fills (their stored bytes, token ids and per-page objects); into another precision also the
    values decoded to float32 and their encoding at the cache's precision (``_adopt_body``), which
    live beside the body until the pages are written."""
    pages = pages_needed(header.positions, cache.page_tokens)
    page_bytes = getattr(cache.store, "page_bytes", 0) + cache.page_tokens * 8 + tuning.PAGE_OVERHEAD_BYTES
    cost = header.body_bytes + pages * page_bytes
    if header.precision != cache.precision:
        numbers = header.positions * math.prod(header.layout.position_shape)
        per_number = getattr(cache.store, "conversion_bytes", tuning.CONVERSION_BYTES)
        cost += numbers * per_number[cache.precision]
    return cost


def cost_limit(cache: "Cache", max_bytes) -> "Callable[[fmt.Header], None] | None":
    if max_bytes is None:
        max_bytes = physical_memory()      # a file that cannot fit in RAM is refused, not swapped into
        if max_bytes is None:
            return None
    if isinstance(max_bytes, (bool, np.bool_)) or not isinstance(max_bytes, (int, np.integer)) or max_bytes < 0:
        raise InvalidInputError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
    max_bytes = int(max_bytes)          # a NumPy integer too, as positions are taken

    def check(header: fmt.Header) -> None:
        cost = restore_cost(cache, header)
        if cost > max_bytes:
            raise SnapshotTooLargeError(
                f"restoring {header.positions} positions of {header.layout} at {header.precision} takes "
                f"about {cost} bytes, above max_bytes={max_bytes}")
    return check


def read_snapshot(file, layout, size: int | None, limit: "Callable[[fmt.Header], None] | None" = None,
                  producer: bytes | None = None) -> tuple[fmt.Header, memoryview, "BodyChecksum"]:
    """Header, body bytes and the body's checksum (``.result()``), every length checked before the body is allocated.

    ``size`` is the number of bytes left in ``file`` when known (files, seekable
    streams); otherwise the body is read in bounded chunks so a lying header
    cannot make the reader allocate more than the stream really holds. ``limit(header)``
    raises when the restore would cost more than its caller allows: checked after the real
    size (where known), before the body is allocated or read, for streams of unknown size too.
    ``producer``: the one a version-3 file must name, if it names one (``SnapshotProducerError``).
    """
    header = read_header(file, layout, size, limit, producer)
    return read_body(file, header, size)


def read_header(file, layout, size: int | None, limit: "Callable[[fmt.Header], None] | None" = None,
                producer: bytes | None = None) -> fmt.Header:
    """The header, checked against ``layout``, ``producer``, the real size (when known) and ``limit``;
    nothing allocated."""
    header = fmt.parse_header(_header_bytes(file))
    if header.layout != layout:
        raise SnapshotLayoutError(f"snapshot layout {header.layout} (offset 12) differs from the cache's {layout}")
    fmt.check_expected_producer(header, producer)
    total = header.size + header.body_bytes
    if size is not None:
        if size < total:
            raise SnapshotTruncatedError(
                f"file holds {size} bytes; its header declares {total} ({header.positions} positions)")
        if size > total:
            raise SnapshotCorruptError(f"{size - total} unexpected bytes after the body, from offset {total}")
    if limit is not None:       # what the restore would take depends on the header alone, whatever the size
        limit(header)
    return header


def _header_bytes(file) -> bytes:
    """The header's bytes (48, or 64 for version 3), or as many as the file holds."""
    data = _read_exactly_or_less(file, fmt.HEADER_SIZE)
    version = int.from_bytes(data[8:10], "little") if len(data) == fmt.HEADER_SIZE else None
    if data[:len(fmt.MAGIC)] == fmt.MAGIC and version in fmt.LOADABLE_VERSIONS:
        data += _read_exactly_or_less(file, fmt.header_size(version) - fmt.HEADER_SIZE)   # version 3's is longer
    return data


def peek_precision(source) -> str | None:
    """The precision the snapshot at ``source`` holds, read from its header without using the source
    up; None where that cannot be done cheaply, or where the header is not a valid one (the restore
    itself then refuses it by name).

    Peeked: a path or ``file://`` URL (its header read, the file closed) and a binary stream that can
    seek (its header read from where it stands, then sought back there). Not peeked: another URL (a
    second request to its server) and a stream that cannot seek (a pipe, a socket: the bytes read
    would be missing from the restore)."""
    if remote_io.is_remote(source):
        return None
    if hasattr(source, "read"):
        return _peek_stream(source)
    try:
        file, _ = open_regular(remote_io.local_path(source, SnapshotReadError))
    except (SnapshotError, OSError, ValueError, TypeError):
        return None
    with file:
        return _precision_in(file)


def _peek_stream(stream) -> str | None:
    try:
        start = stream.tell() if seekable(stream) else None
    except (OSError, ValueError):
        start = None
    if start is None:
        return None
    try:
        return _precision_in(stream)
    finally:
        try:
            stream.seek(start)      # the restore reads the snapshot from there
        except (OSError, ValueError) as error:
            raise SnapshotReadError(f"{stream!r} did not seek back to {start} after its header was read: "
                                    f"{error!r}") from error


def _precision_in(file) -> str | None:
    try:
        return fmt.parse_header(_header_bytes(file)).precision
    except (SnapshotError, OSError, ValueError, TypeError):
        return None


def read_body(file, header: fmt.Header, size: int | None) -> tuple[fmt.Header, memoryview, "BodyChecksum"]:
    total = header.size + header.body_bytes
    threaded = size is not None and header.body_bytes >= tuning.THREADED_CRC_BYTES
    crc = BodyChecksum(header.version, header.checksum, threaded=threaded)
    with crc:
        if size is not None and hasattr(file, "readinto"):
            body = np.empty(header.body_bytes, np.uint8)     # sized from a checked header and the real file size
            view = memoryview(body)
            filled = 0
            while filled < len(body):
                got = checked_readinto(file, view[filled:filled + tuning.READ_CHUNK])
                if not got:
                    raise SnapshotTruncatedError(
                        f"file ended at offset {header.size + filled} while reading the body; "
                        f"expected {total} bytes")
                crc.feed(view[filled:filled + got])    # checksummed while the next piece is read
                filled += got
        else:
            body = bytearray()
            while len(body) < header.body_bytes:
                chunk = checked_read(file, min(tuning.CHUNK, header.body_bytes - len(body)))
                if not chunk:
                    raise SnapshotTruncatedError(
                        f"stream ended at offset {header.size + len(body)} while reading the body; "
                        f"expected {total} bytes")
                crc.feed(chunk)
                body += chunk
        if checked_read(file, 1):
            raise SnapshotCorruptError(f"unexpected bytes after the body, from offset {total}")
    return header, memoryview(body), crc


class BodyChecksum:
    """The body's checksum (``fmt.BodyHash`` of its version and checksum code), fed piece by piece in file order.

    For large bodies a worker thread computes it (``zlib.crc32`` and XXH3 release the GIL), so
    reading the next piece, and then the content checks, overlap the checksum. Used as a
    context manager: the worker always stops, also when reading fails halfway.
    """

    def __init__(self, version: int, checksum: int, threaded: bool):
        self._hash = fmt.BodyHash(version, checksum)
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


def checked_sections(header: fmt.Header, body, crc: "BodyChecksum") -> dict[str, np.ndarray]:
    """The sections of a body read whole, checked: their content (``check_body_content``) while the
    checksum thread finishes, and the checksum, whose mismatch is still the error reported first.
    Nothing is allocated: a restore adopts what this returns, a store's ``put`` only asks it."""
    try:
        arrays, content_error = fmt.check_body_content(header, body), None
    except SnapshotError as error:
        arrays, content_error = None, error
    fmt.check_body_crc(header, crc.result())
    if content_error is not None:
        raise content_error
    return arrays


def _read_exactly_or_less(file, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = checked_read(file, n - len(data))
        if not chunk:
            break
        data += chunk
    return data


# What a stream's own read may raise as it is: a named refusal (a remote read's deadline, say), and
# MemoryError (the machine's state, not the stream's: a caller may free memory and retry). Any other
# class is a SnapshotReadError naming it: only OSError and ValueError were, RuntimeError or KeyError
# reached the caller bare.
PASSED_THROUGH = (KVStateError, MemoryError)


def checked_read(file, n: int) -> bytes:
    """``file.read(n)``, refusing a text stream and a non-blocking one that has nothing yet by name."""
    try:
        chunk = file.read(n)
    except SystemError as error:        # ``io.RawIOBase.read`` over a ``readinto`` that returned a negative count
        raise SnapshotReadError(f"{file!r} is not a binary stream: {error}") from error
    except PASSED_THROUGH:
        raise
    except Exception as error:
        raise SnapshotReadError(f"cannot read a snapshot from {file!r}: {error!r}") from error
    if chunk is None:
        raise SnapshotReadError(f"{file!r} would block: restore needs a blocking stream")
    if not isinstance(chunk, (bytes, bytearray, memoryview)):
        raise SnapshotError(f"{file!r} is not a binary stream (read returned {type(chunk).__name__})")
    return chunk


def checked_readinto(file, view: memoryview) -> int:
    """``file.readinto(view)``, refusing a count outside ``0..len(view)`` by name: a stream's -1
    moved the read backwards, for ever, and a count past the view claimed bytes never read.
    None (a non-blocking stream with nothing yet) is refused as ``checked_read`` refuses it: read
    as 0, it was reported as a file ended early (``SnapshotTruncatedError``)."""
    try:
        got = file.readinto(view)
    except PASSED_THROUGH:
        raise
    except Exception as error:
        raise SnapshotReadError(f"cannot read a snapshot from {file!r}: {error!r}") from error
    if got is None:
        raise SnapshotReadError(f"{file!r} would block: restore needs a blocking stream")
    count = as_position(got)
    if count is None or not 0 <= count <= len(view):
        raise SnapshotReadError(f"{file!r} is not a binary stream: readinto of {len(view)} bytes returned {got!r}")
    return count


def seekable(stream) -> bool:
    try:
        return bool(stream.seekable())
    except (AttributeError, OSError, ValueError):
        return False


def remaining(stream) -> int | None:
    try:
        if not seekable(stream):
            return None
        here = stream.tell()
        end = stream.seek(0, io.SEEK_END)
        stream.seek(here)
        return end - here
    except (AttributeError, OSError):
        return None
