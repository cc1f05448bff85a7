"""The benchmarks' methodology, on stubs and made-up rows (no timing asserted beyond a sleep):
what each side is charged, what a verdict is decided on, which tree is the baseline."""

import time
from types import SimpleNamespace

import numpy as np

from kvstate.bench.one_token_pages import serve_requests


class _Books:
    """Refcounts' stand-in whose read (the flush of a pending hold) takes a known time."""

    def __init__(self):
        self.reads = 0

    @property
    def counts(self):
        self.reads += 1
        time.sleep(0.02)
        return np.zeros(1)


class _Cache:
    """A cache stub: ``match`` hits ``hit`` tokens at once; ``pool.books`` where ``books`` is given."""

    def __init__(self, page, hit, books=None):
        self.page_tokens, self.hit = page, hit
        self.layout = SimpleNamespace(position_shape=(1,))
        if books is not None:
            self.pool = SimpleNamespace(books=books)

    def match(self, tokens):
        ctx = SimpleNamespace(extend=lambda tokens, kv: None, close=lambda: None)
        return ctx, min(self.hit, len(tokens))

    def retain(self, ctx):
        pass


def test_a_hit_ending_inside_a_page_is_charged_its_hold_in_the_lookup():
    """The extend after a hit ending inside a page reads the counts, adding the hit's pending hold:
    that read is timed in ``match`` (as SGLang's ``inc_lock_ref`` is), once per such request."""
    queries = [np.arange(40)] * 3
    books = _Books()
    match_s, _, _ = serve_requests(_Cache(16, 20, books), queries)
    assert books.reads == 3 and (match_s >= 0.02).all()
    for hit in (32, 40):        # a page boundary (nothing reads the counts), or the whole request (no extend)
        books = _Books()
        match_s, _, _ = serve_requests(_Cache(16, hit, books), queries)
        assert books.reads == 0 and (match_s < 0.02).all()
    books = _Books()
    assert serve_requests(_Cache(1, 20, books), queries)[2] == 60 and books.reads == 0     # page 1: never inside
    assert serve_requests(_Cache(16, 20), queries)[2] == 60       # an older checkout without the books still runs


def _miss_rows(given, floor_us, floor_x, array_us=24.3, array_floor_us=3.0, peer_us=49.8):
    from kvstate.bench import versus_sglang as v

    common = {"workload": "divergent", "page": 1, "engine": "kvstate token", "matched": 10, "insert_us": 1.0,
              "insert_speedup": 70.0}
    peer = {**common, "engine": v.SGLANG, "input": v.ARRAY_Q, "lookup_us": peer_us, "insert_us": 70.0,
            "lookup_speedup": 1.0, "insert_speedup": 1.0}
    array_row = {**common, "input": v.ARRAY, "lookup_us": array_us, "lookup_floor_us": array_floor_us,
                 "lookup_speedup": peer_us / array_us, "lookup_floor_speedup": peer_us / array_floor_us}
    row = {**common, "input": given, "lookup_us": 55.1, "lookup_speedup": peer_us / 55.1,
           "lookup_floor_us": floor_us, "lookup_floor_speedup": floor_x}
    return row, peer, [peer, array_row, row]


def test_a_missed_lookup_is_judged_on_its_floor_not_on_todays_array_lookup_on_top():
    """RESULTS.md's 2026-12-06 07:42 divergent @1 cell: ``TokenIds + turn`` floor 3.07x, 1.33x with the
    array lookup on top. The floor is above the target, so the verdict says so; the 1.33x is context."""
    from kvstate.bench import versus_sglang as v

    row, peer, rows = _miss_rows(v.TOKEN_IDS, 49.8 / 3.07, 3.07)
    note = v.miss_note(row, "lookup", peer, rows)
    assert note.startswith("floor 3.07x") and "the target is above this floor" in note and "BELOW" not in note
    assert "1.33x with this run's int64-array lookup past its cast on top" in note and "context" in note
    row, peer, rows = _miss_rows(v.TOKEN_IDS, 49.8 / 1.2, 1.2)        # a floor under the target: BELOW
    assert "the target is BELOW this floor" in v.miss_note(row, "lookup", peer, rows)


