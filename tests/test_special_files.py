"""Special files and streams as snapshot sources and targets, one table (issue 13).

Every row either works (the snapshot round-trips) or is refused by a named
``SnapshotError`` within seconds, and a refused restore leaves the cache as it was.
"""

from __future__ import annotations

import io
import os
import socket
import threading

import numpy as np
import pytest

from helpers import LAYOUT, filled, make_cache

from kvstate import Cache, Layout
from kvstate.spec import errors
from kvstate.spec import snapshot_format as fmt


KEEP: list = []     # open ends and bound sockets a row needs alive during its call


@pytest.fixture(autouse=True)
def _close_kept():
    yield
    while KEEP:
        try:
            KEEP.pop().close()
        except OSError:
            pass


def _snapshot_bytes(n: int = 9, precision: str = "f16") -> bytes:
    buffer = io.BytesIO()
    filled(make_cache(precision=precision), n).snapshot(buffer)
    return buffer.getvalue()


# -- sources: each maker returns what to pass to restore --------------------------------------

def fifo(tmp):
    os.mkfifo(tmp / "fifo")
    return tmp / "fifo"


def unix_socket(tmp):
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(tmp / "sock"))
    KEEP.append(server)          # keep it bound for the call
    return tmp / "sock"


def sparse(tmp):
    """A header declaring 100,000 positions over a hole: the size is right, the bytes are zeros."""
    layout, n = LAYOUT, 100_000
    path = tmp / "sparse.kvs"
    with open(path, "wb") as file:
        file.write(fmt.pack_header("f16", layout, n, 12345))
        file.truncate(fmt.HEADER_SIZE + fmt.body_size(layout, "f16", n))
    return path


def nonblocking_empty_pipe(tmp):
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    KEEP.append(os.fdopen(write_end, "wb"))     # a writer exists, it just has not written
    return os.fdopen(read_end, "rb")


def pipe_with_a_snapshot(tmp):
    read_end, write_end = os.pipe()
    data = _snapshot_bytes()

    def feed():
        with os.fdopen(write_end, "wb") as writer:
            writer.write(data)
    threading.Thread(target=feed, daemon=True).start()
    return os.fdopen(read_end, "rb")


class ShrinksWhileRead(io.FileIO):
    """A file cut short after the header has been read (another process truncating it)."""

    def readinto(self, buffer):
        if self.tell() >= fmt.HEADER_SIZE:
            os.truncate(self.name, fmt.HEADER_SIZE + 8)
        return super().readinto(buffer)


class GrowsWhileRead(io.FileIO):
    """A file that gains bytes while it is read (another process appending)."""

    grown = False

    def readinto(self, buffer):
        if self.tell() >= fmt.HEADER_SIZE and not self.grown:
            self.grown = True
            with open(self.name, "ab") as other:
                other.write(b"more")
        return super().readinto(buffer)


class Backwards:
    """A stream whose ``readinto`` reads a few bytes, then returns -1 (from an audit: the body's
    read went backwards for ever; a raw stream's ``read`` raised a bare SystemError)."""

    calls = 0

    def readinto(self, buffer):
        self.calls += 1
        if self.calls > 100:        # the bug looped here for ever: fail the row instead of hanging it
            raise RuntimeError("readinto called 100 times")
        return super().readinto(buffer[:8]) if self.calls == 1 else -1


class BackwardsFile(Backwards, io.FileIO):
    pass


class BackwardsBytes(Backwards, io.BytesIO):
    pass


class BackwardsRaw(Backwards, io.RawIOBase):
    """Not seekable: read through ``RawIOBase.read``, which calls ``readinto``."""

    def __init__(self, data):
        self.data = io.BytesIO(data)

    def readable(self):
        return True

    def readinto(self, buffer):
        if self.calls == 0 and self.data.tell() < fmt.HEADER_SIZE:
            return self.data.readinto(buffer)      # the header whole
        self.calls += 1
        return self.data.readinto(buffer[:8]) if self.calls == 1 else -1


class BlocksAfterTheHeader(io.BytesIO):
    """A non-blocking stream with nothing more yet once the header is read (``readinto`` gives None;
    from a review: that read as the file's end, a ``SnapshotTruncatedError``, where ``read`` giving None
    is refused as a stream that would block)."""

    def readinto(self, buffer):
        return None if self.tell() >= fmt.HEADER_SIZE else super().readinto(buffer)


class FailsAfterTheHeader(io.BytesIO):
    """A stream whose own read fails once the header is read, with ``error`` (from a review: a ValueError
    was a named SnapshotReadError, a RuntimeError or KeyError reached the caller bare)."""

    def __init__(self, data, error):
        super().__init__(data)
        self.error = error

    def _fail(self):
        if self.tell() >= fmt.HEADER_SIZE:
            raise self.error("the stream's own failure")

    def read(self, n=-1):
        self._fail()
        return super().read(n)

    def readinto(self, buffer):
        self._fail()
        return super().readinto(buffer)


def failing(error):
    return lambda tmp: FailsAfterTheHeader(_snapshot_bytes(), error)


