"""The restore benchmark's rows: one per length and thread count, each with the ratios the
issue's targets name and the command that measures it again (figures are never asserted)."""

import argparse

import pytest

from kvstate.bench import restore
from kvstate.impl import snapshot_stream
from kvstate.impl import snapshot_tuning


def test_rows_carry_their_thread_count_ratios_and_command():
    before = snapshot_tuning.IO_THREADS
    result = restore.run(threads=1, prefill=False, repeat=1, lengths=[8])
    assert snapshot_tuning.IO_THREADS == before          # the bench's thread count does not leak
    (row,) = result["rows"]
    assert row["tokens"] == 8 and row["threads"] == 1
    for ratio in ("restore_over_raw_warm", "restore_over_raw_fresh_warm", "copies_over_raw_warm",
                  "write_over_raw_fsync", "write_over_raw_atomic"):
        assert row[ratio] > 0
    assert "--tokens 8 --threads 1 --no-prefill --repeat 1" in row["command"]
    assert "OPENBLAS_NUM_THREADS=1" in row["command"]
    assert result["targets"]["warm_speedup_at_512"] == 150
    assert row["copies_over_raw_warm"] == pytest.approx(row["copies_warm_s"] / row["raw_read_warm_s"])
    assert "copies/raw" in restore.format_table(dict(result, params={"threads": [1]}))


def test_a_quick_rows_command_is_quick_too():
    """``--quick`` measures each row in fewer rounds (prefill once, I/O best of 3, not 5), so the
    command a quick row prints must say so, or it measures another thing."""
    (row,) = restore.run(quick=True, threads=1, prefill=False, lengths=[8])["rows"]
    assert row["command"].endswith("--tokens 8 --threads 1 --quick --no-prefill")
    (row,) = restore.run(threads=1, prefill=False, repeat=1, lengths=[8])["rows"]
    assert "--quick" not in row["command"]


def test_thread_counts_are_parsed_and_refused_by_name():
    assert restore.thread_counts("1,2") == [1, 2]
    with pytest.raises(argparse.ArgumentTypeError):
        restore.thread_counts("0")


def test_the_copies_floor_leaves_the_pages_a_restore_would_hold(tmp_path):
    """The floor contender makes the restore's copies, so it must produce what the restore does."""
    import numpy as np

    from kvstate.impl import Cache
    from kvstate.spec.layout import Layout

    layout = Layout(layers=2, kv_heads=3, head_dim=4)
    cache = Cache(layout, page_tokens=8)
    values = np.random.default_rng(3).standard_normal(layout.batch_shape(21)).astype(np.float32)
    with cache.allocate() as ctx:
        ctx.extend(list(range(21)), values)
        ctx.snapshot(tmp_path / "a.kvs")
    copies = restore.CopiesFloor(tmp_path / "a.kvs", layout, 21, 8)
    copies()
    stored = np.concatenate([np.moveaxis(page, 2, 0) for page in copies.pages])[:21]
    np.testing.assert_array_equal(stored, values)


def test_worker_always_runs_the_worker_for_a_small_body_and_says_so(monkeypatch):
    seen = []
    reader_init = snapshot_stream._PieceReader.__init__
    monkeypatch.setattr(snapshot_stream._PieceReader, "__init__",
                        lambda self, file, header, threaded=True: seen.append(threaded) or
                        reader_init(self, file, header, threaded))
    before = snapshot_tuning.IO_THREADS
    (row,) = restore.run(threads=2, prefill=False, repeat=1, lengths=[8], worker="always")["rows"]
    assert snapshot_tuning.IO_THREADS == before
    assert seen and all(seen) and row["command"].endswith("--worker always")
    seen.clear()
    (row,) = restore.run(threads=2, prefill=False, repeat=1, lengths=[8])["rows"]
    assert seen and not any(seen) and "--worker" not in row["command"]
