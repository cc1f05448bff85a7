"""The snapshot file format, versions 1 and 2: what a context looks like on disk.

A snapshot is one header followed by one body, little-endian throughout::

    offset  size  field
    0       8     magic            b"\\x89KVS\\r\\n\\x1a\\n" (catches text-mode and 7-bit mangling)
    8       2     version          u16, FORMAT_VERSION
    10      1     precision        u8, PRECISION_CODES: 0 f32, 1 f16, 2 q8
    11      1     reserved         u8, must be 0
    12      4     layers           u32, 1..MAX_LAYERS
    16      4     kv_heads         u32, 1..MAX_KV_HEADS
    20      4     head_dim         u32, 1..MAX_HEAD_DIM
    24      8     positions        u64, 0..MAX_POSITIONS
    32      8     body_bytes       u64, must equal body_size(layout, precision, positions)
    40      4     body_crc         u32, checksum of the whole body: version 1 CRC-32,
                                   version 2 the low 32 bits of XXH3-64 (seed 0)
    44      4     header_crc       u32, CRC-32 of header bytes [0, 44)
    48            body

Version 3 (written only where a producer is named: ``Context.snapshot(target, producer=...)``)
says which checksum its body has and what computed its values, in a 64-byte header::

    11      1     checksum         u8, BODY_CHECKSUMS: 0 CRC-32, 1 XXH3-64 low 32 bits (was reserved)
    12..44        as versions 1 and 2
    44      16    producer         16 bytes naming what computed the values (``kvstate.hf``: the
                                   model's fingerprint); all zeros: not named
    60      4     header_crc       u32, CRC-32 of header bytes [0, 60)
    64            body, as versions 1 and 2

A reader given the producer it expects refuses a file naming another
(``SnapshotProducerError``), with the header, before it reads the body; a file that names none
(versions 1 and 2, or zeros) is restored as before. A snapshot without a producer is still
written as version 2 (or 1), which earlier builds read.

Versions 1 and 2 differ only in the body checksum. XXH3 runs at memory speed
(measured on a 2-core x86 box: 38 GB/s against zlib's CRC-32 at 7 GB/s, which took longer
than reading the file), so a restore's checksum is no longer its slowest pass.
It needs the ``xxhash`` package (``pip install kvstate[fast-snapshot]``): without
it this build writes version 1 and refuses version 2 files by name
(``SnapshotVersionError``), and reads version 1 either way.

The body is position-major, so it does not depend on the page size that wrote it.
Its sections follow one another with no padding (``body_sections``):

    tokens   positions x int32                                      (each in [0, 2**31))
    values   positions x (layers, 2, kv_heads, head_dim)            f32 / f16 / int8 codes
    scales   positions x (layers, 2, kv_heads)   float32            (q8 only)

Values are the cache's own stored form (``spec.precision``'s encoded form), so a
restore into the same precision is bit-exact and a q8 file is no larger than
the memory it came from. A restore into another precision decodes to float32 and
encodes by the target's rule.

Rules a reader follows, in this order, before it makes any page of the cache (rules 1-4 before
it allocates anything; a streamed restore of a file too large to hold twice reads the body into
arrays it prepares for the pages, sized by the checked header and bounded by ``max_bytes``, and
checks rule 5 as it reads, so a refused file has had those arrays, never a page):
1. magic, then version (version 3's header is 64 bytes), then the header's length,
   then ``header_crc``: nothing is sized from an unchecked header;
2. every header field against its limit: more than MAX_POSITIONS positions is
   ``SnapshotTooLargeError``; ``body_bytes`` must match what the fields imply;
3. the layout against the cache's (``SnapshotLayoutError``), and a version-3 file's producer
   against the one the caller expects, where both are named (``SnapshotProducerError``);
4. the file's real size against the header's size + ``body_bytes``: shorter is
   ``SnapshotTruncatedError``, longer is ``SnapshotCorruptError``;
5. ``body_crc``, then every token id and every value (finite floats; q8 codes in
   [-127, 127] and scales finite, non-negative and small enough that
   ``127 * scale`` is finite).

CRC-32 detects every error confined to 32 consecutive bits, so every single-byte
corruption is caught by a checksum even where the field itself would look valid.
XXH3's 32 bits give no such guarantee, only a 2**-32 chance for any damage to
pass; the header keeps its CRC-32, and the content checks stay behind the body's.
Writers replace the target atomically (temporary file in the same folder,
flush, fsync, rename, fsync of the folder); temporary names follow TEMP_PREFIX /
TEMP_SUFFIX so they are never mistaken for snapshots.

Compatibility: the version is bumped only together with a loader for every
older version; golden files under ``tests/golden`` guard that.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from .errors import (InvalidInputError, SnapshotCorruptError, SnapshotProducerError, SnapshotTooLargeError,
                     SnapshotTruncatedError, SnapshotVersionError)
from .layout import Layout, all_finite
from .precision import Q8_SCALE_MAX

try:
    import xxhash
except ImportError:      # the optional extra kvstate[fast-snapshot]
    xxhash = None

MAGIC = b"\x89KVS\r\n\x1a\n"
KNOWN_VERSIONS = (1, 2, 3)
FORMAT_VERSION = 2 if xxhash is not None else 1              # what this build writes without a producer
PRODUCER_VERSION = 3                                         # ... and with one
LOADABLE_VERSIONS = (1, 2, 3) if xxhash is not None else (1, 3)

# Body checksums, by the code version 3 stores at offset 11 (versions 1 and 2 imply theirs).
CRC32, XXH3 = 0, 1
BODY_CHECKSUMS = {CRC32: "CRC-32", XXH3: "XXH3-64"}
VERSION_CHECKSUM = {1: CRC32, 2: XXH3}
WRITTEN_CHECKSUM = XXH3 if xxhash is not None else CRC32     # the one this build writes into version 3

HEADER = struct.Struct("<8sHBBIIIQQII")
HEADER_SIZE = HEADER.size                 # 48: versions 1 and 2
HEADER_CRC_OFFSET = HEADER_SIZE - 4
HEADER_V3 = struct.Struct("<8sHBBIIIQQI16sI")
HEADER_V3_SIZE = HEADER_V3.size           # 64
PRODUCER_BYTES = 16
NO_PRODUCER = bytes(PRODUCER_BYTES)

PRECISION_CODES = {"f32": 0, "f16": 1, "q8": 2}
PRECISION_NAMES = {code: name for name, code in PRECISION_CODES.items()}

MAX_POSITIONS = 16_777_216
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096

TOKEN_DTYPE = np.dtype("<i4")
VALUE_DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "q8": np.dtype("i1")}
SCALE_DTYPE = np.dtype("<f4")
Q8_CODE_LIMIT = 127
Q8_SCALE_LIMIT = Q8_SCALE_MAX    # the largest scale whose 127 * scale is finite; beyond it a read is inf

TEMP_PREFIX = "."
TEMP_SUFFIX = ".kvs-partial"


@dataclass(frozen=True)
class Header:
    version: int
    precision: str
    layout: Layout
    positions: int
    body_bytes: int
    body_crc: int
    checksum: int = CRC32               # the body's (``BODY_CHECKSUMS``)
    producer: bytes | None = None       # version 3's, where it names one

    @property
    def size(self) -> int:
        """Bytes of this header: where the body starts."""
        return header_size(self.version)


def header_size(version: int) -> int:
    """Bytes of a header of ``version`` (a version this build does not know: the first 48, which say so)."""
    return HEADER_V3_SIZE if version == PRODUCER_VERSION else HEADER_SIZE


def crc32(data, value: int = 0) -> int:
    return zlib.crc32(data, value) & 0xFFFFFFFF


class BodyHash:
    """The body checksum of one format version (of version 3, ``checksum``'s), fed the body in
    file order, piece by piece."""

    def __init__(self, version: int, checksum: int | None = None):
        if version not in LOADABLE_VERSIONS:
            raise SnapshotVersionError(_not_loadable(version))
        kind = VERSION_CHECKSUM.get(version, WRITTEN_CHECKSUM) if checksum is None else checksum
        if kind == XXH3 and xxhash is None:
            raise SnapshotVersionError(f"format version {version}'s XXH3 body checksum needs the xxhash package, which "
                                       "this installation lacks (pip install kvstate[fast-snapshot])")
        self._xxh3 = xxhash.xxh3_64() if kind == XXH3 else None
        self._crc = 0

    def update(self, data) -> None:
        if self._xxh3 is None:
            self._crc = zlib.crc32(data, self._crc)
        else:
            self._xxh3.update(data)

    def value(self) -> int:
        return self._crc & 0xFFFFFFFF if self._xxh3 is None else self._xxh3.intdigest() & 0xFFFFFFFF


def body_checksum(version: int, data, checksum: int | None = None) -> int:
    """The ``body_crc`` field of a version-``version`` file whose body is ``data`` (version 3: by
    ``checksum``, else the one this build writes)."""
    hasher = BodyHash(version, checksum)
    hasher.update(data)
    return hasher.value()


def _not_loadable(version: int) -> str:
    if version in KNOWN_VERSIONS:
        return (f"format version {version} at offset 8 needs the xxhash package, which this installation "
                f"lacks (pip install kvstate[fast-snapshot]); it loads {LOADABLE_VERSIONS}")
    return (f"format version {version} at offset 8 is not loadable by this build (loads {LOADABLE_VERSIONS}); "
            f"the file is newer than this build, or damaged")


def body_sections(layout: Layout, precision: str, positions: int) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each body section, in file order."""
    sections = [("tokens", TOKEN_DTYPE, (positions,)),
                ("values", VALUE_DTYPES[precision], layout.batch_shape(positions))]
    if precision == "q8":
        sections.append(("scales", SCALE_DTYPE, layout.batch_shape(positions)[:-1]))
    return sections


def body_size(layout: Layout, precision: str, positions: int) -> int:
    return sum(dtype.itemsize * int(np.prod(shape, dtype=object))
               for _, dtype, shape in body_sections(layout, precision, positions))


def pack_header(precision: str, layout: Layout, positions: int, body_crc: int,
                body_bytes: int | None = None, version: int = 1, producer: bytes | None = None,
                checksum: int | None = None) -> bytes:
    """The header bytes of a snapshot (48; 64 for version 3), ``header_crc`` included.

    ``body_crc`` is ``body_checksum(version, body, checksum)``; ``version`` is 1 unless given, so a
    caller that checksums with ``crc32`` gets a valid file. ``body_bytes`` defaults to
    what the other fields imply (fuzzers pass their own). Version 3 takes the ``producer`` (16
    bytes, or None) and the body's ``checksum`` (default: the one this build writes).
    """
    declared = body_size(layout, precision, positions) if body_bytes is None else body_bytes
    if version != PRODUCER_VERSION:
        if producer is not None:
            raise ValueError(f"format version {version} names no producer: version {PRODUCER_VERSION} does")
        fields = HEADER.pack(MAGIC, version, PRECISION_CODES[precision], 0,
                             layout.layers, layout.kv_heads, layout.head_dim, positions, declared, body_crc, 0)
    else:
        fields = HEADER_V3.pack(MAGIC, version, PRECISION_CODES[precision],
                                WRITTEN_CHECKSUM if checksum is None else checksum, layout.layers, layout.kv_heads,
                                layout.head_dim, positions, declared, body_crc,
                                NO_PRODUCER if producer is None else check_producer(producer), 0)
    return fields[:-4] + struct.pack("<I", crc32(fields[:-4]))


def check_producer(producer) -> bytes:
    """``producer`` as the 16 bytes version 3 stores; ``InvalidInputError`` (a ``ValueError``) for
    anything else, or all zeros (which the format reads as no producer)."""
    if not isinstance(producer, bytes) or len(producer) != PRODUCER_BYTES:
        raise InvalidInputError(f"a snapshot's producer is {PRODUCER_BYTES} bytes, got {producer!r:.80}")
    if producer == NO_PRODUCER:
        raise InvalidInputError("a snapshot's producer cannot be all zeros: the format reads that as none")
    return producer


def check_expected_producer(header: Header, expected: bytes | None) -> None:
    """``SnapshotProducerError`` where the caller names the producer it expects and the file names
    another (offset 44); a file that names none, or a caller that expects none, passes."""
    if expected is None or header.producer is None or header.producer == expected:
        return
    raise SnapshotProducerError(f"producer {header.producer.hex()} at offset 44 is not the expected "
                                f"{expected.hex()}: another producer (model) computed these values")


def check_fits(layout: Layout, positions: int) -> None:
    """``SnapshotTooLargeError`` for a context the format cannot hold: the limits ``parse_header``
    refuses a file for. A writer checks it before its target is touched; it wrote such a file,
    replacing whatever good snapshot was at the path, and no restore would take it (an audit)."""
    for name, value, limit in (("layers", layout.layers, MAX_LAYERS), ("kv_heads", layout.kv_heads, MAX_KV_HEADS),
                               ("head_dim", layout.head_dim, MAX_HEAD_DIM)):
        if value > limit:
            raise SnapshotTooLargeError(f"a snapshot's {name} is at most {limit}; this context's layout has {value}")
    if positions > MAX_POSITIONS:
        raise SnapshotTooLargeError(f"a snapshot holds at most {MAX_POSITIONS} positions; this context holds "
                                    f"{positions} (write a prefix of it: fork, truncate, snapshot)")


def parse_header(data: bytes) -> Header:
    """Validate the first bytes of a file (its header's 48, or 64 for version 3, when available) as a header.

    Raises the ``SnapshotError`` subclass that names the first thing wrong, and
    its offset; sizes nothing from a field before the header checksum holds.
    """
    n = len(data)
    if data[:len(MAGIC)] != MAGIC[:n]:
        raise SnapshotCorruptError(f"bad magic at offset 0: {bytes(data[:len(MAGIC)])!r} is not a kvstate snapshot")
    if n < 10:
        raise SnapshotTruncatedError(f"file ends at byte {n}, inside the {HEADER_SIZE}-byte header")
    version = struct.unpack_from("<H", data, 8)[0]
    if version not in LOADABLE_VERSIONS:
        raise SnapshotVersionError(_not_loadable(version))
    size = header_size(version)
    if n < size:
        raise SnapshotTruncatedError(f"file ends at byte {n}, inside the {size}-byte header")
    producer = None
    if version != PRODUCER_VERSION:
        (_, _, code, reserved, layers, kv_heads, head_dim, positions, declared, body_crc,
         header_crc) = HEADER.unpack_from(data, 0)
    else:
        (_, _, code, reserved, layers, kv_heads, head_dim, positions, declared, body_crc, producer,
         header_crc) = HEADER_V3.unpack_from(data, 0)
    actual = crc32(bytes(data[:size - 4]))
    if actual != header_crc:
        raise SnapshotCorruptError(
            f"header checksum mismatch at offset {size - 4}: stored {header_crc:#010x}, "
            f"header bytes give {actual:#010x}")
    if code not in PRECISION_NAMES:
        raise SnapshotCorruptError(f"precision code {code} at offset 10 is not one of {PRECISION_NAMES}")
    if version != PRODUCER_VERSION and reserved != 0:
        raise SnapshotCorruptError(f"reserved byte at offset 11 is {reserved}, must be 0")
    if version == PRODUCER_VERSION:
        if reserved not in BODY_CHECKSUMS:
            raise SnapshotCorruptError(f"checksum code {reserved} at offset 11 is not one of {BODY_CHECKSUMS}")
        if reserved == XXH3 and xxhash is None:
            raise SnapshotVersionError(f"the body checksum at offset 11 is XXH3, which needs the xxhash package "
                                       "this installation lacks (pip install kvstate[fast-snapshot])")
    for name, value, limit, offset in (("layers", layers, MAX_LAYERS, 12), ("kv_heads", kv_heads, MAX_KV_HEADS, 16),
                                       ("head_dim", head_dim, MAX_HEAD_DIM, 20)):
        if value < 1:
            raise SnapshotCorruptError(f"{name} at offset {offset} is {value}, must be at least 1")
        if value > limit:
            raise SnapshotTooLargeError(f"{name} at offset {offset} is {value}, above the format's limit {limit}")
    if positions > MAX_POSITIONS:
        raise SnapshotTooLargeError(
            f"positions at offset 24 is {positions}, above the format's limit {MAX_POSITIONS}")
    precision = PRECISION_NAMES[code]
    layout = Layout(layers, kv_heads, head_dim)
    expected = body_size(layout, precision, positions)
    if declared != expected:
        raise SnapshotCorruptError(
            f"body_bytes at offset 32 is {declared}, but {positions} positions of {layout} at {precision} "
            f"take {expected}")
    checksum = VERSION_CHECKSUM.get(version, reserved)
    return Header(version, precision, layout, positions, declared, body_crc, checksum,
                  None if producer in (None, NO_PRODUCER) else producer)


def split_body(header: Header, body) -> dict[str, np.ndarray]:
    """Views of each section of a checksummed body buffer (no copy)."""
    arrays, offset = {}, 0
    for name, dtype, shape in body_sections(header.layout, header.precision, header.positions):
        count = int(np.prod(shape, dtype=np.int64))
        arrays[name] = np.frombuffer(body, dtype=dtype, count=count, offset=offset).reshape(shape)
        offset += count * dtype.itemsize
    return arrays


def check_body(header: Header, body, body_crc: int | None = None) -> dict[str, np.ndarray]:
    """Checksum, then every token and value of the body; the section views on success.

    ``body_crc`` is the body's checksum when the reader computed it while reading.
    """
    check_body_crc(header, body_checksum(header.version, body, header.checksum) if body_crc is None else body_crc)
    return check_body_content(header, body)


def check_body_crc(header: Header, actual: int) -> None:
    if actual != header.body_crc:
        raise SnapshotCorruptError(
            f"body checksum mismatch (body starts at offset {header.size}, {header.body_bytes} bytes): "
            f"stored {header.body_crc:#010x}, body gives {actual:#010x}")


def check_body_content(header: Header, body) -> dict[str, np.ndarray]:
    """Every token and value of the body (not its checksum); the section views on success."""
    arrays = split_body(header, body)
    for name, array in arrays.items():
        check_section(header.precision, name, array)
    return arrays


def check_section(precision: str, name: str, array: np.ndarray, first: int = 0) -> None:
    """Every entry of one section, or of the rows ``[first, first + len(array))`` of it: a restore
    that streams the body checks it a piece at a time, with the same errors as a whole-body check.
    Indices in messages are the whole section's (position first)."""
    def where(bad: np.ndarray) -> tuple[int, ...]:
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        return (index[0] + first,) + index[1:]

    if name == "tokens":
        if array.size and array.min() < 0:   # int32 cannot reach TOKEN_LIMIT; only the sign can be wrong
            bad = int(np.argmax(array < 0))
            raise SnapshotCorruptError(f"token id {int(array[bad])} at position {bad + first} is negative")
    elif name == "scales":
        ok = np.isfinite(array) & (array >= 0) & (array <= Q8_SCALE_LIMIT)
        if not ok.all():
            value = array[tuple(np.argwhere(~ok)[0])]
            raise SnapshotCorruptError(f"q8 scale {value} at {where(~ok)} is not a finite value in [0, max/127]")
    elif precision == "q8":
        if array.size and (array.min() < -Q8_CODE_LIMIT):
            raise SnapshotCorruptError(f"q8 code -128 at {where(array < -Q8_CODE_LIMIT)} is outside [-127, 127]")
    elif not all_finite(array):
        bad = ~np.isfinite(array)
        value = array[tuple(np.argwhere(bad)[0])]
        raise SnapshotCorruptError(f"value {value} at {where(bad)} (position, layer, k/v, head, dim) is not finite")
