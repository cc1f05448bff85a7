"""Restoring a snapshot into a cache: from a URL (``impl/remote_io.py``), a path or a stream.

A local regular file of the cache's own precision into a store that prepares pages is streamed
(``impl/snapshot_stream.py``); every other source is read whole and checked
(``impl/snapshot_read.py``), then its pages filled (``_adopt_body``). Either way the whole file is
validated before the cache is touched: a refused restore changes nothing."""

from __future__ import annotations

import io
import os
import stat
from functools import partial
from typing import TYPE_CHECKING, Callable

import numpy as np

from kvstate.spec import precision as precisions
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.errors import (KVStateError, PrecisionRangeError, SnapshotCorruptError,
                                 SnapshotPrecisionError, SnapshotReadError)

from . import remote_io
from .snapshot_read import BodyChecksum, checked_sections, cost_limit, open_regular, read_body, read_header, read_snapshot, remaining
from .snapshot_stream import _stream_restore

if TYPE_CHECKING:
    from .cache import Cache
    from .context import Context


def restore_snapshot(cache: "Cache", source, max_bytes: int | None = None, deadline=None,
                     producer: bytes | None = None, *, key: np.ndarray | None = None) -> "Context":
    """A new context of ``cache`` holding the snapshot at ``source`` (a path or binary stream).

    ``max_bytes`` caps what the restore may allocate (the body read plus the pages it
    fills, and a conversion's arrays from another precision: ``restore_cost``; default: the
    machine's physical memory); a file past it is ``SnapshotTooLargeError`` before anything is
    allocated, judged from the header. Every refusal of the source is
    a ``SnapshotError``. ``deadline`` (seconds or a ``Deadline``) bounds a restore from a URL in all
    (``impl/remote_deadline.py``; past it ``SnapshotDeadlineError``). ``producer``: what must have
    computed the values, where the file names what did (format version 3; ``SnapshotProducerError``).
    ``key``: the token ids the snapshot must hold (a second tier's object, stored under them): a file of
    another length is refused from its header, one of other ids once read, both as
    ``SnapshotCorruptError`` and before anything is allocated (a refused object had evicted entries).
    """
    limit = cost_limit(cache, max_bytes)       # a bad max_bytes is refused before any file or server is opened
    if producer is not None:
        fmt.check_producer(producer)        # refused by name before any file or server is touched
    if key is not None:
        limit = _of_length(len(key), limit)
    # Every context a try made, handed to no caller until this returns: an error or interrupt after
    # one was made (closing its file, a remote read's retry) closes it, where it had stayed out for good.
    made: list["Context"] = []
    try:
        restored = _restore(cache, source, limit, producer, key, deadline, made.append)
        for ctx in made:
            if ctx is not restored:     # an earlier try's, made before its read failed in closing
                ctx.close()
        return restored
    except BaseException:
        for ctx in made:
            if not ctx.closed:
                ctx.close()
        raise


def _restore(cache: "Cache", source, limit, producer: bytes | None, key: np.ndarray | None, deadline,
             keep: "Callable[[Context], None]") -> "Context":
    """``restore_snapshot``'s work; ``keep(ctx)`` is told of each context made."""
    if remote_io.is_remote(source):     # an fsspec URL: streamed into this same reader, with retries
        return remote_io.read(source, lambda file: _restore(cache, file, limit, producer, key, None, keep),
                              deadline=deadline)
    source = remote_io.local_path(source, SnapshotReadError)
    try:
        if hasattr(source, "read"):
            return _restore_from(cache, source, remaining(source), limit, producer, key, keep)
        file, size = open_regular(source)
        with file:
            return _restore_from(cache, file, size, limit, producer, key, keep)
    except (OSError, ValueError, TypeError) as error:
        if isinstance(error, KVStateError):     # a named refusal (a snapshot's, or a precision's range)
            raise
        # An I/O error mid-read, a closed stream, a stream of the wrong kind.
        raise SnapshotReadError(f"cannot read a snapshot from {source!r}: {error!r}") from error


def _restore_from(cache: "Cache", file, size: int | None, limit, producer: bytes | None,
                  key: np.ndarray | None, keep: "Callable[[Context], None]") -> "Context":
    if size is not None and _local_file(file) and hasattr(cache.store, "prepare"):
        header = read_header(file, cache.layout, size, limit, producer)
        if header.precision == cache.precision:
            return _stream_restore(cache, header, file, keep, partial(_check_key, key))
        header, body, crc = read_body(file, header, size)
    else:
        header, body, crc = read_snapshot(file, cache.layout, size, limit, producer)
    return _adopt_body(cache, header, body, crc, keep, key)


def _of_length(n: int, limit):
    """``limit``, and a header of ``n`` positions: checked before the body is read."""
    def check(header: fmt.Header) -> None:
        if header.positions != n:
            raise SnapshotCorruptError(f"holds {header.positions} positions, not the {n} of its key")
        if limit is not None:
            limit(header)
    return check


def _check_key(key: np.ndarray | None, tokens: np.ndarray) -> None:
    """Refuse token ids other than ``key``'s (when there is one), before the cache is touched."""
    if key is not None and not np.array_equal(tokens, key):
        at = int(np.flatnonzero(tokens != key)[0])
        raise SnapshotCorruptError(f"holds other token ids than its key's (position {at} reads {int(tokens[at])}, "
                                   f"the key {int(key[at])})")


def _local_file(file) -> bool:
    """Whether ``file`` reads a local regular file: those are streamed into pages. Other streams
    (in memory, remote: a remote read retries whole on a transient failure, and fewer, larger
    reads leave a replaced object less room to fail one) are read whole first, as before."""
    try:
        return hasattr(file, "readinto") and stat.S_ISREG(os.fstat(file.fileno()).st_mode)
    except (AttributeError, OSError, ValueError, TypeError, io.UnsupportedOperation):
        return False


def _adopt_body(cache: "Cache", header: fmt.Header, body, crc: "BodyChecksum",
                keep: "Callable[[Context], None]", key: np.ndarray | None = None) -> "Context":
    """A body read whole (streams of unknown size, other stores, other precisions): checked, then adopted."""
    arrays = checked_sections(header, body, crc)      # nothing is allocated until it passes
    _check_key(key, arrays["tokens"])
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
    return _adopt(cache, arrays["tokens"], encoded, header.positions, keep)


def _adopt(cache: "Cache", tokens: np.ndarray, encoded, n: int, keep: "Callable[[Context], None]") -> "Context":
    """Pages for ``n`` validated positions, written, as a new context, handed to ``keep`` once whole.
    Nothing can be refused here (running out of memory while allocating leaves no page behind:
    ``PagePool.new_pages``); an interrupt while the values are copied closes the context, which no
    caller holds yet, as does one landing as the context is made (the ``try`` holds the making too)
    or before ``keep`` has it (the ``try`` holds the return too)."""
    ctx = None
    try:
        with cache.lock:
            ctx = cache._new_pages_context(pages_needed(n, cache.page_tokens))
        if n:
            ctx._write(0, n, tokens, encoded)
        with cache.lock:
            ctx._holding = ctx._holding.with_length(n)
        keep(ctx)
        return ctx
    except BaseException:
        if ctx is not None and not ctx.closed:
            ctx.close()
        raise
