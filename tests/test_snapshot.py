"""Snapshots: round trips across page sizes, arenas and precisions, refusals that change nothing."""

import io
import os

import numpy as np
import pytest

from kvstate.impl.cache import Cache
from kvstate.reference import RefCache
from kvstate.spec import precision as precisions
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.errors import (PrecisionRangeError, SnapshotCorruptError, SnapshotPrecisionError, SnapshotError, SnapshotLayoutError,
                                 SnapshotTooLargeError, SnapshotTruncatedError, SnapshotVersionError,
                                 SnapshotNotFoundError, SnapshotWriteError)
from kvstate.spec.layout import Layout
from kvstate.spec.protocol import Config
from kvstate.stateful.ops import values_for

LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)
PRECISIONS = ("f32", "f16", "q8")


def bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


def filled(precision, page_tokens=4, arena_pages=0, n=11, seed=3, layout=LAYOUT):
    """An engine context and its reference twin, written in two pieces plus an overwrite of a shared page."""
    cache = Cache(layout, page_tokens=page_tokens, precision=precision, arena_pages=arena_pages)
    ref = RefCache(Config(layout, page_tokens, precision, arena_pages))
    tokens = [(7 * i) % 50 for i in range(n)]
    engine_ctx, ref_ctx = cache.allocate(), ref.allocate()
    for ctx in (engine_ctx, ref_ctx):
        ctx.extend(tokens[:n // 2], values_for(layout, n // 2, seed))
        ctx.extend(tokens[n // 2:], values_for(layout, n - n // 2, seed + 1))
    sibling = engine_ctx.fork()   # shares pages: the snapshot must see only engine_ctx's own values
    sibling.overwrite(0, [1], values_for(layout, 1, seed + 2))
    return cache, engine_ctx, ref_ctx


def assert_reads_equal(engine_ctx, ref_ctx):
    values, tokens = engine_ctx.read()
    ref_values, ref_tokens = ref_ctx.read()
    np.testing.assert_array_equal(bits(values), bits(ref_values))
    np.testing.assert_array_equal(tokens, ref_tokens)


@pytest.mark.parametrize("pages", [(64, 128), (128, 64), (3, 7), (7, 3), (1, 5)], ids=lambda p: f"{p[0]}to{p[1]}")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_restore_across_page_sizes_is_bit_exact(tmp_path, precision, pages):
    written_at, restored_at = pages
    cache, ctx, ref_ctx = filled(precision, page_tokens=written_at, n=150)
    path = tmp_path / "ctx.kvs"
    ctx.snapshot(path)
    target = Cache(LAYOUT, page_tokens=restored_at, precision=precision)
    restored = target.restore(path)
    assert len(restored) == 150
    assert len(target.observe().pages) == -(-150 // restored_at)
    assert_reads_equal(restored, ref_ctx)


@pytest.mark.parametrize("arenas", [(0, 3), (3, 0), (2, 50)], ids=lambda a: f"arena{a[0]}to{a[1]}")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_restore_across_arena_and_heap(precision, arenas):
    cache, ctx, ref_ctx = filled(precision, page_tokens=3, arena_pages=arenas[0])
    stream = io.BytesIO()
    ctx.snapshot(stream)
    target = Cache(LAYOUT, page_tokens=5, precision=precision, arena_pages=arenas[1])
    stream.seek(0)
    restored = target.restore(stream)
    assert_reads_equal(restored, ref_ctx)
    obs = target.observe()
    assert len(obs.arena_out) == min(arenas[1], 3)     # 11 positions at 5 per page: 3 pages
    restored.close()
    assert not target.observe().pages


@pytest.mark.parametrize("source", PRECISIONS)
@pytest.mark.parametrize("target_precision", PRECISIONS)
def test_restore_into_another_precision_converts_by_spec_rules(source, target_precision):
    cache, ctx, ref_ctx = filled(source, page_tokens=4)
    stream = io.BytesIO()
    ctx.snapshot(stream)
    stream.seek(0)
    target = Cache(LAYOUT, page_tokens=6, precision=target_precision)
    restored = target.restore(stream)
    # The reference converts the same way: what the source read, encoded by the target's rule.
    ref_target = RefCache(Config(LAYOUT, 6, target_precision))
    twin = ref_target.restore(ref_ctx.snapshot())
    assert_reads_equal(restored, twin)
    expected = precisions.roundtrip(target_precision, ref_ctx.read()[0])
    np.testing.assert_array_equal(bits(restored.read()[0]), bits(expected))


def test_empty_context_round_trips():
    cache = Cache(LAYOUT)
    stream = io.BytesIO()
    cache.allocate().snapshot(stream)
    assert len(stream.getvalue()) == fmt.HEADER_SIZE
    stream.seek(0)
    restored = Cache(LAYOUT, page_tokens=2).restore(stream)
    assert len(restored) == 0 and restored.tokens == []


def test_non_seekable_stream_round_trips():
    class Pipe:
        def __init__(self, data):
            self.inner = io.BytesIO(data)

        def read(self, n=-1):
            return self.inner.read(n)

    cache, ctx, ref_ctx = filled("q8")
    stream = io.BytesIO()
    ctx.snapshot(stream)
    restored = Cache(LAYOUT, precision="q8").restore(Pipe(stream.getvalue()))
    assert_reads_equal(restored, ref_ctx)
    with pytest.raises(SnapshotTruncatedError):
        Cache(LAYOUT, precision="q8").restore(Pipe(stream.getvalue()[:-1]))
    with pytest.raises(SnapshotCorruptError, match="after the body"):
        Cache(LAYOUT, precision="q8").restore(Pipe(stream.getvalue() + b"\x00"))


def test_file_size_is_the_stored_form():
    """q8 and f16 files hold the stored form, so they are no larger than the memory they came from."""
    sizes = {}
    for precision in PRECISIONS:
        cache, ctx, _ = filled(precision, page_tokens=4, n=64)
        stream = io.BytesIO()
        ctx.snapshot(stream)
        sizes[precision] = len(stream.getvalue())
        pages = len(ctx._pages)
        in_memory = pages * (cache.store.page_bytes + cache.page_tokens * 8)   # values + int64 token slots
        assert sizes[precision] <= in_memory
        assert sizes[precision] == fmt.HEADER_SIZE + fmt.body_size(LAYOUT, precision, 64)
    values = 64 * LAYOUT.values_per_position
    assert sizes["f32"] - sizes["f16"] == 2 * values
    assert sizes["f16"] - sizes["q8"] == values - 4 * values // LAYOUT.head_dim


def state_of(cache):
    return cache.observe(), cache.stats(), cache._next_context_id


@pytest.mark.parametrize("precision", PRECISIONS)
def test_refused_restores_change_nothing(tmp_path, precision):
    cache, ctx, _ = filled(precision, arena_pages=2)
    cache.retain(ctx)
    good = tmp_path / "good.kvs"
    ctx.snapshot(good)
    data = good.read_bytes()
    before = state_of(cache)
    bad = tmp_path / "bad.kvs"
    cases = [
        (data[:-1], SnapshotTruncatedError, "header declares"),
        (data[:20], SnapshotTruncatedError, "inside the 48-byte header"),
        (data + b"x", SnapshotCorruptError, "unexpected bytes"),
        (data[:-1] + bytes([data[-1] ^ 1]), SnapshotCorruptError, "body checksum"),
        (data[:30] + bytes([data[30] ^ 1]) + data[31:], SnapshotCorruptError, "header checksum"),
        (b"PK\x03\x04" + data[4:], SnapshotCorruptError, "bad magic"),
        (data[:8] + b"\x09\x00" + data[10:], SnapshotVersionError, "version 9"),
    ]
    for content, error, message in cases:
        bad.write_bytes(content)
        with pytest.raises(error, match=message):
            cache.restore(bad)
        assert state_of(cache) == before
    with pytest.raises(SnapshotLayoutError, match="differs from the cache"):
        Cache(Layout(2, 2, 8), precision=precision).restore(good)


def test_huge_declarations_are_refused_without_allocating():
    import tracemalloc

    from kvstate.fuzz.snapshot_fuzz import signed_header

    class Pipe:
        def __init__(self, data):
            self.inner = io.BytesIO(data)

        def read(self, n=-1):
            return self.inner.read(n)

    big = Layout(fmt.MAX_LAYERS, fmt.MAX_KV_HEADS, fmt.MAX_HEAD_DIM)
    cache = Cache(big)    # allocates nothing until a context is written
    tracemalloc.start()
    try:
        with pytest.raises(SnapshotTooLargeError, match="3000000000"):
            cache.restore(io.BytesIO(signed_header("f32", big, 3_000_000_000)))
        # At the limit, the header is legal and declares ~10^18 bytes: the real size refuses it.
        with pytest.raises(SnapshotTruncatedError, match="declares"):
            cache.restore(io.BytesIO(signed_header("f32", big, fmt.MAX_POSITIONS)))
        # A stream of unknown size: refused by what its header declares, before its body is read.
        with pytest.raises(SnapshotTooLargeError, match="above max_bytes"):
            cache.restore(Pipe(signed_header("f32", big, fmt.MAX_POSITIONS) + b"\x00" * 1000))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20
    assert cache.stats()["pages_allocated"] == 0


@pytest.mark.parametrize("precision", PRECISIONS)
def test_hostile_files_with_valid_checksums_are_refused_by_name(precision):
    from kvstate.fuzz.snapshot_fuzz import host_cache, hostile_files

    expected = {
        "negative token id": (SnapshotCorruptError, "token id -1 at position 0"),
        "NaN value": (SnapshotCorruptError, "not finite"),
        "infinite value": (SnapshotCorruptError, "not finite"),
        "f16 infinity": (SnapshotCorruptError, "not finite"),
        "q8 code -128": (SnapshotCorruptError, "q8 code -128"),
        "q8 negative scale": (SnapshotCorruptError, "q8 scale"),
        "q8 NaN scale": (SnapshotCorruptError, "q8 scale"),
        "q8 huge scale": (SnapshotCorruptError, "q8 scale"),
        "reserved byte set": (SnapshotCorruptError, "reserved byte at offset 11"),
        "version 3, checksum code 7": (SnapshotCorruptError, "checksum code 7 at offset 11"),
        "unknown precision code": (SnapshotCorruptError, "precision code 7 at offset 10"),
        "zero layers": (SnapshotCorruptError, "layers at offset 12 is 0"),
        "body_bytes off by one": (SnapshotCorruptError, "body_bytes at offset 32"),
        f"version {max(fmt.KNOWN_VERSIONS) + 1}": (SnapshotVersionError,
                                                   f"version {max(fmt.KNOWN_VERSIONS) + 1} at offset 8"),
        "another layout": (SnapshotLayoutError, "differs"),
        "billions of positions": (SnapshotTooLargeError, "positions at offset 24"),
        "one past the position limit": (SnapshotTooLargeError, "16777217"),
        "the position limit, no body": (SnapshotTruncatedError, "declares"),
    }
    cache = host_cache(precision)
    before = state_of(cache)
    seen = 0
    for description, data in hostile_files(precision):
        error, message = expected[description]
        with pytest.raises(error, match=message):
            cache.restore(io.BytesIO(data))
        assert state_of(cache) == before, description
        seen += 1
    assert seen == {"f32": 13, "f16": 12, "q8": 15}[precision]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_conversion_that_overflows_f16_is_refused_and_changes_nothing():
    cache = Cache(LAYOUT, precision="f32")
    ctx = cache.allocate()
    big = np.full(LAYOUT.batch_shape(1), 1e6, np.float32)
    ctx.extend([1], big)
    stream = io.BytesIO()
    ctx.snapshot(stream)
    target = Cache(LAYOUT, precision="f16")
    before = state_of(target)
    stream.seek(0)
    with pytest.raises(SnapshotPrecisionError) as refused:
        target.restore(stream)
    assert isinstance(refused.value, SnapshotError) and isinstance(refused.value, PrecisionRangeError)
    assert state_of(target) == before


def test_restore_that_runs_out_of_memory_leaves_no_page(monkeypatch):
    cache, ctx, _ = filled("f32", page_tokens=4, n=11)     # 3 pages
    stream = io.BytesIO()
    ctx.snapshot(stream)
    make_page, calls = cache.store._fresh_buffer, []     # where the store makes a page's memory, none kept
    assert cache.store._spares == []

    def failing(zero):
        calls.append(zero)
        if len(calls) == 3:
            raise MemoryError("out of device memory")
        return make_page(zero)

    monkeypatch.setattr(cache.store, "_fresh_buffer", failing)
    live_before = cache.stats()["live_pages"]
    stream.seek(0)
    with pytest.raises(MemoryError):
        cache.restore(stream)
    assert len(calls) == 3
    assert cache.stats()["live_pages"] == live_before
    assert cache.stats()["live_contexts"] == 2     # ctx and its sibling: no half-made context


def test_a_stream_that_fails_to_write_gives_a_snapshot_write_error():
    class Full(io.RawIOBase):
        def writable(self):
            return True

        def write(self, data):
            raise OSError(28, "No space left on device")

    _, ctx, _ = filled("f32")
    with pytest.raises(SnapshotWriteError, match="No space left"):
        ctx.snapshot(Full())


def test_snapshot_of_closed_context_is_refused(tmp_path):
    from kvstate.spec.errors import ContextClosedError

    cache = Cache(LAYOUT)
    ctx = cache.allocate()
    ctx.close()
    with pytest.raises(ContextClosedError):
        ctx.snapshot(tmp_path / "x.kvs")
    assert not os.listdir(tmp_path)


def test_every_snapshot_error_is_a_snapshot_error():
    for error in (SnapshotCorruptError, SnapshotTruncatedError, SnapshotTooLargeError, SnapshotVersionError,
                  SnapshotLayoutError, SnapshotWriteError, SnapshotNotFoundError):
        assert issubclass(error, SnapshotError)


def test_restoring_a_missing_file_is_refused_by_name_and_changes_nothing(tmp_path):
    cache, ctx, _ = filled("f32")
    before = cache.stats()
    with pytest.raises(SnapshotNotFoundError, match="no snapshot at"):
        cache.restore(tmp_path / "never-written.kvs")
    assert cache.stats() == before


def test_snapshot_into_an_append_mode_file_and_after_other_bytes(tmp_path):
    cache, ctx, ref_ctx = filled("f16")
    path = tmp_path / "log.bin"
    path.write_bytes(b"prefix")
    with open(path, "ab") as file:
        ctx.snapshot(file)
    with open(path, "rb") as file:
        assert file.read(6) == b"prefix"
        restored = Cache(LAYOUT, precision="f16").restore(file)
    assert_reads_equal(restored, ref_ctx)


def test_a_context_the_format_cannot_hold_is_refused_before_its_target_is_touched(tmp_path, monkeypatch):
    """An audit: a context of more positions than the format holds (or of a layout past its limits)
    was written, replacing a good snapshot at the path, and every restore refused the file."""
    path = tmp_path / "turn.kvs"
    cache = Cache(LAYOUT, page_tokens=4)
    ctx = cache.allocate()
    ctx.extend(list(range(5)), values_for(LAYOUT, 5, 1))
    ctx.snapshot(path)
    good = path.read_bytes()
    monkeypatch.setattr(fmt, "MAX_POSITIONS", 4)           # the format's limit, small enough to reach
    stream = io.BytesIO()
    for target in (path, stream):
        with pytest.raises(SnapshotTooLargeError, match="at most 4 positions"):
            ctx.snapshot(target)
    assert path.read_bytes() == good and stream.getvalue() == b"" and os.listdir(tmp_path) == ["turn.kvs"]
    wide = Layout(1, 1, fmt.MAX_HEAD_DIM + 1)
    with Cache(wide).allocate() as one:
        one.extend([1], np.zeros(wide.batch_shape(1), np.float32))
        with pytest.raises(SnapshotTooLargeError, match="head_dim is at most"):
            one.snapshot(tmp_path / "wide.kvs")
    assert os.listdir(tmp_path) == ["turn.kvs"]


def test_two_snapshots_in_one_stream_are_restored_each_from_its_slice():
    """README, Snapshots: a restore reads a stream to its end, which must be the snapshot's end, so
    a stream holding two is refused whole (as a file with bytes after its body) and each slice restores."""
    cache, ctx, ref_ctx = filled("f32")
    stream = io.BytesIO()
    ctx.snapshot(stream)
    first_end = stream.tell()
    ctx.snapshot(stream)
    data = stream.getvalue()
    stream.seek(0)
    with pytest.raises(SnapshotCorruptError, match="after the body"):
        cache.restore(stream)
    for piece in (data[:first_end], data[first_end:]):
        assert_reads_equal(cache.restore(io.BytesIO(piece)), ref_ctx)


@pytest.mark.parametrize("target", ["", "folder" + os.sep])
def test_a_path_naming_no_file_is_refused_by_name_before_anything_is_written(tmp_path, monkeypatch, target):
    """An empty path wrote its body to a temporary file in the working folder's parent, then failed to
    rename it with "No such file or directory", naming nothing."""
    (tmp_path / "work" / "folder").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")        # its parent, tmp_path, is where the body went
    cache, ctx, _ = filled("f32")
    with pytest.raises(SnapshotWriteError, match="names no file"):
        ctx.snapshot(target)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["work", os.path.join("work", "folder")]


@pytest.mark.parametrize("compressor", ["gzip", "bz2", "lzma"])
def test_snapshot_into_a_compressing_writer_restores_through_it(tmp_path, compressor):
    """A compressing writer says it can seek but goes only forward while writing: the snapshot is
    written header first, in order, not patched, which used to leave a zeroed header."""
    opener = __import__(compressor).open
    cache, ctx, ref_ctx = filled("f16")
    path = tmp_path / f"snapshot.{compressor}"
    with opener(path, "wb") as file:
        ctx.snapshot(file)
    with opener(path, "rb") as file:
        restored = Cache(LAYOUT, precision="f16").restore(file)
    assert_reads_equal(restored, ref_ctx)


# -- the checksum thread that large restores use ------------------------------------------

@pytest.fixture
def threaded_checksum(monkeypatch):
    """Every body read whole takes the large-snapshot path, read in many small pieces; the list
    it gives counts the checksums made with their thread. The tests restore from an in-memory
    stream: a local file of the cache's own precision is streamed instead (``snapshot_stream``)
    and never reaches this path, so a test restoring from a path would check nothing here."""
    from kvstate.impl import snapshot_read, snapshot_tuning

    monkeypatch.setattr(snapshot_tuning, "THREADED_CRC_BYTES", 1)
    monkeypatch.setattr(snapshot_tuning, "READ_CHUNK", 64)
    made, real_init = [], snapshot_read.BodyChecksum.__init__

    def init(self, version, checksum, threaded):
        made.append(threaded)
        real_init(self, version, checksum, threaded)
    monkeypatch.setattr(snapshot_read.BodyChecksum, "__init__", init)
    return made


@pytest.mark.parametrize("precision", ["f32", "f16", "q8"])
def test_threaded_checksum_restores_bit_exactly(threaded_checksum, tmp_path, precision):
    import threading

    cache, ctx, ref_ctx = filled(precision)
    path = tmp_path / "big.kvs"
    ctx.snapshot(path)
    threads = threading.active_count()
    restored = cache.restore(io.BytesIO(path.read_bytes()))
    assert np.array_equal(restored.read()[0].view(np.uint32), ref_ctx.read()[0].view(np.uint32))
    assert np.array_equal(restored.read()[1], ref_ctx.read()[1])
    assert threading.active_count() == threads      # the worker has finished
    assert threaded_checksum == [True]


def test_threaded_checksum_refuses_damage_and_stops_its_worker(threaded_checksum, tmp_path):
    import threading

    cache, ctx, _ = filled("f32")
    path = tmp_path / "big.kvs"
    ctx.snapshot(path)
    data = path.read_bytes()
    before, threads = cache.stats(), threading.active_count()
    flipped = bytearray(data)
    flipped[len(data) - 5] ^= 0x10                   # a body byte: only the checksum can tell
    with pytest.raises(SnapshotCorruptError, match="checksum"):
        cache.restore(io.BytesIO(bytes(flipped)))
    with pytest.raises(SnapshotError):
        cache.restore(io.BytesIO(data[:-100]))        # truncated mid-body
    assert cache.stats() == before
    assert threading.active_count() == threads
    assert True in threaded_checksum


# -- found by an audit of local snapshots ----------------------------------------------------------

@pytest.mark.parametrize("source", PRECISIONS)
@pytest.mark.parametrize("target", PRECISIONS)
def test_max_bytes_bounds_a_restore_into_any_precision(source, target):
    """``max_bytes`` at exactly the estimated cost lets the restore through, and the restore allocates
    no more than it: the float32 decoding and the new encoding of another precision are counted
    (they took up to 5.9 times the estimate)."""
    import tracemalloc

    from kvstate.impl.snapshot_read import restore_cost
    layout = Layout(layers=2, kv_heads=4, head_dim=64)
    cache, ctx, _ = filled(source, page_tokens=16, n=256, layout=layout)
    stream = io.BytesIO()
    ctx.snapshot(stream)
    data = stream.getvalue()
    into = Cache(layout, page_tokens=16, precision=target)
    cost = restore_cost(into, fmt.parse_header(data[:fmt.HEADER_SIZE]))
    with pytest.raises(SnapshotTooLargeError):
        into.restore(io.BytesIO(data), max_bytes=cost - 1)
    tracemalloc.start()
    try:
        restored = into.restore(io.BytesIO(data), max_bytes=cost)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # a little room for what other threads of the process allocate meanwhile (tracemalloc sees them all)
    assert len(restored) == 256 and peak <= 1.05 * cost + (256 << 10), (peak, cost)


def test_max_bytes_refuses_a_stream_of_unknown_size_before_reading_its_body():
    class Counted:
        def __init__(self, data):
            self.inner, self.read_bytes = io.BytesIO(data), 0

        def read(self, n=-1):
            chunk = self.inner.read(n)
            self.read_bytes += len(chunk)
            return chunk

    cache, ctx, _ = filled("f32", n=64)
    stream = io.BytesIO()
    ctx.snapshot(stream)
    source = Counted(stream.getvalue())
    before = state_of(cache)
    with pytest.raises(SnapshotTooLargeError, match="above max_bytes=1000"):
        cache.restore(source, max_bytes=1000)
    assert source.read_bytes == fmt.HEADER_SIZE and state_of(cache) == before


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_a_snapshot_never_replaces_a_special_file(tmp_path, kind):
    """A rename would have put a regular file where a FIFO, a socket or a device was (as root, the
    audit's first try replaced /dev/null); refused by name, the special file left as it was."""
    import socket
    import stat
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    else:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(path))
    cache, ctx, _ = filled("f32")
    with pytest.raises(SnapshotWriteError, match="not a regular file"):
        ctx.snapshot(path)
    mode = os.lstat(path).st_mode
    assert (stat.S_ISFIFO(mode) if kind == "fifo" else stat.S_ISSOCK(mode))
    assert sorted(p.name for p in tmp_path.iterdir()) == [kind]          # no temporary left either


def test_a_folder_as_the_target_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """The whole body went to a temporary file first; the rename then failed (EBUSY for ".") and the
    error called the folder "the previous file there"."""
    from kvstate.impl import snapshot_write
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    cache, ctx, _ = filled("f32")

    def never(*args):
        raise AssertionError("the body was written")
    monkeypatch.setattr(snapshot_write, "_write_to", never)
    for target in (".", "folder", tmp_path / "folder"):
        with pytest.raises(SnapshotWriteError, match="is a folder"):
            ctx.snapshot(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"] and not any((tmp_path / "folder").iterdir())


@pytest.mark.parametrize("how", ["own precision, from a file", "another precision"])
def test_an_interrupt_while_a_restore_fills_its_pages_leaves_no_context(monkeypatch, tmp_path, how):
    """The restore's pages are held by a context no caller has yet: an interrupt while they are
    filled (a file's token ids going in; another precision's values being written) closed nothing,
    and the pages stayed held by a context nobody could reach."""
    import sys
    from kvstate.impl import context as context_module
    from kvstate.impl import snapshot_stream
    cache, ctx, _ = filled("f16")
    path = tmp_path / "ctx.kvs"
    ctx.snapshot(path)
    into = Cache(LAYOUT, page_tokens=4, precision="f16" if how.startswith("own") else "f32")
    if how.startswith("own"):       # the streamed restore: interrupted once its pages exist
        real = snapshot_stream.span_in_page

        def span_in_page(*args):
            if sys._getframe(1).f_code.co_name == "_adopt_prepared":
                raise KeyboardInterrupt
            return real(*args)
        monkeypatch.setattr(snapshot_stream, "span_in_page", span_in_page)
    else:
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt
        monkeypatch.setattr(context_module.Context, "_write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        into.restore(path)
    assert into.observe().holders == {} and into.stats()["live_pages"] == 0


@pytest.mark.parametrize("how", ["own precision, from a file", "another precision"])
def test_an_interrupt_between_a_restores_pages_and_their_context_lets_the_pages_go(monkeypatch, tmp_path, how):
    """The window between ``new_pages`` and the context that holds them: pages made and held by no one."""
    cache, ctx, _ = filled("f16")
    path = tmp_path / "ctx.kvs"
    ctx.snapshot(path)
    into = Cache(LAYOUT, page_tokens=4, precision="f16" if how.startswith("own") else "f32")
    real = Cache._new_context

    def new_context(self, pages, length, register=True):
        if pages:
            raise KeyboardInterrupt         # as if delivered right after the pages were made
        return real(self, pages, length, register)
    monkeypatch.setattr(Cache, "_new_context", new_context)
    with pytest.raises(KeyboardInterrupt):
        into.restore(path)
    stats = into.stats()
    assert stats["live_pages"] == 0 and into.observe().holders == {} and not into.pool.refcounts.any()