def test_a_list_row_counts_one_pass_over_the_ids_as_the_token_ids_row_does():
    """The list's floor (one marshal pass) validates and packs it: the array lookup's own cast is taken off
    the figure on top for a list exactly as for ``TokenIds``, so both print the same for the same numbers."""
    from kvstate.bench import versus_sglang as v

    notes = {}
    for given in (v.LIST, v.TOKEN_IDS):
        row, peer, rows = _miss_rows(given, 20.0, 49.8 / 20.0, array_us=20.0, array_floor_us=10.0)
        notes[given] = v.miss_note(row, "lookup", peer, rows)
    assert "1.66x with this run" in notes[v.LIST] and "1.66x with this run" in notes[v.TOKEN_IDS]   # 49.8 / (20 + 20 - 10)


def test_the_bounded_trees_are_sized_to_hold_as_many_requests():
    """SGLang's budget counts the shared system prompt once, kvstate's ``max_pages`` in every entry:
    kvstate's budget is derived so that both hold the same requests (here, of one size: exactly)."""
    from kvstate.bench import bounded_vs_sglang as b

    system, own = 10, 10
    requests = [np.arange(system + own)] * 40
    budget = system + 5 * own       # SGLang: the prompt once and 5 requests' own tokens
    assert b.requests_held([own] * 40, budget - system)[-1] == 5
    max_pages = b.kvstate_max_pages(requests, budget, system)
    assert max_pages == 5 * (system + own)          # the same 5 requests, the prompt counted in each
    assert b.requests_held([system + own] * 40, max_pages)[-1] == 5
    assert b.same_requests_held(42, 40) and not b.same_requests_held(42, 121)


def test_tree_scale_takes_the_smallest_tree_as_its_baseline_whatever_the_order_given():
    from kvstate.bench import tree_scale

    result = tree_scale.run(quick=True, rounds=1, sizes=(300, 100))
    assert [row["entries"] for row in result["rows"]] == [100, 300] and result["params"]["baseline_entries"] == 100
    assert result["rows"][0]["lookup_x_smallest"] == 1.0
    assert "lookup at 300 entries <= 1.2x the smallest tree's (100 entries)" in result["targets"]


def test_tree_scale_floor_loads_only_what_a_whole_key_hit_reads():
    """A whole-key hit shares the entry's very holding (``Cache._fork``: its length and fork count),
    never reading its page list or slots: the floor loads no more than that."""
    from kvstate.bench import tree_scale

    tree = tree_scale.Tree(20, 1, 10, np.random.default_rng(0))
    under = next(iter(tree.cache.tree.root.children.values())).children
    saved = {}
    for node in under.values():
        saved[node] = node.value._holding
        node.value._holding = SimpleNamespace(length=saved[node].length, forks=saved[node].forks)  # no pages, slots
    try:
        assert tree.touches(10) >= 0
    finally:
        for node, holding in saved.items():
            node.value._holding = holding


def test_issue_15_verdict_only_against_the_commit_it_was_filed_against():
    from kvstate.bench.one_token_pages import issue_15_targets

    ratio = {"match_speedup": 3.5, "retain_speedup": 2.0}
    filed = issue_15_targets(ratio, "/tmp/before", "9766fa8abcde")
    assert filed == {"match_speedup >= 3x (issue 15, against 9766fa8)": "3.50 met",
                     "retain_speedup >= 3x (issue 15, against 9766fa8)": "2.00 MISSED"}
    for commit in ("605ce68abcde", "9766fa8abcde+changes"):
        other = issue_15_targets(ratio, "/tmp/other", commit)
        assert set(other) == {f"match_speedup against {commit} (/tmp/other)", f"retain_speedup against {commit} (/tmp/other)"}
        assert not any(value.endswith(("met", "MISSED")) for value in other.values())


def test_fork_copy_prints_its_ratio_target_as_a_verdict_not_a_bare_number():
    from kvstate.bench import fork_copy

    result = fork_copy.run()
    (name,) = [name for name in result["targets"] if name.startswith("deepcopy_over_fork_time")]
    ratio = result["ratio"]["deepcopy_over_fork_time"]
    assert result["targets"][name] == f"{ratio:.0f} {'met' if ratio >= 100 else 'MISSED'}"
