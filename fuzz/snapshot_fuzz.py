"""Deterministic snapshot fuzzing: damaged and hostile files must be refused, and change nothing.

Every generator yields ``(description, bytes)`` cases; ``refuse_all`` restores
each into a cache that already holds state and checks that the restore raised a
``SnapshotError`` and that ``observe()`` and ``stats()`` are exactly what they
were before. Tests run these at CI size; ``kvstate fuzz`` runs them at any size.
"""

from __future__ import annotations

import io
import os
import random
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from kvstate.impl.cache import Cache
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.errors import SnapshotError
from kvstate.spec.layout import Layout

FUZZ_LAYOUT = Layout(layers=1, kv_heads=1, head_dim=4)   # tiny, so every byte can be tried
FUZZ_POSITIONS = 3
FUZZ_PAGE_TOKENS = 2
FUZZ_TOKENS = (5, 0, 2**31 - 1)

Case = tuple[str, bytes]


def fuzz_values(layout: Layout, n: int, seed: int = 0) -> np.ndarray:
    """Varied values, one all-zero head vector (q8's zero-scale path)."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(layout.batch_shape(n)) * 3).astype(np.float32)
    values[0, 0, 0, 0] = 0
    return values


def host_cache(precision: str, layout: Layout = FUZZ_LAYOUT, arena_pages: int = 2) -> Cache:
    """A cache already holding a context and a tree entry, so 'unchanged' means something."""
    cache = Cache(layout, page_tokens=FUZZ_PAGE_TOKENS, precision=precision, arena_pages=arena_pages)
    ctx = cache.allocate()
    ctx.extend([1, 2, 3], fuzz_values(layout, 3, seed=7))
    cache.retain(ctx)
    return cache


def small_snapshot(precision: str, layout: Layout = FUZZ_LAYOUT, producer: bytes | None = None) -> bytes:
    """A valid snapshot of FUZZ_POSITIONS positions, the file every corruption starts from (naming
    ``producer``, where given: format version 3)."""
    cache = Cache(layout, page_tokens=FUZZ_PAGE_TOKENS, precision=precision)
    ctx = cache.allocate()
    ctx.extend(list(FUZZ_TOKENS), fuzz_values(layout, FUZZ_POSITIONS))
    stream = io.BytesIO()
    ctx.snapshot(stream, producer=producer)
    return stream.getvalue()


# -- case generators ---------------------------------------------------------------------

def replacements(byte: int) -> list[int]:
    """Each single-bit flip, plus 0x00, 0xFF, +1 and -1: the values that differ from ``byte``."""
    values = [byte ^ (1 << bit) for bit in range(8)] + [0x00, 0xFF, (byte + 1) % 256, (byte - 1) % 256]
    return sorted(set(values) - {byte})


def single_byte_corruptions(data: bytes) -> Iterator[Case]:
    for offset, byte in enumerate(data):
        for value in replacements(byte):
            damaged = bytearray(data)
            damaged[offset] = value
            yield f"byte {offset}: {byte:#04x} -> {value:#04x}", bytes(damaged)


def truncations(data: bytes) -> Iterator[Case]:
    for length in range(len(data)):
        yield f"truncated to {length} of {len(data)} bytes", data[:length]


def extensions(data: bytes) -> Iterator[Case]:
    for extra in (b"\x00", b"\xff" * 7, data):
        yield f"{len(extra)} bytes appended", data + extra


def random_corruptions(data: bytes, count: int, seed: int = 0) -> Iterator[Case]:
    """2-16 random bytes changed at random offsets (each really changed)."""
    rng = random.Random(seed)
    for i in range(count):
        damaged = bytearray(data)
        offsets = rng.sample(range(len(data)), min(len(data), rng.randint(2, 16)))
        for offset in offsets:
            damaged[offset] = (damaged[offset] + rng.randint(1, 255)) % 256
        yield f"random corruption {seed}/{i} at {sorted(offsets)}", bytes(damaged)


def garbage_files(count: int, seed: int = 0) -> Iterator[Case]:
    """Random bytes; some start with the magic, or magic and a loadable version, to get past the first checks."""
    rng = random.Random(seed)
    prefixes = (b"", fmt.MAGIC, fmt.MAGIC + fmt.FORMAT_VERSION.to_bytes(2, "little"))
    for i in range(count):
        prefix = prefixes[i % len(prefixes)]
        tail = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300)))
        yield f"garbage {seed}/{i} ({len(prefix)}-byte prefix, {len(tail)} random bytes)", prefix + tail


def signed_header(precision: str, layout: Layout, positions: int, body_crc: int = 0) -> bytes:
    """A header with correct checksums declaring ``positions``: hostile files are well-formed on the outside."""
    declared = min(fmt.body_size(layout, precision, positions), 2**64 - 1)   # past the limit it may not fit u64
    return fmt.pack_header(precision, layout, positions, body_crc, declared)


def resign(data: bytes) -> bytes:
    """Recompute both checksums so damage inside a field reaches the field checks behind them (the
    header's own at its end: byte 44 of versions 1 and 2, 60 of version 3)."""
    version = int.from_bytes(data[8:10], "little") if len(data) >= 10 else 0
    size = fmt.header_size(version)
    if len(data) < size:
        return data
    body = data[size:]
    header = bytearray(data[:size])
    checksum = header[11] if version == fmt.PRODUCER_VERSION and header[11] in fmt.BODY_CHECKSUMS else None
    body_crc = (fmt.body_checksum(version, body, checksum) if version in fmt.LOADABLE_VERSIONS
                else fmt.crc32(body))
    header[40:44] = body_crc.to_bytes(4, "little")
    header[size - 4:size] = fmt.crc32(bytes(header[:size - 4])).to_bytes(4, "little")
    return bytes(header) + body


def hostile_files(precision: str, layout: Layout = FUZZ_LAYOUT) -> Iterator[Case]:
    """Files whose checksums hold but whose contents the format forbids."""
    data = small_snapshot(precision, layout)
    body = fmt.HEADER_SIZE
    values = body + 4 * FUZZ_POSITIONS
    yield "negative token id", resign(data[:body] + b"\xff\xff\xff\xff" + data[body + 4:])
    if precision == "f32":
        yield "NaN value", resign(data[:values] + b"\x00\x00\xc0\x7f" + data[values + 4:])
        yield "infinite value", resign(data[:values] + b"\x00\x00\x80\x7f" + data[values + 4:])
    elif precision == "f16":
        yield "f16 infinity", resign(data[:values] + b"\x00\x7c" + data[values + 2:])
    else:
        yield "q8 code -128", resign(data[:values] + b"\x80" + data[values + 1:])
        scales = values + layout.values_per_position * FUZZ_POSITIONS
        for name, raw in (("negative", -1.0), ("NaN", np.nan), ("huge", 3e38)):
            yield f"q8 {name} scale", resign(data[:scales] + np.float32(raw).tobytes() + data[scales + 4:])
    yield "reserved byte set", resign(data[:11] + b"\x01" + data[12:])
    named = small_snapshot(precision, layout, producer=b"fuzzed-producer!")       # version 3
    yield "version 3, checksum code 7", resign(named[:11] + b"\x07" + named[12:])
    yield "unknown precision code", resign(data[:10] + b"\x07" + data[11:])
    yield "zero layers", resign(data[:12] + b"\x00\x00\x00\x00" + data[16:])
    yield "body_bytes off by one", resign(data[:32] + (int.from_bytes(data[32:40], "little") + 1).to_bytes(8, "little")
                                          + data[40:])
    future = max(fmt.KNOWN_VERSIONS) + 1
    yield f"version {future}", resign(data[:8] + future.to_bytes(2, "little") + data[10:])
    yield "another layout", signed_header(precision, Layout(layout.layers + 1, layout.kv_heads, layout.head_dim), 0)
    yield "billions of positions", signed_header(precision, layout, 3_000_000_000)
    yield "one past the position limit", signed_header(precision, layout, fmt.MAX_POSITIONS + 1)
    yield "the position limit, no body", signed_header(precision, layout, fmt.MAX_POSITIONS)


def every_case(precision: str, random_count: int = 200, garbage_count: int = 200, seed: int = 0) -> Iterator[Case]:
    data = small_snapshot(precision)
    yield from single_byte_corruptions(data)
    yield from truncations(data)
    yield from extensions(data)
    yield from random_corruptions(data, random_count, seed)
    yield from garbage_files(garbage_count, seed)
    yield from hostile_files(precision)


# -- running them -----------------------------------------------------------------------

@dataclass
class FuzzReport:
    tried: int = 0
    refused: int = 0
    errors: Counter = field(default_factory=Counter)
    escaped: list[str] = field(default_factory=list)     # loaded, or raised something other than SnapshotError
    changed: list[str] = field(default_factory=list)     # refused, but the cache changed

    @property
    def ok(self) -> bool:
        return self.tried == self.refused and not self.escaped and not self.changed

    def merge(self, other: "FuzzReport") -> "FuzzReport":
        self.tried += other.tried
        self.refused += other.refused
        self.errors.update(other.errors)
        self.escaped += other.escaped
        self.changed += other.changed
        return self

    def summary(self) -> str:
        kinds = ", ".join(f"{name} {count}" for name, count in sorted(self.errors.items()))
        return (f"{self.tried} files tried, {self.refused} refused ({kinds}); "
                f"{len(self.escaped)} escaped, {len(self.changed)} changed the cache")


def refuse_all(cache: Cache, cases: Iterable[Case], via: str = "stream") -> FuzzReport:
    """Restore every case (from a BytesIO, or from a file with ``via='path'``); all must be refused cleanly."""
    report = FuzzReport()
    before = (cache.observe(), cache.stats())
    with tempfile.TemporaryDirectory(prefix="kvstate-fuzz-") as folder:
        path = os.path.join(folder, "case.kvs")
        for description, data in cases:
            report.tried += 1
            if via == "path":
                with open(path, "wb") as file:
                    file.write(data)
                source = path
            else:
                source = io.BytesIO(data)
            try:
                ctx = cache.restore(source)
            except SnapshotError as error:
                report.refused += 1
                report.errors[type(error).__name__] += 1
            except Exception as error:    # noqa: BLE001 - the finding is exactly "something else escaped"
                report.escaped.append(f"{description}: {error!r}")
            else:
                report.escaped.append(f"{description}: loaded {len(ctx)} positions")
                ctx.close()
            if (cache.observe(), cache.stats()) != before:
                report.changed.append(description)
                before = (cache.observe(), cache.stats())
    return report


def run(precisions: Iterable[str] = ("f32", "f16", "q8"), random_count: int = 200, garbage_count: int = 200,
        seed: int = 0, path_share: int = 0) -> dict[str, FuzzReport]:
    """Every deterministic case for each precision; the first ``path_share`` cases also through real files."""
    reports = {}
    for precision in precisions:
        cache = host_cache(precision)
        report = refuse_all(cache, every_case(precision, random_count, garbage_count, seed))
        if path_share:
            cases = every_case(precision, random_count, garbage_count, seed)
            report.merge(refuse_all(cache, (case for _, case in zip(range(path_share), cases)), via="path"))
        reports[precision] = report
    return reports
