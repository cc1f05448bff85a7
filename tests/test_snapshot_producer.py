"""Format version 3: a snapshot that names its producer (the model that computed its values), and a
restore that expects one refusing a file naming another, with the header, before anything is read or
allocated (``spec/snapshot_format.py``)."""

import io

import numpy as np
import pytest

from kvstate.fuzz import snapshot_fuzz as fz
from kvstate.impl import Cache
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.errors import (InvalidInputError, SnapshotCorruptError, SnapshotProducerError,
                                 SnapshotVersionError)
from kvstate.spec.layout import Layout

LAYOUT = Layout(2, 2, 4)
MINE, OTHER = b"model-A-16-bytes", b"model-B-16-bytes"


def written(producer=None, precision="f32") -> tuple[Cache, bytes]:
    cache = Cache(LAYOUT, page_tokens=4, precision=precision)
    ctx = cache.allocate()
    ctx.extend([5, 6, 7, 8, 9], np.arange(5 * 32, dtype=np.float32).reshape(5, *LAYOUT.position_shape))
    stream = io.BytesIO()
    ctx.snapshot(stream, producer=producer)
    ctx.close()
    return cache, stream.getvalue()


def test_a_snapshot_names_its_producer_only_where_one_is_given():
    _, plain = written()
    assert fmt.parse_header(plain).version == fmt.FORMAT_VERSION        # what earlier builds read
    assert fmt.parse_header(plain).producer is None
    cache, named = written(MINE)
    header = fmt.parse_header(named)
    assert (header.version, header.producer, header.size) == (3, MINE, 64)
    assert len(named) == len(plain) + 16
    assert cache.restore(io.BytesIO(named), producer=MINE).tokens == [5, 6, 7, 8, 9]
    assert len(cache.restore(io.BytesIO(named))) == 5            # a restore that expects none takes it
    assert len(cache.restore(io.BytesIO(plain), producer=MINE)) == 5     # a file that names none: unchecked


def test_a_file_naming_another_producer_is_refused_with_its_header_before_the_body_is_read(tmp_path):
    cache, named = written(MINE)
    before = cache.stats()["live_pages"]
    header_only = named[:64]        # no body at all: the producer is judged first
    with pytest.raises(SnapshotProducerError, match=f"{MINE.hex()} at offset 44 is not the expected {OTHER.hex()}"):
        cache.restore(io.BytesIO(header_only), producer=OTHER)
    path = tmp_path / "named.kvs"
    path.write_bytes(named)
    with pytest.raises(SnapshotProducerError):
        cache.restore(path, producer=OTHER)        # the streamed restore of a local file too
    assert cache.stats()["live_pages"] == before


@pytest.mark.parametrize("bad", [b"short", bytes(16), "sixteen-chars-xx", 16])
def test_a_bad_producer_is_refused_by_name_before_anything_is_written_or_read(tmp_path, bad):
    cache, named = written(MINE)
    ctx = cache.allocate()
    target = tmp_path / "never.kvs"
    with pytest.raises(InvalidInputError, match="producer"):
        ctx.snapshot(target, producer=bad)
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(InvalidInputError, match="producer"):
        cache.restore(io.BytesIO(named), producer=bad)


def test_version_3_with_a_crc32_body_loads_without_xxhash_and_an_unknown_checksum_code_is_refused(monkeypatch):
    _, named = written(MINE)
    header = fmt.parse_header(named)
    body = named[64:]
    crc_file = fmt.pack_header("f32", LAYOUT, 5, fmt.crc32(body), version=3, producer=MINE,
                               checksum=fmt.CRC32) + body
    cache = Cache(LAYOUT, page_tokens=4)
    assert len(cache.restore(io.BytesIO(crc_file), producer=MINE)) == 5
    monkeypatch.setattr(fmt, "xxhash", None)
    assert len(cache.restore(io.BytesIO(crc_file), producer=MINE)) == 5
    if header.checksum == fmt.XXH3:
        with pytest.raises(SnapshotVersionError, match="xxhash"):
            cache.restore(io.BytesIO(named))
    unknown = bytearray(crc_file)
    unknown[11] = 7
    unknown[60:64] = fmt.crc32(bytes(unknown[:60])).to_bytes(4, "little")
    with pytest.raises(SnapshotCorruptError, match="checksum code 7 at offset 11"):
        cache.restore(io.BytesIO(bytes(unknown)))


@pytest.mark.parametrize("precision", ["f32", "q8"])
def test_every_single_byte_corruption_and_truncation_of_a_version_3_file_is_refused(precision):
    data = fz.small_snapshot(precision, producer=MINE)
    assert fmt.parse_header(data).version == 3
    report = fz.refuse_all(fz.host_cache(precision), fz.single_byte_corruptions(data))
    assert report.ok, (report.summary(), report.escaped[:5], report.changed[:5])
    assert report.tried == sum(len(fz.replacements(b)) for b in data)
    cut = fz.refuse_all(fz.host_cache(precision), fz.truncations(data))     # inside the 16 extra header bytes too
    assert cut.ok and cut.errors["SnapshotTruncatedError"] == len(data), cut.summary()