def changing(cls):
    def make(tmp):
        path = tmp / "changing.kvs"
        path.write_bytes(_snapshot_bytes())
        return cls(str(path), "r")
    return make


def regular(tmp):
    path = tmp / "ok.kvs"
    path.write_bytes(_snapshot_bytes())
    return path


SOURCES = [
    # name, maker, outcome: None = restores, else the error class
    ("regular file", regular, None),
    ("fifo", fifo, errors.SnapshotError),
    ("/dev/zero", lambda tmp: "/dev/zero", errors.SnapshotError),
    ("/dev/null", lambda tmp: "/dev/null", errors.SnapshotError),
    ("directory", lambda tmp: tmp, errors.SnapshotError),
    ("unix socket", unix_socket, errors.SnapshotError),
    ("sparse file", sparse, errors.SnapshotCorruptError),
    ("stream of /dev/zero", lambda tmp: open("/dev/zero", "rb"), errors.SnapshotCorruptError),
    ("non-blocking empty pipe", nonblocking_empty_pipe, errors.SnapshotError),
    ("pipe with a snapshot", pipe_with_a_snapshot, None),
    ("file shrinking during the read", changing(ShrinksWhileRead), errors.SnapshotTruncatedError),
    ("file growing during the read", changing(GrowsWhileRead), errors.SnapshotCorruptError),
    ("file whose readinto goes backwards", changing(BackwardsFile), errors.SnapshotReadError),
    ("stream whose readinto goes backwards", lambda tmp: BackwardsBytes(_snapshot_bytes()), errors.SnapshotReadError),
    ("raw stream whose readinto goes backwards", lambda tmp: BackwardsRaw(_snapshot_bytes()), errors.SnapshotReadError),
    ("stream that would block after the header", lambda tmp: BlocksAfterTheHeader(_snapshot_bytes()),
     errors.SnapshotReadError),
    *((f"stream whose read raises {error.__name__}", failing(error), errors.SnapshotReadError)
      for error in (ValueError, RuntimeError, KeyError, LookupError, OSError)),
    # the machine's state, not the stream's content: as it is (a caller may free memory and retry)
    ("stream whose read raises MemoryError", failing(MemoryError), MemoryError),
]


@pytest.mark.parametrize("name,make,outcome", SOURCES, ids=[row[0] for row in SOURCES])
def test_restore_from_special_sources(tmp_path, name, make, outcome):
    cache = make_cache(precision="f16")
    source = make(tmp_path)
    before = cache.stats()
    result = []

    def attempt():
        try:
            result.append(cache.restore(source))
        except BaseException as error:      # noqa: BLE001 -- checked below
            result.append(error)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(15)
    assert not worker.is_alive(), f"restore from {name} blocked"
    (got,) = result
    if outcome is None:
        assert not isinstance(got, BaseException), got
        assert len(got) == 9
    else:
        assert isinstance(got, outcome), f"{name}: {got!r}"
        assert str(got)
        assert cache.stats() == before
    if hasattr(source, "close"):
        source.close()


# -- targets ------------------------------------------------------------------------------------------

def append_mode_file(tmp):
    return open(tmp / "appended.kvs", "ab"), tmp / "appended.kvs"


def plus_mode_file(tmp):
    path = tmp / "plus.kvs"
    path.write_bytes(b"")
    return open(path, "r+b"), path


def full_nonblocking_pipe(tmp):
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    KEEP.append(os.fdopen(read_end, "rb"))    # a reader that never reads
    return os.fdopen(write_end, "wb"), None


def dev_full(tmp):
    return open("/dev/full", "wb"), None


TARGETS = [
    ("append-mode stream", append_mode_file, None),
    ("read-write stream", plus_mode_file, None),
    ("directory path", lambda tmp: (tmp, None), errors.SnapshotWriteError),
    ("path in a missing folder", lambda tmp: (tmp / "no" / "x.kvs", None), errors.SnapshotWriteError),
    ("non-blocking pipe nobody reads", full_nonblocking_pipe, errors.SnapshotWriteError),
    ("/dev/full stream", dev_full, errors.SnapshotWriteError),
    ("text stream", lambda tmp: (io.StringIO(), None), errors.SnapshotWriteError),
]


@pytest.mark.parametrize("name,make,outcome", TARGETS, ids=[row[0] for row in TARGETS])
def test_snapshot_to_special_targets(tmp_path, name, make, outcome):
    if name == "/dev/full stream" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    layout = Layout(8, 8, 64)               # about 2 MiB: more than a pipe's buffer
    cache = Cache(layout, page_tokens=64)
    ctx = cache.allocate()
    ctx.extend(list(range(256)), np.ones(layout.batch_shape(256), np.float32))
    target, path = make(tmp_path)
    try:
        if outcome is None:
            ctx.snapshot(target)
            target.close()
            assert cache.restore(path).tokens == ctx.tokens
        else:
            with pytest.raises(outcome):
                ctx.snapshot(target)
    finally:
        try:
            target.close()
        except (AttributeError, OSError):
            pass
