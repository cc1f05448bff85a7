"""The deterministic snapshot fuzzer at CI size: every single-byte corruption and every truncation
of a small snapshot in each precision, plus random damage and garbage, all refused, nothing changed."""

import io

import pytest

from kvstate.fuzz import snapshot_fuzz as fz
from kvstate.spec import snapshot_format as fmt

PRECISIONS = ("f32", "f16", "q8")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_single_byte_corruption_is_refused(precision):
    data = fz.small_snapshot(precision)
    report = fz.refuse_all(fz.host_cache(precision), fz.single_byte_corruptions(data))
    assert report.ok, (report.summary(), report.escaped[:5], report.changed[:5])
    # each offset, each single-bit flip plus 0x00/0xFF/+1/-1 where they differ
    assert report.tried == sum(len(fz.replacements(b)) for b in data) >= 8 * len(data)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_truncation_is_refused(precision):
    data = fz.small_snapshot(precision)
    report = fz.refuse_all(fz.host_cache(precision), fz.truncations(data))
    assert report.ok, (report.summary(), report.escaped[:5])
    assert report.tried == len(data)
    # A prefix of a valid file is always named a truncation, never mistaken for corruption.
    assert report.errors["SnapshotTruncatedError"] == len(data)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_random_damage_garbage_and_extensions_are_refused(precision):
    data = fz.small_snapshot(precision)
    cases = [*fz.random_corruptions(data, 300, seed=11), *fz.garbage_files(300, seed=11), *fz.extensions(data)]
    report = fz.refuse_all(fz.host_cache(precision), cases)
    assert report.ok, (report.summary(), report.escaped[:5], report.changed[:5])
    assert report.tried == 603


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_share_through_real_files(precision):
    data = fz.small_snapshot(precision)
    cases = [*fz.truncations(data), *list(fz.single_byte_corruptions(data))[::7]]
    report = fz.refuse_all(fz.host_cache(precision), cases, via="path")
    assert report.ok, (report.summary(), report.escaped[:5])
    assert report.tried == len(cases) > 0


def test_the_small_snapshots_themselves_load():
    """The fuzz seeds are valid: refusals above come from the damage, not from the seed."""
    for precision in PRECISIONS:
        data = fz.small_snapshot(precision)
        assert len(data) == fmt.HEADER_SIZE + fmt.body_size(fz.FUZZ_LAYOUT, precision, fz.FUZZ_POSITIONS)
        ctx = fz.host_cache(precision).restore(io.BytesIO(data))
        assert ctx.tokens == list(fz.FUZZ_TOKENS)


def test_fuzz_report_flags_a_file_that_loads():
    report = fz.refuse_all(fz.host_cache("f32"), [("valid", fz.small_snapshot("f32"))])
    assert not report.ok and report.escaped == ["valid: loaded 3 positions"]


def test_atheris_harness_one_input_per_mode():
    from kvstate.fuzz import atheris_harness as harness

    data = fz.small_snapshot("q8")
    for mode in range(3):
        harness.test_one_input(bytes([mode]) + data)
        harness.test_one_input(bytes([mode]) + data[:-3])
    assert harness.STATS["loaded"] >= 1 and harness.STATS["refused"] >= 3


def test_kvstate_fuzz_command(capsys):
    from kvstate.cli import main

    assert main(["fuzz", "--precision", "q8", "--random", "20", "--garbage", "20", "--files", "10"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("q8: ") and "0 escaped, 0 changed the cache" in out
