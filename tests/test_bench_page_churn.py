"""``bench/page_churn.py``: its hand-made allocations are those a one-token-page extend leaves, and
its extend beside really extends one-token pages, every new token of every request."""

from __future__ import annotations

import pytest

from kvstate.bench import page_churn


def test_the_churn_allocates_what_a_one_token_page_extend_allocates():
    blocks, tracked = page_churn.per_page_allocations()
    # Per page today; once pages are slabs (well under one block a page) the churn stands for nothing
    # that exists, and the bench has done its job.
    assert blocks >= 1, f"{blocks} blocks a page: pages are slabs now, retire bench/page_churn.py"
    kept: list = []
    page_churn.churn(10, kept, [0])
    churned_blocks, churned_tracked = page_churn._counted(lambda: page_churn.churn(700, kept, [10]))
    assert abs(churned_blocks / 700 - blocks) <= 0.5, (churned_blocks / 700, blocks)
    assert abs(churned_tracked / 700 - tracked) <= 0.1, (churned_tracked / 700, tracked)
    assert len(kept) == 2 and len(kept[1]) == 700      # kept alive, as pages are


def test_quick_run_extends_every_new_token_beside_at_one_token_pages():
    result = page_churn.run(rounds=1, quick=True)
    rows = {row["way"]: row for row in result["rows"]}
    assert list(rows) == [page_churn.PAGE_1, page_churn.PAGE_64, page_churn.BESIDE, page_churn.ALLOCATIONS]
    matched = rows[page_churn.PAGE_1]["matched"]
    assert matched > 0 and all(row["matched"] == matched for row in rows.values())
    queries = page_churn.workload("divergent", **page_churn.QUICK)
    assert result["pages_made_beside"] == sum(map(len, queries)) - matched     # one page per new token
    assert rows[page_churn.PAGE_1]["lookup_share"] == 1 and rows[page_churn.PAGE_64]["retain_share"] == 0
    assert result["command"] == "python -m kvstate.bench.page_churn --rounds 1 --quick"     # the rounds it ran
