"""``bench/page_churn.py``: the churn it adds is the allocations a one-token-page extend makes, and
adding it changes nothing the cache does (the same hits), so its rows differ only in time."""

from __future__ import annotations

import gc
import sys

import pytest

from kvstate.bench import page_churn


def test_the_churn_allocates_what_a_one_token_page_extend_allocates():
    per_page = page_churn.per_page_allocations()
    # Per page today; once pages are slabs (under one a page) the bench's churn stands for nothing that
    # exists, and the bench has done its job.
    assert per_page >= 1, f"{per_page} blocks a page: pages are slabs now, retire bench/page_churn.py"
    kept: list = []
    page_churn.churn(10, kept, [0])
    gc.collect()
    gc.disable()
    try:
        before = sys.getallocatedblocks()
        page_churn.churn(700, kept, [10])
        churned = (sys.getallocatedblocks() - before) / 700
    finally:
        gc.enable()
    assert abs(churned - per_page) <= 1.0, (churned, per_page)
    assert len(kept) == 2 and len(kept[1]) == 700      # kept alive, as pages are


def test_quick_run_serves_the_same_hits_three_ways():
    result = page_churn.run(rounds=1, quick=True)
    rows = {row["way"]: row for row in result["rows"]}
    assert list(rows) == ["page 1", "page 64", "page 64 + churn"]
    assert len({row["matched"] for row in rows.values()}) == 1 and rows["page 1"]["matched"] > 0
    for row in rows.values():
        assert row["lookup_vs_page_1"] == pytest.approx(rows["page 1"]["lookup_us"] / row["lookup_us"], rel=1e-12)
    assert result["command"] == "python -m kvstate.bench.page_churn --quick"
