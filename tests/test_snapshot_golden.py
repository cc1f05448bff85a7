"""Golden snapshot files: every build restores what released versions wrote, bit-exactly."""

import io
from pathlib import Path

import numpy as np
import pytest

from kvstate.impl.cache import Cache
from kvstate.spec import precision as precisions
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.layout import Layout

GOLDEN = Path(__file__).parent / "golden"
LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)
FILES = sorted(GOLDEN.glob("v*/*.kvs"))


PRODUCER = b"kvstate-golden03"      # what the v3 files name (tests/golden/regenerate.py)


def _loadable(path: Path) -> None:
    header = path.read_bytes()[:fmt.HEADER_SIZE]
    if int(path.parent.name[1:]) not in fmt.LOADABLE_VERSIONS or (header[11] == fmt.XXH3 and fmt.xxhash is None):
        pytest.skip(f"{path.parent.name} needs the xxhash package (kvstate[fast-snapshot])")


def test_golden_files_exist_for_each_precision_and_version():
    versions = {path.parent.name for path in FILES}
    assert {f"v{v}" for v in fmt.LOADABLE_VERSIONS} <= versions
    for version in versions:
        assert {p.stem for p in FILES if p.parent.name == version} == {"f32", "f16", "q8"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}-{p.stem}")
@pytest.mark.parametrize("page_tokens", [1, 3, 64])
def test_golden_file_restores_bit_exactly(path, page_tokens):
    _loadable(path)
    precision = path.stem
    expected = np.load(path.with_suffix(".expected.npz"))
    ctx = Cache(LAYOUT, page_tokens=page_tokens, precision=precision).restore(path)
    values, tokens = ctx.read()
    np.testing.assert_array_equal(values.view(np.uint32), expected["values"].view(np.uint32))
    np.testing.assert_array_equal(tokens, expected["tokens"])
    if path.parent.name == f"v{fmt.FORMAT_VERSION}":    # v2 where xxhash is installed, else v1
        # The current writer still writes these very bytes.
        stream = io.BytesIO()
        ctx.snapshot(stream)
        assert stream.getvalue() == path.read_bytes()
    if path.parent.name == f"v{fmt.PRODUCER_VERSION}" and fmt.WRITTEN_CHECKSUM == fmt.XXH3:
        stream = io.BytesIO()           # ... and with the producer named, these
        ctx.snapshot(stream, producer=PRODUCER)
        assert stream.getvalue() == path.read_bytes()


@pytest.mark.parametrize("precision", ["f32", "f16", "q8"])
def test_the_golden_v3_files_name_their_producer_and_a_restore_expecting_another_refuses_them(precision):
    from kvstate.spec.errors import SnapshotProducerError

    path = GOLDEN / "v3" / f"{precision}.kvs"
    _loadable(path)
    assert fmt.parse_header(path.read_bytes()).producer == PRODUCER
    cache = Cache(LAYOUT, page_tokens=2, precision=precision)
    assert len(cache.restore(path, producer=PRODUCER)) == 5
    with pytest.raises(SnapshotProducerError, match="not the expected"):
        cache.restore(path, producer=b"another-model-16")
    with open(path, "rb") as stream:            # a stream as well as a path
        with pytest.raises(SnapshotProducerError):
            cache.restore(stream, producer=b"another-model-16")
    assert cache.stats()["live_pages"] == 2 + 1     # the one restore taken: 5 positions on 2-token pages


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}-{p.stem}")
@pytest.mark.parametrize("target", ["f32", "f16", "q8"])
def test_golden_file_restores_into_every_precision(path, target):
    _loadable(path)
    expected = np.load(path.with_suffix(".expected.npz"))["values"]
    ctx = Cache(LAYOUT, page_tokens=2, precision=target).restore(path)
    want = expected if target == path.stem else precisions.roundtrip(target, expected)
    np.testing.assert_array_equal(ctx.read()[0].view(np.uint32), want.view(np.uint32))
